"""The engine's step: the loop every serving engine runs once per iteration (Exercise 1.1).

vLLM's `EngineCore.step` and nano-vllm's `LLMEngine.step` make the same three calls: the scheduler
plans the step (a `SchedulerOutput`), the executor runs that plan, the scheduler learns what came
out. `EngineCore` (kvcourse/engine/llm_engine.py) calls `engine_step(core)` and keeps the books around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcourse.core.records import Deadlock, describe_stall
from kvcourse.core.request import Request

if TYPE_CHECKING:
    from kvcourse.engine.llm_engine import EngineCore


def engine_step(core: EngineCore) -> list[Request]:
    """One iteration, schedule -> execute -> update; returns the requests that finished in it."""
    # Exercise 1.1: the engine's step. When it returns, exactly one plan was made
    #   (core.scheduler.schedule_next_batch() returns a SchedulerOutput), core.executor.execute(plan)
    #   ran that plan whole, core.scheduler.update_from_output(plan, sampled_token_ids) took exactly the
    #   tokens it returned, and the step returns what the update returned (the finished requests).
    #   Each call ran inside its own `with core.phase(name, ...)`: "schedule" (no plan yet), then
    #   "execute" and "update" given the plan; the core times them and fails only what a fault touched.
    #   An empty plan raises Deadlock(describe_stall(core.scheduler, core.iteration)).
    # BEGIN SOLUTION 1.1
    with core.phase("schedule"):
        scheduler_output = core.scheduler.schedule_next_batch()
    if not scheduler_output:
        raise Deadlock(describe_stall(core.scheduler, core.iteration))
    with core.phase("execute", scheduler_output):
        sampled_token_ids = core.executor.execute(scheduler_output)
    with core.phase("update", scheduler_output):
        return core.scheduler.update_from_output(scheduler_output, sampled_token_ids)
    # END SOLUTION

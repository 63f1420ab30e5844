# kvcourse/step.py holds exercise 1.1: write only inside its TODO region (the rest is given).
"""The engine's step: the loop every serving engine runs once per iteration (Exercise 1.1).

vLLM's `EngineCore.step` and nano-vllm's `LLMEngine.step` make the same three calls: the scheduler
plans the step (a `SchedulerOutput`), the executor runs that plan, the scheduler learns what came
out. `EngineCore` (kvcourse/engine.py) calls `engine_step(core)` and keeps the books around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcourse.records import Deadlock, describe_stall  # noqa: F401
from kvcourse.request import Request

if TYPE_CHECKING:
    from kvcourse.engine import EngineCore


def engine_step(core: EngineCore) -> list[Request]:
    """One iteration, schedule -> execute -> update; returns the requests that finished in it."""
    # Exercise 1.1: the engine's step. When it returns:
    #   * core.scheduler has planned exactly one step (schedule_next_batch() returns a SchedulerOutput),
    #     core.executor has run that plan (execute(scheduler_output) returns the sampled tokens), and
    #     the scheduler's update_from_output(scheduler_output, sampled_token_ids) has taken exactly
    #     those tokens; the step returns what the update returned (the requests finished this step);
    #   * each call ran inside its own phase, `with core.phase(name, scheduler_output):` with name
    #     "schedule" (no plan yet: leave scheduler_output out), "execute" or "update": the core times
    #     it, records the plan, and if the call raises, fails only the requests it touched;
    #   * an empty plan (no request can make progress) raised Deadlock(describe_stall(core.scheduler,
    #     core.iteration)) instead of looping forever.
    # TODO: Exercise 1.1: write your code here, then delete the raise below.
    raise NotImplementedError("Exercise 1.1 (The engine's step): not written yet: edit kvcourse/step.py, engine_step.")

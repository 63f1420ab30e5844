"""The engine's step: the loop every serving engine runs once per iteration (Exercise 1.1).

vLLM's `EngineCore.step` and nano-vllm's `LLMEngine.step` make the same three calls: the scheduler
plans a batch, the model runs it, the scheduler learns what came out. Everything else an iteration
needs is given by `EngineCore` (kvcourse/engine.py), which calls `engine_step` and keeps the books:

  * `core.scheduler`, `core.executor`, `core.iteration` (this step's number, from 1);
  * `with core.phase(name, requests):` times the phase ("schedule", "execute" or "update") into this
    step's record and, if the code inside raises, marks `requests` FAILED, gives their blocks back and
    re-raises with their ids: a fault costs the requests it touched, never the engine
    (for "schedule" leave `requests` out: the core works out which requests planning touched);
  * `core.begin_batch(batch)` checks the scheduler's contract (a batch holds running requests only),
    records the step's plan, and returns the batch's requests in batch order;
  * `core.before_execute()` applies what must happen between planning and the model reading the cache
    (the copy-on-write block copies of notebook 04, and the live views' hooks);
  * `Deadlock` and `describe_stall(scheduler, iteration)` from kvcourse.engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcourse.engine import Deadlock, describe_stall  # noqa: F401
from kvcourse.request import Request

if TYPE_CHECKING:
    from kvcourse.engine import EngineCore


def engine_step(core: EngineCore) -> list[Request]:
    """One iteration, schedule -> execute -> update; returns the requests that finished in it."""
    # Exercise 1.1: the engine's step.
    #   When it returns, the scheduler has planned exactly one batch (`core.scheduler.schedule_next_batch()`),
    #   the executor has run that batch (`core.executor.execute(batch, block_tables)` returns the sampled
    #   tokens), and the scheduler has been given exactly those tokens for it
    #   (`core.scheduler.update_from_output(batch, sampled)`); the return value is what that update
    #   returned (the requests finished this step).
    #   Contract, in the order the engine needs it:
    #   * each of the three calls runs inside its own `core.phase(...)`, and a fault while executing or
    #     updating costs only the batch's requests;
    #   * `core.begin_batch(batch)` sees every batch that will run, before anything runs;
    #   * an empty batch means no request can make progress: raise Deadlock with describe_stall's
    #     explanation instead of looping forever;
    #   * the executor receives, with the batch, each batch request's block table (request id -> its
    #     block ids) as the scheduler's kv_cache_manager holds them AFTER planning (planning allocates);
    #     a scheduler with no kv_cache_manager (None: the memory-blind toy) gives None instead;
    #   * `core.before_execute()` runs after planning and before the executor, inside the execute phase.
    # TODO: Exercise 1.1: write your code here, then delete the raise below.
    raise NotImplementedError("Exercise 1.1 (The engine's step): not written yet: edit kvcourse/step.py, engine_step.")

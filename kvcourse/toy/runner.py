"""`run`: drive a scheduler with the toy executor to the end, through the engine's own loop (`EngineCore`).

The GPT-2 engine steps the same loop with a real model, and both record the same `StepRecord`: what
a notebook prints or plots for the toy world reads exactly like the engine's trace.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcourse.core.contract import SchedulerProtocol
from kvcourse.core.records import Deadlock, StepRecord, Trace, format_step
from kvcourse.core.sched_output import SchedulerOutput
from kvcourse.engine.llm_engine import EngineCore
from kvcourse.toy.executor import ToyExecutor


class Livelock(RuntimeError):
    """The run kept scheduling work for `max_iterations` steps without finishing (work undone and redone)."""

    trace: Trace | None = None  # the steps so far (set by `run`)


def run(
    scheduler: SchedulerProtocol,
    executor: ToyExecutor | None = None,
    max_iterations: int = 10_000,
    on_step: Callable[[int, SchedulerOutput, SchedulerProtocol], None] | None = None,
    verbose: bool = False,
) -> Trace:
    """Drive schedule -> execute -> update_from_output until every request is settled; return the trace.

    `on_step(iteration, scheduler_output, scheduler)` is called after each update (to snapshot the KV manager).
    Raises `Deadlock` when a step schedules nothing while requests are unfinished, and `Livelock`
    (a RuntimeError too) after `max_iterations` steps; both carry the `trace` so far, and leave the
    scheduler as it was (to inspect). Any other error inside a step fails the requests that step
    touched (blocks back) and is re-raised: see `EngineCore`.
    """
    executor = executor if executor is not None else ToyExecutor()
    manager = scheduler.kv_cache_manager
    if manager is not None and executor.block_size is None:
        executor.block_size = manager.block_size
    core = EngineCore(scheduler, executor)
    core.remember([*scheduler.active_pool.values(), *scheduler.waiting_queue, *scheduler.finished, *scheduler.rejected])
    core.on_schedule = lambda record: _print_step(record, scheduler) if verbose else None
    while scheduler.has_unfinished_requests():
        if core.iteration >= max_iterations:
            livelock = Livelock(
                f"the run did not finish within {max_iterations} iterations: work is being done and undone "
                f"({scheduler.num_preemptions} preemptions so far), a livelock."
            )
            livelock.trace = core.trace
            raise livelock
        if verbose:
            print(f"\n--- Iteration {core.iteration + 1} ---")
        try:
            record = core.step()
        except Deadlock as stall:
            stall.trace = core.trace  # what happened before the stall, to print or plot
            raise
        core.trace.steps.append(record)
        for request_id in record.finished:
            executor.release(request_id)
        if verbose and record.finished:
            finished = [core.trace.requests[rid] for rid in record.finished]
            print("Finished: " + ", ".join(f"Req {r.id} ({len(r.output_tokens)} tokens)" for r in finished))
        if on_step is not None:
            on_step(record.iteration, core.last_output, scheduler)
    return core.trace


def _print_step(step: StepRecord, scheduler: SchedulerProtocol) -> None:
    """The source lesson's style: the batch, then each request's state."""
    print(f"Scheduled {len(step.scheduled)} sequences:")
    known = {r.id: r for r in [*scheduler.active_pool.values(), *scheduler.waiting_queue]}
    for (rid, kind, n), (first, last), samples in zip(step.scheduled, step.positions, step.samples):
        request = known.get(rid)
        state = f" Cached: {request.num_computed_tokens}/{request.num_tokens} tokens." if request else ""
        sample = ", samples a token" if samples else ""
        where = f"position {first}" if first == last else f"positions {first}-{last}"
        size = f"{n} token{'s' * (n != 1)}"
        print(f"  - Req {rid}: {kind.capitalize()} {size} at {where}{sample}.{state}")


__all__ = ["Deadlock", "Livelock", "StepRecord", "Trace", "format_step", "run"]

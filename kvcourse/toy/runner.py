"""The run loop (schedule -> execute -> update_from_output) and its step-by-step trace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcourse.request import Request
from kvcourse.toy.executor import ToyExecutor, block_tables_for


class Deadlock(RuntimeError):
    """The scheduler planned an empty step while requests were unfinished: nothing can ever change."""

    trace: Trace | None = None  # the steps before the stall (set by `run`)


class Livelock(RuntimeError):
    """The run kept scheduling work for `max_iterations` steps without finishing (work undone and redone)."""

    trace: Trace | None = None  # the steps so far (set by `run`)


@dataclass
class StepRecord:
    """What one iteration did, for printing and plotting."""

    iteration: int
    scheduled: list[tuple[int, str, int]]  # (request id, "prefill" or "decode", tokens fed)
    positions: list[tuple[int, int]]  # (first, last) position of each scheduled sequence
    samples: list[bool]  # whether each scheduled sequence sampled a token
    resident_tokens: int  # tokens whose K/V the running requests hold during this step
    num_free_blocks: int | None  # after the step (None for a scheduler without a KV manager)
    preempted: list[int]  # request ids preempted while planning this step
    num_preemptions: int  # total so far
    finished: list[int]  # request ids finished by this step

    @property
    def num_tokens(self) -> int:
        """Tokens fed in this step (at most the token budget)."""
        return sum(n for _, _, n in self.scheduled)


@dataclass
class Trace:
    """Everything a run did, step by step, plus the requests it saw."""

    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[int, Request] = field(default_factory=dict)
    capacity_blocks: int | None = None
    block_size: int | None = None

    @property
    def num_preemptions(self) -> int:
        """Preemptions over the whole run."""
        return self.steps[-1].num_preemptions if self.steps else 0

    @property
    def peak_resident_tokens(self) -> int:
        """The most KV the running requests held at once."""
        return max((s.resident_tokens for s in self.steps), default=0)

    def outputs(self) -> dict[int, list[int]]:
        """Every seen request's generated tokens, by id."""
        return {rid: list(r.output_tokens) for rid, r in sorted(self.requests.items())}

    def format(self, limit: int | None = None) -> str:
        """One readable line per iteration (the first `limit` ones when given)."""
        steps = self.steps if limit is None else self.steps[:limit]
        lines = [format_step(step) for step in steps]
        if limit is not None and len(self.steps) > limit:
            lines.append(f"... {len(self.steps) - limit} more iterations")
        return "\n".join(lines)


def format_step(step: StepRecord) -> str:
    """`it  3 | R0 decode @15 | R1 prefill 16 @0-15 | free 93` (* = samples a token)."""
    parts = []
    for (rid, kind, n), (first, last), samples in zip(step.scheduled, step.positions, step.samples):
        where = f"@{first}" if first == last else f"@{first}-{last}"
        size = "" if kind == "decode" else f" {n}"
        parts.append(f"R{rid} {kind}{size} {where}{'*' if samples and kind != 'decode' else ''}")
    line = f"it {step.iteration:>3} | " + (", ".join(parts) if parts else "nothing scheduled")
    if step.num_free_blocks is not None:
        line += f" | free {step.num_free_blocks}"
    if step.preempted:
        line += f" | preempted {', '.join(f'R{r}' for r in step.preempted)}"
    if step.finished:
        line += f" | finished {', '.join(f'R{r}' for r in step.finished)}"
    return line


def _scheduler_requests(scheduler: Any) -> list[Request]:
    """Running then waiting requests (the names of the lesson's schedulers)."""
    return list(getattr(scheduler, "active_pool", {}).values()) + list(getattr(scheduler, "waiting_queue", ()))


def _describe_stall(scheduler: Any, iteration: int) -> str:
    """Why the run cannot go on, in words a learner can act on."""
    running = [r.id for r in getattr(scheduler, "active_pool", {}).values()]
    waiting = [r.id for r in getattr(scheduler, "waiting_queue", ())]
    manager = getattr(scheduler, "kv_cache_manager", None)
    free = f"; {manager.get_num_free_blocks()} of {manager.num_blocks} blocks free" if manager is not None else ""
    head = (
        f"iteration {iteration}: the scheduler planned an empty batch with requests unfinished "
        f"(running {running}, waiting {waiting}{free})"
    )
    if running:
        return (
            f"{head}: each running request needs one more block, only another running request could "
            "give one back, and none of them can run to the end to do so. The next step would be the "
            "same: a deadlock."
        )
    return (
        f"{head}: nothing is running and nothing was admitted. A correct scheduler moves its oldest "
        "request forward every step; is a request that can never fit the cache in the way?"
    )


def _print_step(step: StepRecord, scheduler: Any) -> None:
    """The source lesson's style: the batch, then each request's state."""
    print(f"Scheduled {len(step.scheduled)} sequences:")
    known = {r.id: r for r in _scheduler_requests(scheduler)}
    for (rid, kind, n), (first, last), samples in zip(step.scheduled, step.positions, step.samples):
        request = known.get(rid)
        state = f" Cached: {request.num_computed_tokens}/{request.num_tokens} tokens." if request else ""
        sample = ", samples a token" if samples else ""
        where = f"position {first}" if first == last else f"positions {first}-{last}"
        size = f"{n} token{'s' * (n != 1)}"
        print(f"  - Req {rid}: {kind.capitalize()} {size} at {where}{sample}.{state}")


def run(
    scheduler: Any,
    executor: ToyExecutor | None = None,
    max_iterations: int = 10_000,
    on_step: Callable[[int, list, Any], None] | None = None,
    verbose: bool = False,
) -> Trace:
    """Drive schedule -> execute -> update_from_output until every request is settled; return the trace.

    `on_step(iteration, batch, scheduler)` is called after each update (to snapshot the KV manager).
    Raises `Deadlock` when a step schedules nothing while requests are unfinished, and `Livelock`
    (a RuntimeError too) after `max_iterations` steps; both carry the `trace` so far.
    """
    manager = getattr(scheduler, "kv_cache_manager", None)
    executor = executor if executor is not None else ToyExecutor()
    if manager is not None and executor.block_size is None:
        executor.block_size = manager.block_size
    trace = Trace(
        capacity_blocks=getattr(manager, "num_blocks", None),
        block_size=getattr(manager, "block_size", None),
    )
    for request in (
        _scheduler_requests(scheduler)
        + list(getattr(scheduler, "finished", []))
        + list(getattr(scheduler, "rejected", []))
    ):
        trace.requests.setdefault(request.id, request)
    iteration = 0
    while scheduler.has_unfinished_requests():
        iteration += 1
        if iteration > max_iterations:
            livelock = Livelock(
                f"the run did not finish within {max_iterations} iterations: work is being done and undone "
                f"({getattr(scheduler, 'num_preemptions', 0)} preemptions so far), a livelock."
            )
            livelock.trace = trace
            raise livelock
        if verbose:
            print(f"\n--- Iteration {iteration} ---")
        try:
            step = _run_step(scheduler, executor, iteration, trace, verbose)
        except Deadlock as stall:
            stall.trace = trace  # what happened before the stall, to print or plot
            raise
        if on_step is not None:
            on_step(iteration, step[0], scheduler)
    return trace


def _run_step(
    scheduler: Any, executor: ToyExecutor, iteration: int, trace: Trace, verbose: bool
) -> tuple[list, StepRecord]:
    """One iteration: plan, execute, update, record."""
    before = {r.id: r.num_preemptions for r in _scheduler_requests(scheduler)}
    batch = scheduler.schedule_next_batch()
    if not batch:
        raise Deadlock(_describe_stall(scheduler, iteration))
    running = list(getattr(scheduler, "active_pool", {}).values())
    for request in running:
        trace.requests.setdefault(request.id, request)
    preempted = [
        r.id for r in _scheduler_requests(scheduler) if r.num_preemptions > before.get(r.id, r.num_preemptions)
    ]
    record = StepRecord(
        iteration=iteration,
        scheduled=[(s.request_id, "decode" if s.is_decode else "prefill", len(s.tokens)) for s in batch],
        positions=[(s.position_ids_start, s.position_ids_start + len(s.tokens) - 1) for s in batch],
        samples=[bool(getattr(s, "samples_token", s.is_decode)) for s in batch],
        resident_tokens=sum(r.num_computed_tokens for r in running),
        num_free_blocks=None,
        preempted=preempted,
        num_preemptions=getattr(scheduler, "num_preemptions", 0),
        finished=[],
    )
    if verbose:
        _print_step(record, scheduler)
    sampled = executor.execute(batch, block_tables_for(scheduler, batch))
    finished = scheduler.update_from_output(batch, sampled)
    for request in finished:
        executor.release(request.id)
    record.finished = [r.id for r in finished]
    manager = getattr(scheduler, "kv_cache_manager", None)
    record.num_free_blocks = manager.get_num_free_blocks() if manager is not None else None
    if verbose and finished:
        print("Finished: " + ", ".join(f"Req {r.id} ({len(r.output_tokens)} tokens)" for r in finished))
    trace.steps.append(record)
    return batch, record

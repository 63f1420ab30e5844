"""A toy model executor and run loop: watch a scheduler work without loading a real model.

The toy "model" predicts the next token as a hash of the WHOLE context it has cached for a request,
so it behaves like a real model in the ways that matter here:
  * the same context always gives the same next token, so recomputing after a preemption loses
    nothing and a memory-constrained run must reproduce an unconstrained one token for token;
  * it reads its own simulated KV cache, filled at the positions the scheduler gives, so a wrong
    token (a placeholder) or a wrong position changes the outputs or stops the run with a clear error.

    trace = run(scheduler)                    # schedule -> execute -> update_from_output, until done
    print(trace.format())                     # one line per iteration
    plot_timeline(trace); plot_memory(trace, capacity_tokens=1024)

Also here: `BlindStallFreeScheduler`, last lesson's scheduler that knows nothing about memory
(notebook 01), and `toy_generate`, the unconstrained reference.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcourse.request import Request, RequestStatus

TOY_VOCAB_SIZE = 1000
_MODULUS = (1 << 61) - 1  # a Mersenne prime: the context hash lives below it
_MULTIPLIER = 1_000_003


def _extend_hash(previous: int, token: int) -> int:
    """Hash of a context one token longer: every earlier token still counts."""
    return (previous * _MULTIPLIER + token + 1) % _MODULUS


def _token_from_hash(context_hash: int, vocab_size: int) -> int:
    """Spread the context hash over the vocabulary (a fixed mixing step, no randomness)."""
    mixed = (context_hash * 0x9E3779B97F4A7C15) % _MODULUS
    return (mixed >> 13) % vocab_size


def toy_next_token(context: Sequence[int], vocab_size: int = TOY_VOCAB_SIZE) -> int:
    """The toy model's prediction after `context`: a deterministic function of every token in it."""
    context_hash = 0
    for token in context:
        context_hash = _extend_hash(context_hash, token)
    return _token_from_hash(context_hash, vocab_size)


def toy_generate(
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    vocab_size: int = TOY_VOCAB_SIZE,
    eos_token_id: int | None = None,
) -> list[int]:
    """What the toy model generates with all the memory in the world: the reference for any scheduler."""
    context = list(prompt_tokens)
    outputs: list[int] = []
    while len(outputs) < max_new_tokens:
        token = toy_next_token(context, vocab_size)
        outputs.append(token)
        context.append(token)
        if token == eos_token_id:
            break
    return outputs


class ToyExecutor:
    """Stands in for the model: stores each fed token's "K/V" in a simulated cache and samples from the whole context.

    Given block tables (what a paged engine passes), the simulated cache is paged like the real one:
    token at position p of a request lives in slot p % block_size of block table[p // block_size], so
    prefix-cache hits read what another request wrote, and a token fed without a block is an error.
    Without block tables (last lesson's memory-blind scheduler), each request gets its own list.
    """

    def __init__(self, vocab_size: int = TOY_VOCAB_SIZE, block_size: int | None = None) -> None:
        """An empty simulated cache; block_size is needed only when block tables are passed."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size is {vocab_size}; the toy model needs at least one token id.")
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size is {block_size}; a block holds at least one token.")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token whose K/V is stored there
        self.cached_tokens: dict[int, list[int]] = {}  # without block tables: request id -> tokens by position

    def execute(self, batch: Sequence[Any], block_tables: dict[int, list[int]] | None = None) -> dict[int, int]:
        """Write each sequence's tokens at its positions, then sample one token where the sequence asks for it."""
        sampled: dict[int, int] = {}
        for sequence in batch:
            rid, tokens, start = sequence.request_id, list(sequence.tokens), sequence.position_ids_start
            self._check_tokens(rid, tokens)
            if block_tables is None:
                context = self._write_own(rid, tokens, start)
            else:
                context = self._write_paged(rid, tokens, start, block_tables.get(rid, []))
            if getattr(sequence, "samples_token", sequence.is_decode):
                sampled[rid] = toy_next_token(context, self.vocab_size)
        return sampled

    def _check_tokens(self, request_id: int, tokens: list[int]) -> None:
        """A real model would embed any id it is given; the toy one says when an id is not a real token."""
        if not tokens:
            raise ValueError(f"Request {request_id}: a scheduled sequence with no tokens.")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"Request {request_id}: token {bad[0]} is not in the toy vocabulary (0-{self.vocab_size - 1}); "
                "a placeholder token was fed to the model."
            )

    def _write_own(self, request_id: int, tokens: list[int], start: int) -> list[int]:
        """Unpaged: the request's own list; returns the context the next token is predicted from."""
        cached = self.cached_tokens.setdefault(request_id, [])
        if not 0 <= start <= len(cached):
            raise ValueError(
                f"Request {request_id}: tokens fed at position {start}, but only {len(cached)} positions "
                "hold cached K/V: a gap. Positions must come from num_computed_tokens."
            )
        del cached[start:]
        cached.extend(tokens)
        return list(cached)

    def _write_paged(self, request_id: int, tokens: list[int], start: int, table: list[int]) -> list[int]:
        """Paged: write through the block table, then read the whole context back through it."""
        if self.block_size is None:
            raise ValueError("ToyExecutor needs block_size to use block tables; pass the KV manager's block_size.")
        end = start + len(tokens)
        if end > len(table) * self.block_size:
            raise ValueError(
                f"Request {request_id}: tokens fed up to position {end - 1}, but its {len(table)} blocks hold "
                f"only {len(table) * self.block_size} tokens: a token was scheduled without memory."
            )
        for position, token in enumerate(tokens, start):
            self.slots[self._slot(table, position)] = token
        context = []
        for position in range(end):
            token = self.slots.get(self._slot(table, position))
            if token is None:
                raise ValueError(
                    f"Request {request_id}: position {position} was never written: a gap. "
                    "Positions must come from num_computed_tokens."
                )
            context.append(token)
        return context

    def _slot(self, table: list[int], position: int) -> tuple[int, int]:
        """Where a position's K/V lives: (block id, offset in the block)."""
        return table[position // self.block_size], position % self.block_size

    def release(self, request_id: int) -> None:
        """Forget a finished request's unpaged cache (paged slots stay, like real memory)."""
        self.cached_tokens.pop(request_id, None)


def block_tables_for(scheduler: Any, batch: Sequence[Any]) -> dict[int, list[int]] | None:
    """The block table of every request in the batch, as a paged engine hands them to the model."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    if manager is None:
        return None
    running = getattr(scheduler, "active_pool", {})
    return {s.request_id: manager.get_block_ids(running[s.request_id]) for s in batch if s.request_id in running}


# ---------------------------------------------------------------------------------------------
# The run loop and its trace


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
    head = (f"iteration {iteration}: the scheduler planned an empty batch with requests unfinished "
            f"(running {running}, waiting {waiting}{free})")
    if running:
        return (f"{head}: each running request needs one more block, only another running request could "
                "give one back, and none of them can run to the end to do so. The next step would be the "
                "same: a deadlock.")
    return (f"{head}: nothing is running and nothing was admitted. A correct scheduler moves its oldest "
            "request forward every step; is a request that can never fit the cache in the way?")


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
    for request in _scheduler_requests(scheduler) + list(getattr(scheduler, "finished", [])) + list(
        getattr(scheduler, "rejected", [])
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


def _run_step(scheduler: Any, executor: ToyExecutor, iteration: int, trace: Trace, verbose: bool) -> tuple[list, StepRecord]:
    """One iteration: plan, execute, update, record."""
    before = {r.id: r.num_preemptions for r in _scheduler_requests(scheduler)}
    batch = scheduler.schedule_next_batch()
    if not batch:
        raise Deadlock(_describe_stall(scheduler, iteration))
    running = list(getattr(scheduler, "active_pool", {}).values())
    for request in running:
        trace.requests.setdefault(request.id, request)
    preempted = [r.id for r in _scheduler_requests(scheduler) if r.num_preemptions > before.get(r.id, r.num_preemptions)]
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


# ---------------------------------------------------------------------------------------------
# Last lesson's scheduler: budget-aware, memory-blind


class BlindStallFreeScheduler:
    """Continuous batching with chunked prefill, planned by token budget and batch size alone."""

    def __init__(self, token_budget: int, max_batch_size: int) -> None:
        """The same knobs as last lesson: a token budget and a batch size, nothing about memory."""
        if token_budget <= 0 or max_batch_size <= 0:
            raise ValueError(
                f"token_budget ({token_budget}) and max_batch_size ({max_batch_size}) must both be positive."
            )
        self.token_budget = token_budget
        self.max_batch_size = max_batch_size
        self.waiting_queue: deque[Request] = deque()
        self.active_pool: dict[int, Request] = {}
        self.finished: list[Request] = []

    def add_request(self, request: Request) -> None:
        """Queue a request (a request with nothing to generate is finished at once)."""
        if request.is_complete():
            request.status = RequestStatus.FINISHED
            self.finished.append(request)
        else:
            self.waiting_queue.append(request)

    def schedule_next_batch(self) -> list:
        """Decodes, then the prefill in progress, then admissions: no question asked about memory."""
        from kvcourse.scheduler import ScheduledSequence  # the dataclass (never a stub)

        batch: list = []
        budget = self.token_budget
        for request in self.active_pool.values():
            if budget == 0:
                break
            if request.is_prefill_done():
                batch.append(self._advance(ScheduledSequence, request, 1, True))
                budget -= 1
            else:
                n = min(request.num_uncomputed_tokens, budget)
                batch.append(self._advance(ScheduledSequence, request, n, False))
                budget -= n
        while self.waiting_queue and budget > 0 and len(self.active_pool) < self.max_batch_size:
            request = self.waiting_queue.popleft()
            request.status = RequestStatus.RUNNING
            self.active_pool[request.id] = request
            n = min(request.num_tokens, budget)
            batch.append(self._advance(ScheduledSequence, request, n, False))
            budget -= n
        return batch

    @staticmethod
    def _advance(sequence_type: type, request: Request, n: int, is_decode: bool) -> Any:
        """The next n tokens of the request, at positions that follow its cached ones."""
        start = request.num_computed_tokens
        request.num_computed_tokens += n
        return sequence_type(request.id, request.all_token_ids[start : start + n], is_decode, start,
                             samples_token=request.num_computed_tokens == request.num_tokens)

    def update_from_output(self, batch: list, sampled_token_ids: dict[int, int]) -> list[Request]:
        """Append sampled tokens; finished requests leave (nothing to free: it never allocated)."""
        finished = []
        for sequence in batch:
            if sequence.samples_token:
                request = self.active_pool[sequence.request_id]
                request.output_tokens.append(sampled_token_ids[sequence.request_id])
                if request.is_complete():
                    request.status = RequestStatus.FINISHED
                    del self.active_pool[request.id]
                    self.finished.append(request)
                    finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting_queue or self.active_pool)


# ---------------------------------------------------------------------------------------------
# Workloads and pictures


def toy_requests(
    prompt_lengths: Sequence[int],
    max_new_tokens: int | Sequence[int],
    seed: int = 0,
    vocab_size: int = TOY_VOCAB_SIZE,
    first_id: int = 0,
) -> list[Request]:
    """Requests with seeded random prompts of the given lengths (same seed, same prompts)."""
    rng = random.Random(seed)
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompt_lengths)
    return [
        Request(id=first_id + i, prompt_tokens=[rng.randrange(vocab_size) for _ in range(length)], max_new_tokens=m)
        for i, (length, m) in enumerate(zip(prompt_lengths, max_new_tokens))
    ]


def memory_meter(used: int, capacity: int, width: int = 30, unit: str = "tokens") -> str:
    """A one-line text meter: `[##########----|xxx] 1180/1024 tokens  OVER by 156`."""
    if capacity <= 0:
        raise ValueError(f"capacity is {capacity}; it must be positive.")
    scale = width / max(capacity, used)
    filled = round(min(used, capacity) * scale)
    over = round(max(0, used - capacity) * scale)
    empty = round(capacity * scale) - filled
    bar = "#" * filled + "-" * empty + "|" + "x" * over
    note = f"  OVER by {used - capacity}" if used > capacity else ""
    return f"[{bar}] {used}/{capacity} {unit}{note}"


def _request_colors(ids: Sequence[int]) -> dict[int, Any]:
    """A stable colour per request id."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    return {rid: palette(i % 10) for i, rid in enumerate(sorted(ids))}


def plot_timeline(trace: Trace, ax: Any = None, title: str = "Which request runs in each iteration") -> Any:
    """One row per request, one column per iteration: wide bars prefill chunks, thin ticks decodes, x preemptions."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * max(3, len(trace.requests)) + 1.2))
    ids = sorted({rid for s in trace.steps for rid, _, _ in s.scheduled} | set(trace.requests))
    row = {rid: i for i, rid in enumerate(ids)}
    colors = _request_colors(ids)
    for step in trace.steps:
        for rid, kind, _ in step.scheduled:
            height = 0.8 if kind == "prefill" else 0.3
            ax.broken_barh([(step.iteration - 0.5, 1.0)], (row[rid] - height / 2, height),
                           facecolors=colors[rid], edgecolor="black" if kind == "prefill" else "none", linewidth=0.5)
        for rid in step.preempted:
            ax.plot(step.iteration, row[rid], marker="x", color="red", markersize=9, mew=2)
        for rid in step.finished:
            ax.plot(step.iteration + 0.5, row[rid], marker="|", color="black", markersize=12, mew=2)
    ax.set_yticks(range(len(ids)), [f"Req {rid}" for rid in ids])
    ax.invert_yaxis()
    ax.set_xlabel("iteration")
    ax.set_xlim(0.5, len(trace.steps) + 1.0)
    ax.set_title(title)
    legend = [Patch(facecolor="lightgray", edgecolor="black", label="prefill chunk (tall)"),
              Patch(facecolor="gray", label="decode (thin)")]
    if any(s.preempted for s in trace.steps):
        legend.append(plt.Line2D([], [], color="red", marker="x", linestyle="", label="preempted"))
    legend.append(plt.Line2D([], [], color="black", marker="|", linestyle="", markersize=10, label="finished"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


def plot_memory(trace: Trace, capacity_tokens: int, ax: Any = None, title: str = "KV memory the plan needs") -> Any:
    """Resident KV tokens per iteration against the cache's capacity; red where the plan does not fit."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.2))
    xs = [s.iteration for s in trace.steps]
    ys = [s.resident_tokens for s in trace.steps]
    ax.step(xs, ys, where="mid", color="tab:blue", label="resident KV tokens")
    ax.axhline(capacity_tokens, color="black", linestyle="--", label=f"capacity ({capacity_tokens} tokens)")
    over = [y > capacity_tokens for y in ys]
    if any(over):
        ax.fill_between(xs, ys, capacity_tokens, where=over, step="mid", color="red", alpha=0.35,
                        label="does not fit (OOM)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("tokens")
    ax.set_ylim(0, max(ys + [capacity_tokens]) * 1.1)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


__all__ = [
    "BlindStallFreeScheduler",
    "Deadlock",
    "Livelock",
    "StepRecord",
    "ToyExecutor",
    "Trace",
    "block_tables_for",
    "format_step",
    "memory_meter",
    "plot_memory",
    "plot_timeline",
    "run",
    "toy_generate",
    "toy_next_token",
    "toy_requests",
]

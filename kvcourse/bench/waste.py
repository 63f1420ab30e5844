"""Memory study: how much reserved KV memory holds token states, after the vLLM paper's Fig. 2.

One seeded request trace (ShareGPT-like, long-tailed prompt and output lengths) is replayed through
a pool of KV slots managed four ways: contiguous reservation by the maximum length (`max`), by the
prompt plus the next power of two of the output (`pow2`), by the true length (`oracle`), and the
paged `KVCacheManager` at several block sizes (`paged-N`). Every engine step while requests are
waiting (memory is the bottleneck), each slot of the pool is counted as one of:

- token states: holds the K/V of a token already in the sequence;
- reservation: reserved for a token the request will still produce;
- internal fragmentation: reserved but never used (beyond the request's true final length);
- external fragmentation (& other): free, yet the next waiting request could not get it.

    python -m kvcourse.bench waste --quick --json [--reference]   # your KVCacheManager, or the reference's
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kvcourse.bench.common import device_name, emit, not_written, parse_args, progress, run_reference, whose_code

CONTIGUOUS = ("max", "pow2", "oracle")
PARTS = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation")
PAPER_FIG2 = {"max": 0.204, "pow2": 0.268, "oracle": 0.382, "paged-16": 0.963}  # vLLM paper, Fig. 2


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: its prompt length and the number of tokens it will really produce."""

    id: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        """Slots the request holds when it finishes (prompt plus every output token)."""
        return self.prompt_len + self.output_len


def make_trace(num_requests: int, seed: int = 0, max_model_len: int = 2048) -> list[TraceRequest]:
    """ShareGPT-like lengths: log-normal, median 80 prompt / 200 output tokens, means about 160 / 330."""
    rng = random.Random(seed)
    trace = []
    for i in range(num_requests):
        prompt = min(max(4, round(rng.lognormvariate(math.log(80), 1.2))), max_model_len // 2)
        output = min(max(1, round(rng.lognormvariate(math.log(200), 1.0))), max_model_len - prompt)
        trace.append(TraceRequest(i, prompt, output))
    return trace


def next_pow2(n: int) -> int:
    """Smallest power of two that is at least n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def reserved_slots(scheme: str, req: TraceRequest, max_model_len: int) -> int:
    """What a contiguous scheme reserves at admission, since it cannot grow a sequence in place."""
    if scheme == "max":
        return max_model_len
    if scheme == "pow2":
        return min(max_model_len, req.prompt_len + next_pow2(req.output_len))
    if scheme == "oracle":
        return req.total_len
    raise ValueError(f"unknown contiguous scheme {scheme!r}; use one of {CONTIGUOUS}")


class FirstFitPool:
    """A linear KV region handed out in contiguous ranges, first fit: holes between ranges are wasted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.starts: list[int] = []  # sorted starts of the allocated ranges
        self.sizes: dict[int, int] = {}

    def allocate(self, size: int) -> int | None:
        """The start of the first hole of at least `size` slots, or None (touching nothing)."""
        cursor = 0
        for start in self.starts:
            if start - cursor >= size:
                break
            cursor = start + self.sizes[start]
        else:
            if self.capacity - cursor < size:
                return None
        bisect.insort(self.starts, cursor)
        self.sizes[cursor] = size
        return cursor

    def free(self, start: int) -> None:
        """Give a range back; it merges with its neighbouring holes implicitly."""
        self.starts.remove(start)
        del self.sizes[start]


@dataclass
class Running:
    """A request in the batch: how many tokens it has stored and how many slots it holds."""

    req: TraceRequest
    stored: int
    handle: object = None  # contiguous: the range start; paged: the kvcourse Request


@dataclass
class Tally:
    """Slot-steps per category, summed over the steps where memory was the bottleneck."""

    capacity: int
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    steps: int = 0
    batch_sum: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0

    def record(self, running: list[Running], held: list[int]) -> None:
        """Classify every slot of the pool at this step."""
        for run, slots in zip(running, held):
            used_later = min(slots, run.req.total_len)
            self.parts["token_states"] += run.stored
            self.parts["reservation"] += used_later - run.stored
            self.parts["internal_fragmentation"] += slots - used_later
        self.parts["external_fragmentation"] += self.capacity - sum(held)
        self.steps += 1
        self.batch_sum += len(running)

    def result(self) -> dict:
        """Shares of the pool (they sum to 1), mean batch size and preemptions."""
        total = max(1, self.steps * self.capacity)
        shares = {k: v / total for k, v in self.parts.items()}
        return {
            "shares": shares,
            "mean_batch": self.batch_sum / max(1, self.steps),
            "steps_measured": self.steps,
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
        }


def replay_contiguous(trace: list[TraceRequest], scheme: str, capacity: int, max_model_len: int) -> dict:
    """FCFS replay where each request reserves one contiguous range at admission."""
    pool, waiting, running = FirstFitPool(capacity), deque(trace), []
    tally = Tally(capacity)
    while waiting or running:
        while waiting:
            start = pool.allocate(reserved_slots(scheme, waiting[0], max_model_len))
            if start is None:
                break
            req = waiting.popleft()
            running.append(Running(req, req.prompt_len, start))
        if waiting:
            tally.record(running, [pool.sizes[r.handle] for r in running])
        running = _decode_contiguous(running, pool)
    return tally.result()


def _decode_contiguous(running: list[Running], pool: FirstFitPool) -> list[Running]:
    """One token per request; finished requests give their range back."""
    still = []
    for run in running:
        run.stored += 1
        if run.stored >= run.req.total_len:
            pool.free(run.handle)
        else:
            still.append(run)
    return still


def replay_paged(trace: list[TraceRequest], block_size: int, capacity: int, manager_cls: type | None = None) -> dict:
    """FCFS replay through the paged KVCacheManager: blocks on demand, preemption by recompute."""
    from kvcourse.core.request import Request

    if manager_cls is None:
        from kvcourse.kv_cache import KVCacheManager as manager_cls
    manager = manager_cls(num_blocks=capacity // block_size, block_size=block_size)
    waiting: deque[Running] = deque(
        Running(t, 0, Request(id=t.id, prompt_tokens=[0] * t.prompt_len, max_new_tokens=t.output_len)) for t in trace
    )
    running: list[Running] = []
    tally = Tally(capacity // block_size * block_size)
    while waiting or running:
        _admit_paged(waiting, running, manager)
        if waiting:
            held = [len(manager.get_block_ids(r.handle)) * block_size for r in running]
            tally.record(running, held)
        running = _decode_paged(running, waiting, manager, tally)
    return tally.result()


def _admit_paged(waiting: deque[Running], running: list[Running], manager) -> None:
    """Admit from the head while the whole prefill fits (the prompt; plus kept outputs after a preemption)."""
    while waiting:
        run = waiting[0]
        tokens = run.req.prompt_len + run.stored  # stored counts outputs kept across a preemption
        if manager.allocate_slots(run.handle, tokens) is None:
            return
        waiting.popleft()
        run.handle.num_computed_tokens = tokens
        run.stored = tokens
        running.append(run)


def _decode_paged(running: list[Running], waiting: deque[Running], manager, tally: Tally) -> list[Running]:
    """One token per request; when no block is free, preempt the newest request (recompute later)."""
    i = 0
    while i < len(running):
        run = running[i]
        while manager.allocate_slots(run.handle, 1) is None:
            victim = running.pop()
            manager.free(victim.handle)
            victim.handle.num_computed_tokens = 0
            victim.stored -= victim.req.prompt_len  # keep only the outputs generated so far
            waiting.appendleft(victim)
            tally.preemptions += 1
            tally.recomputed_tokens += victim.req.prompt_len + victim.stored
            if victim is run:
                break
        else:
            run.stored += 1
            run.handle.num_computed_tokens += 1
            i += 1
    still = []
    for run in running:
        if run.stored >= run.req.total_len:
            manager.free(run.handle)
        else:
            still.append(run)
    return still


def run(
    quick: bool = True,
    *,
    num_requests: int | None = None,
    capacity: int = 16384,
    max_model_len: int = 2048,
    block_sizes: tuple[int, ...] = (1, 8, 16, 32, 64, 128),
    seed: int = 0,
    reference: bool = False,
) -> dict:
    """Replay the trace through every scheme (your KVCacheManager, or with reference=True solutions/'s)."""
    if reference:
        arguments = {"quick": quick, "num_requests": num_requests, "capacity": capacity}
        arguments |= {"max_model_len": max_model_len, "block_sizes": list(block_sizes), "seed": seed}
        return run_reference("waste", arguments)
    if capacity < max_model_len:
        raise ValueError(f"capacity {capacity} is below max_model_len {max_model_len}: a long request could never run.")
    num_requests = num_requests or (300 if quick else 1000)
    trace = make_trace(num_requests, seed, max_model_len)
    schemes = [*CONTIGUOUS, *(f"paged-{b}" for b in block_sizes)]
    results = {}
    for scheme in progress(schemes, "memory schemes"):
        if scheme in CONTIGUOUS:
            results[scheme] = replay_contiguous(trace, scheme, capacity, max_model_len)
        else:
            results[scheme] = replay_paged(trace, int(scheme.split("-")[1]), capacity)
    return {
        "device": device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "study": "memory",
        "code": whose_code("kv_cache"),
        "trace": _trace_summary(trace, seed, capacity, max_model_len),
        "utilization": {s: r["shares"]["token_states"] for s, r in results.items()},
        "breakdown": {s: r["shares"] for s, r in results.items()},
        "mean_batch": {s: r["mean_batch"] for s, r in results.items()},
        "preemptions": {s: r["preemptions"] for s, r in results.items()},
        "recomputed_tokens": {s: r["recomputed_tokens"] for s, r in results.items()},
        "paper_fig2": PAPER_FIG2,
    }


def _trace_summary(trace: list[TraceRequest], seed: int, capacity: int, max_model_len: int) -> dict:
    """The workload in numbers, so a reader can judge the figures."""
    prompts = sorted(t.prompt_len for t in trace)
    outputs = sorted(t.output_len for t in trace)
    n = len(trace)
    return {
        "num_requests": n,
        "seed": seed,
        "capacity_slots": capacity,
        "max_model_len": max_model_len,
        "prompt_mean": sum(prompts) / n,
        "prompt_median": prompts[n // 2],
        "prompt_max": prompts[-1],
        "output_mean": sum(outputs) / n,
        "output_median": outputs[n // 2],
        "output_max": outputs[-1],
    }


def print_table(result: dict, show_device: bool = True) -> None:
    """One row per scheme: the four shares, mean batch size and preemptions (device off: same on every machine)."""
    t = result["trace"]
    where = f" on {result['device']}" if show_device else ""
    print(
        f"memory study{where}: {t['num_requests']} requests (seed {t['seed']}), "
        f"pool {t['capacity_slots']} slots, max length {t['max_model_len']}"
    )
    print(
        f"  prompt mean {t['prompt_mean']:.0f} median {t['prompt_median']} max {t['prompt_max']}; "
        f"output mean {t['output_mean']:.0f} median {t['output_median']} max {t['output_max']}"
    )
    print(f"{'scheme':<10} {'tokens':>7} {'reserv':>7} {'internal':>8} {'external':>8} {'batch':>6} {'preempt':>7}")
    for scheme, shares in result["breakdown"].items():
        cells = " ".join(f"{shares[p]:>{w}.1%}" for p, w in zip(PARTS, (7, 7, 8, 8)))
        print(f"{scheme:<10} {cells} {result['mean_batch'][scheme]:>6.1f} {result['preemptions'][scheme]:>7}")


COLORS = {
    "token_states": "#4c956c",
    "reservation": "#f2c14e",
    "internal_fragmentation": "#f78154",
    "external_fragmentation": "#b0b0b0",
}
LABELS = {
    "token_states": "token states",
    "reservation": "reservation",
    "internal_fragmentation": "internal fragmentation",
    "external_fragmentation": "external fragmentation & other",
}


def plot_breakdown(result: dict, schemes: tuple[str, ...] = ("max", "pow2", "oracle", "paged-16")):
    """Fig. 2 side by side: our four-way split per scheme, and the paper's token-state shares."""
    import matplotlib.pyplot as plt

    fig, (ours, paper) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(schemes)
    for part in PARTS:
        values = [100 * result["breakdown"][s][part] for s in schemes]
        ours.bar(schemes, values, bottom=bottom, color=COLORS[part], label=LABELS[part])
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, s in enumerate(schemes):
        share = result["utilization"][s]
        ours.text(i, 50 * share, f"{share:.1%}", ha="center", color="white", weight="bold")
    ours.set(ylabel="% of the KV pool", ylim=(0, 100), title="this trace, measured")
    ours.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.12), ncol=2)
    names = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)", "paged-16": "vLLM"}
    bars = paper.bar(
        [names[s] for s in PAPER_FIG2], [100 * v for v in PAPER_FIG2.values()], color=COLORS["token_states"]
    )
    paper.bar_label(bars, fmt="%.1f%%")
    paper.set(ylim=(0, 105), title="vLLM paper, Fig. 2 (token states only)")
    paper.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def plot_block_sizes(result: dict, ax=None):
    """Token-state share against block size for the paged manager; contiguous schemes as lines."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(5, 3.5))[1]
    paged = sorted((int(s.split("-")[1]), u) for s, u in result["utilization"].items() if s.startswith("paged-"))
    ax.plot([b for b, _ in paged], [100 * u for _, u in paged], "o-", color=COLORS["token_states"], label="paged")
    for scheme, style in zip(CONTIGUOUS, (":", "--", "-.")):
        ax.axhline(100 * result["utilization"][scheme], ls=style, color="gray", label=scheme)
    ax.set(
        xscale="log",
        xlabel="block size (tokens)",
        ylabel="% of pool holding token states",
        ylim=(0, 100),
        title="memory: utilisation vs block size",
    )
    ax.set_xticks([b for b, _ in paged], [str(b) for b, _ in paged])
    ax.minorticks_off()
    ax.legend(fontsize=8, loc="lower left")
    return ax


def main(argv: list[str] | None = None) -> int:
    """`python -m kvcourse.bench waste [--quick] [--json]`."""
    args = parse_args("waste", "share of reserved KV memory holding token states, per scheme", argv)
    try:
        result = run(quick=args.quick, reference=args.reference)
    except NotImplementedError as error:
        return not_written(error, "waste")
    print_table(result)
    emit(result, args.json)
    return 0

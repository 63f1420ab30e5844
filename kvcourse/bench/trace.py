"""Mooncake's production traces through your KVCacheManager: prefix hit rate against cache capacity.

The Mooncake paper (FAST'25, section 5.3.1, Figure 9) replays its traces in request order only (no
timing: the "theoretical" hit rate) through caches of 10^4 to 10^9 tokens, and says that 3 million
tokens reach less than half of the maximum hit rate in most workloads while 50 million come close
to it. This study does the same through the course's own manager, not a separate simulator:

- each 512-token trace block is one block of a `KVCacheManager` with prefix caching; its tokens are
  stand-ins made from its hash id (`kvcourse.bench.traces.prompt_tokens`, 2 tokens per block), so the
  manager's own hash chain finds exactly the sharing the trace records;
- a capacity of C tokens is C // 512 blocks;
- each request in turn: `get_computed_blocks` (the prefix hits), `allocate_slots` for its full blocks
  (a partial last block is never cached, so it is not allocated), `free` (its blocks stay cached
  and are evicted least recently used first, a request's tail before its head). A request longer
  than the cache allocates only as many leading blocks as the cache holds;
- hit rate = 512 x (blocks hit) / (prompt tokens), summed over the trace: full-block hits only, and,
  as in vLLM, never the block holding the prompt's last token (it must be computed to sample);
- the infinite cache is a cache as large as the trace's distinct full blocks: it never evicts.

    python -m kvcourse.bench trace [--quick] [--json]      # YOUR kvcourse/kv_cache.py (and eviction.py)
    python -m kvcourse.bench trace --reference             # the reference solutions/

--quick replays fewer capacities (the decades); the traces are always replayed whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvcourse.bench.common import device_name, emit, not_written, parse_args, run_reference, whose_code
from kvcourse.bench.traces import PROVENANCE, TRACE_BLOCK_SIZE, TraceRequest, load_trace, to_request
from kvcourse.core.request import Request

BLOCK_SIZE = 2  # stand-in tokens per 512-token trace block (any size >= 2 gives the same hits)
CAPACITIES = (
    10**4,
    3 * 10**4,
    10**5,
    3 * 10**5,
    10**6,
    3 * 10**6,
    10**7,
    3 * 10**7,
    5 * 10**7,
    10**8,
    3 * 10**8,
    10**9,
)
QUICK_CAPACITIES = (10**4, 10**5, 10**6, 3 * 10**6, 10**7, 5 * 10**7, 10**8, 10**9)
EVICTION_CAPACITIES = (10**6, 3 * 10**6, 10**7)  # where the policies differ (larger caches hold almost everything)
PAPER_CACHE_RATIO = {"conversation": 0.40, "synthetic": 0.66}  # the paper's Table 2 ("about 40%", 66%)
CLOSE = 0.9  # "close to the maximum": at least 90% of it
# Hit rates are stored with 6 digits: rounded to 4 first, 0.04255 printed as 4.2% where the notebook,
# printing the exact rate, says 4.3% (issue 39: README and notebook 04 disagreed by that tenth).
RATE_DIGITS = 6
# What vLLM 0.33.0 gives the model executor of one GPU: the default of CacheConfig.gpu_memory_utilization
# (scripts/check_vllm.py finds "default=0.92" in the wheel: notebooks/data/vllm_checked.json; a test reads both).
# Notebook 04's "one GPU's worth" of KV cache is this share of the memory less the weights.
VLLM_GPU_MEMORY_UTILIZATION = 0.92
HIT_DEFINITION = (
    "prefix-hit tokens over prompt tokens, request order only: 512 tokens per full block found in the cache at "
    "admission (never the block of a prompt's last token), LRU eviction (a request's tail before its head)"
)


@dataclass
class Replay:
    """One replay of a trace through one cache: what was asked, what hit, how long it took."""

    num_blocks: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    seconds: float  # wall clock
    cpu_seconds: float  # this process's CPU time: what the replay costs on a busy machine
    tier_blocks: int = 0  # a second tier's capacity in blocks (lesson 10); 0: the device cache alone
    tier_hit_tokens: int = 0  # of hit_tokens, those loaded from the second tier (not recomputed, not on the device)

    @property
    def hit_rate(self) -> float:
        """Prefix-hit tokens over prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def capacity_blocks(capacity_tokens: int) -> int:
    """Whole 512-token blocks in a cache of this many tokens."""
    if capacity_tokens < TRACE_BLOCK_SIZE:
        raise ValueError(f"a cache of {capacity_tokens} tokens holds no {TRACE_BLOCK_SIZE}-token block.")
    return capacity_tokens // TRACE_BLOCK_SIZE


def distinct_blocks(trace: Sequence[TraceRequest]) -> int:
    """Distinct full blocks in the trace: a cache this large never evicts one."""
    return len({hash_id for request in trace for hash_id in request.hash_ids[: request.num_full_blocks]})


def trace_requests(trace: Sequence[TraceRequest], block_size: int = BLOCK_SIZE) -> list[Request]:
    """The trace as course Requests (built once, replayed through many caches: the replay changes none)."""
    return [to_request(request, i, block_size) for i, request in enumerate(trace)]


def replay(
    trace: Sequence[TraceRequest],
    requests: Sequence[Request],
    num_blocks: int,
    block_size: int = BLOCK_SIZE,
    pool_class: type | None = None,
    tier_blocks: int = 0,
) -> Replay:
    """Admit and free every request in order through a fresh prefix-caching KVCacheManager; count the hits.

    tier_blocks > 0 adds lesson 10's CPU tier (kvcourse/offload.py): blocks the device evicts go there, and
    after the device's hits an admission loads what the tier holds (a hit promotes the block to the device).
    """
    from kvcourse.kv_cache import KVCacheManager

    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    if pool_class is not None:
        from kvcourse.eviction import with_policy

        with_policy(manager, pool_class)
    tier = _tier(manager, tier_blocks)
    hit_blocks = tier_hit_blocks = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for source, request in zip(trace, requests, strict=True):
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        num_external = tier.get_num_new_matched_tokens(request, num_hit_tokens) if tier is not None else 0
        num_tokens = min(source.num_full_blocks, num_blocks) * block_size  # the full blocks that fit
        num_external = min(num_external, max(0, num_tokens - num_hit_tokens))
        blocks = manager.allocate_slots(request, num_tokens - num_hit_tokens, num_hit_tokens, hits)
        if blocks is None:
            raise RuntimeError(
                f"allocate_slots refused request {request.id} ({num_tokens // block_size} blocks) in an empty "
                f"cache of {num_blocks} blocks: check exercise 3.3."
            )
        if num_external:
            request.num_computed_tokens = num_hit_tokens
            loaded = tier.update_state_after_alloc(request, blocks, num_external) // block_size
            request.num_computed_tokens = 0
            tier.take_transfers()  # the copies a real engine would run
            tier_hit_blocks += loaded
        manager.free(request)
        hit_blocks += num_hit_tokens // block_size
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    prompt_tokens = sum(request.input_length for request in trace)
    total = (hit_blocks + tier_hit_blocks) * TRACE_BLOCK_SIZE
    return Replay(
        num_blocks, len(trace), prompt_tokens, total, seconds, cpu_seconds, tier_blocks,
        tier_hit_blocks * TRACE_BLOCK_SIZE,
    )  # fmt: skip


def _tier(manager: object, tier_blocks: int) -> object | None:
    """Lesson 10's CPU tier wired to the manager, or None for the device cache alone."""
    if not tier_blocks:
        return None
    from kvcourse.offload import make_tier

    return make_tier(manager, tier_blocks)


def hit_rate_curve(
    trace: Sequence[TraceRequest],
    capacities: Sequence[int],
    block_size: int = BLOCK_SIZE,
    pool_class: type | None = None,
    requests: Sequence[Request] | None = None,
) -> tuple[dict[int, Replay], Replay]:
    """A replay per capacity (capped at the distinct blocks: one replay serves every cache that large), and the maximum."""
    requests = trace_requests(trace, block_size) if requests is None else requests
    unbounded = max(1, distinct_blocks(trace))
    done: dict[int, Replay] = {}
    curve = {}
    for capacity in capacities:
        num_blocks = min(capacity_blocks(capacity), unbounded)
        if num_blocks not in done:
            done[num_blocks] = replay(trace, requests, num_blocks, block_size, pool_class)
        curve[capacity] = done[num_blocks]
    if unbounded not in done:
        done[unbounded] = replay(trace, requests, unbounded, block_size, pool_class)
    return curve, done[unbounded]


def paper_statements(rates: dict[int, float], maximum: float) -> dict[str, bool]:
    """The paper's two claims about the theoretical hit rate, checked on one trace."""
    return {
        "3M_below_half_of_max": rates[3 * 10**6] < 0.5 * maximum,
        "50M_close_to_max": rates[5 * 10**7] >= CLOSE * maximum,
    }


def study_trace(name: str, capacities: Sequence[int]) -> dict:
    """Load one trace and replay it at every capacity."""
    trace = load_trace(name)
    start = time.perf_counter()
    curve, maximum = hit_rate_curve(trace, capacities)
    rates = {capacity: r.hit_rate for capacity, r in curve.items()}
    replays = {r.num_blocks: r for r in [*curve.values(), maximum]}
    return {
        "requests": len(trace),
        "prompt_tokens": maximum.prompt_tokens,
        "distinct_blocks": maximum.num_blocks,
        "max_hit_rate": round(maximum.hit_rate, RATE_DIGITS),
        "hit_rate": {str(capacity): round(rate, RATE_DIGITS) for capacity, rate in rates.items()},
        "paper": paper_statements(rates, maximum.hit_rate),
        "paper_cache_ratio": PAPER_CACHE_RATIO.get(name),
        "replays": len(replays),
        "replay_seconds_3M": round(curve[3 * 10**6].seconds, 3),
        "replay_cpu_seconds_3M": round(curve[3 * 10**6].cpu_seconds, 3),
        "seconds": round(time.perf_counter() - start, 3),
    }


def eviction_study(name: str, capacities: Sequence[int]) -> dict:
    """LRU (your BlockPool) against FIFO and LFU (your exercise 4.7) on the same replay."""
    from kvcourse.eviction import POLICIES

    trace = load_trace(name)
    requests = trace_requests(trace)
    rates: dict[str, dict[str, float]] = {}
    for policy, pool_class in POLICIES.items():
        runs = [replay(trace, requests, capacity_blocks(c), pool_class=pool_class) for c in capacities]
        rates[policy] = {str(c): round(r.hit_rate, RATE_DIGITS) for c, r in zip(capacities, runs)}
    return {"trace": name, "hit_rate": rates}


def run(quick: bool = False, *, reference: bool = False) -> dict:
    """The whole study: both traces at every capacity, the paper's claims, the eviction policies."""
    if reference:
        return run_reference("trace", {"quick": quick})
    capacities = QUICK_CAPACITIES if quick else CAPACITIES
    result = {
        "device": device_name(),
        "manager": whose_code("kv_cache"),
        "quick": quick,
        "block_size": BLOCK_SIZE,
        "source": PROVENANCE,
        "definition": HIT_DEFINITION,
        "traces": {name: study_trace(name, capacities) for name in ("conversation", "synthetic")},
    }
    try:
        result["eviction"] = eviction_study("conversation", EVICTION_CAPACITIES[1:2] if quick else EVICTION_CAPACITIES)
    except NotImplementedError as error:  # your 4.7 is not written yet: the curves above stand without it
        result["eviction"] = {"not_written": str(error)}
    return result


def _tokens(capacity: int) -> str:
    """10**6 -> '1e6', 3 * 10**6 -> '3e6'."""
    mantissa, exponent = f"{capacity:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def report(result: dict) -> str:
    """Tables a person reads: hit rate per capacity for both traces, the paper's claims in words, the policies."""
    names = list(result["traces"])
    lines = [
        f"Mooncake traces through {result['manager']} on {result['device']}"
        f"{' (--quick)' if result['quick'] else ''}: theoretical prefix hit rate (request order only)",
        f"source: {result['source']}",
        f"hit rate: {result['definition']}",
        f"{'cache (tokens)':>15}  " + "  ".join(f"{name:>12}" for name in names),
    ]
    for capacity in sorted(result["traces"][names[0]]["hit_rate"], key=int):  # JSON keys come back sorted as text
        row = "  ".join(f"{result['traces'][name]['hit_rate'][capacity]:>12.1%}" for name in names)
        lines.append(f"{_tokens(int(capacity)):>15}  {row}")
    lines.append(f"{'infinite':>15}  " + "  ".join(f"{result['traces'][n]['max_hit_rate']:>12.1%}" for n in names))
    lines.append(
        f"{'paper, Table 2':>15}  " + "  ".join(f"{result['traces'][n]['paper_cache_ratio']:>12.0%}" for n in names)
    )
    for name in names:
        study = result["traces"][name]
        maximum, rates = study["max_hit_rate"], study["hit_rate"]
        claims = study["paper"]
        lines.append(
            f"{name}: 3M tokens give {rates[str(3 * 10**6)]:.1%}, "
            f"{'less' if claims['3M_below_half_of_max'] else 'NOT less'} than half the maximum {maximum:.1%} "
            f"(the paper's first claim {'holds' if claims['3M_below_half_of_max'] else 'does not hold'}); "
            f"50M give {rates[str(5 * 10**7)]:.1%}, "
            f"{'close to' if claims['50M_close_to_max'] else 'NOT close to'} it (at least {CLOSE:.0%} of it: the "
            f"second claim {'holds' if claims['50M_close_to_max'] else 'does not hold'})."
        )
        lines.append(
            f"  {study['requests']:,} requests, {study['prompt_tokens']:,} prompt tokens, "
            f"{study['distinct_blocks']:,} distinct full blocks; one full replay (3e6 tokens) took "
            f"{study['replay_seconds_3M']:.2f} s ({study['replay_cpu_seconds_3M']:.2f} s of CPU), "
            f"all {study['replays']} replays {study['seconds']:.1f} s"
        )
    eviction = result["eviction"]
    if "not_written" in eviction:
        lines.append(f"eviction policies: skipped ({eviction['not_written']})")
    else:
        policies = eviction["hit_rate"]
        capacities = sorted(next(iter(policies.values())), key=int)
        lines.append(f"eviction policies on the {eviction['trace']} trace (hit rate):")
        lines.append(f"{'cache (tokens)':>15}  " + "  ".join(f"{p:>8}" for p in policies))
        for capacity in capacities:
            lines.append(
                f"{_tokens(int(capacity)):>15}  " + "  ".join(f"{policies[p][capacity]:>8.1%}" for p in policies)
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvcourse.bench trace [--quick] [--json] [--reference]`."""
    args = parse_args("trace", __doc__.splitlines()[0], argv)
    try:
        result = run(args.quick, reference=args.reference)
    except NotImplementedError as error:
        return not_written(error, "trace")
    print(report(result))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

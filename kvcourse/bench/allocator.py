"""Allocator study: allocate + free time per block as the pool grows from 1,000 to 1,000,000 blocks.

The paged `BlockPool` (a doubly linked free-block queue) and a naive allocator (a Python list of
free flags, searched from the start for every block) run the same workload, side by side in one
run: a busy server, where running requests hold all but 64 blocks and each repetition allocates 16
blocks and frees them again. The paged pool's cost per block should not depend on the pool's size
(O(1)); the naive one grows with it (O(n)).

    python -m kvcourse.bench allocator [--quick] [--json]      # measures YOUR kvcourse/kv_cache.py
    python -m kvcourse.bench allocator --reference             # measures the reference solutions/

Method: pools are built outside the timed region; the garbage collector is paused while timing
(its full collections walk every block object, which would measure Python, not the allocator);
sizes are interleaved in every round, and the best round is kept.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence

from kvcourse.bench.common import device_name, emit, not_written, parse_args, progress, run_reference, whose_code

SIZES = (1_000, 10_000, 100_000, 1_000_000)
BATCH = 16  # blocks allocated, then freed, per repetition
FREE_WINDOW = 64  # blocks left free in the busy pool
GOAL_RATIO = 1.3
PAGED_REPS = 250  # repetitions per timed measurement (a few milliseconds)


def _rounds(quick: bool) -> tuple[int, int]:
    """Timed rounds for (paged, naive): the naive allocator is slow enough to need few."""
    return (15, 3) if quick else (40, 5)


class NaiveAllocator:
    """What not to do: a list of free flags, searched from the start for every block (O(n))."""

    def __init__(self, num_blocks: int, num_free: int) -> None:
        self.is_free = [False] * (num_blocks - num_free) + [True] * num_free  # the held ones come first

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Find each free block by scanning the flags."""
        blocks = []
        for _ in range(num_blocks):
            block_id = self.is_free.index(True)
            self.is_free[block_id] = False
            blocks.append(block_id)
        return blocks

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Mark the blocks free again."""
        for block_id in blocks:
            self.is_free[block_id] = True


def _busy_pool(kv_cache, num_blocks: int):
    """A paged pool in which running requests hold all but FREE_WINDOW blocks (built untimed)."""
    pool = kv_cache.BlockPool(num_blocks, enable_caching=False)
    pool.get_new_blocks(num_blocks - min(FREE_WINDOW, num_blocks // 2))
    return pool


def _time_per_block(pool, reps: int) -> float:
    """Microseconds per block for `reps` rounds of allocate BATCH blocks + free them."""
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(reps):
            free_blocks(get_new_blocks(BATCH))
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return elapsed / (reps * BATCH) * 1e6


def _measure(
    make: Callable[[int], object], sizes: Sequence[int], reps: Callable[[int], int], rounds: int, desc: str
) -> dict[int, float]:
    """Best-of-`rounds` time per block at every size, sizes interleaved within each round."""
    pools = {n: make(n) for n in progress(sizes, f"{desc}: building pools")}
    best = {n: float("inf") for n in sizes}
    for _ in progress(range(rounds), f"{desc}: timing"):
        for n in sizes:
            best[n] = min(best[n], _time_per_block(pools[n], reps(n)))
    return best


def run(quick: bool, _sizes: Sequence[int] = SIZES, *, reference: bool = False) -> dict:
    """Measure both allocators at every size (yours, or with reference=True solutions/); notebook 03 plots it."""
    if reference:
        return run_reference("allocator", {"quick": quick, "_sizes": list(_sizes)})
    import kvcourse.kv_cache as kv_cache

    # Many short measurements, keep the best: a busy machine interrupts some, never all of them.
    paged = _measure(lambda n: _busy_pool(kv_cache, n), _sizes, lambda n: PAGED_REPS, _rounds(quick)[0], "paged")
    naive_budget = 2e6 if quick else 1e7  # flag-list entries scanned per timed measurement
    naive = _measure(
        lambda n: NaiveAllocator(n, min(FREE_WINDOW, n // 2)),
        _sizes,
        lambda n: max(1, int(naive_budget // (n * BATCH))),
        _rounds(quick)[1],
        "naive",
    )
    smallest, largest = min(_sizes), max(_sizes)
    return {
        "device": device_name(),
        "allocator": whose_code("kv_cache"),
        "quick": quick,
        "per_block_us": {str(n): round(paged[n], 4) for n in _sizes},
        "naive_per_block_us": {str(n): round(naive[n], 4) for n in _sizes},
        "ratio": round(paged[largest] / paged[smallest], 3),
        "naive_ratio": round(naive[largest] / naive[smallest], 3),
    }


def report(result: dict) -> str:
    """The table a person reads: per-block times side by side, then both ratios."""
    sizes = list(result["per_block_us"])
    paged_rounds, naive_rounds = _rounds(result["quick"])
    lines = [
        f"Allocator study on {result['device']}: allocate + free, microseconds per block",
        f"measured: {result['allocator']}; naive: a list of free flags searched from the start",
        f"workload: all but {FREE_WINDOW} blocks held; allocate {BATCH} blocks, free them; best of "
        f"{paged_rounds} (paged) / {naive_rounds} (naive) rounds{' (--quick: fewer rounds, same sizes)' if result['quick'] else ''}",
        f"{'blocks':>10}  {'paged (us)':>11}  {'naive (us)':>11}",
    ]
    for n in sizes:
        lines.append(f"{int(n):>10,}  {result['per_block_us'][n]:>11.3f}  {result['naive_per_block_us'][n]:>11.3f}")
    verdict = "meets" if result["ratio"] <= GOAL_RATIO else "MISSES"
    lines.append(
        f"ratio largest/smallest pool: paged {result['ratio']:.2f} ({verdict} the goal <= {GOAL_RATIO}), "
        f"naive {result['naive_ratio']:.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, _sizes: Sequence[int] = SIZES) -> int:
    """`python -m kvcourse.bench allocator [--quick] [--json]` (tests pass tiny `_sizes`)."""
    args = parse_args("allocator", __doc__.splitlines()[0], argv)
    try:
        result = run(args.quick, _sizes=_sizes, reference=args.reference)
    except NotImplementedError as error:
        return not_written(error, "allocator")
    print(report(result))
    emit(result, args.json)
    return 0

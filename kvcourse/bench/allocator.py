"""Allocator study: why the free blocks live in a doubly linked list, measured from 1,000 to 1,000,000 blocks.

Three allocators run the same workloads, side by side in one run:

- the paged `BlockPool` (a doubly linked free-block queue through the blocks: O(1) everywhere);
- a plain free-list STACK (a Python list of free block ids: pop to allocate, append to free), also
  O(1) for allocate + free, and simpler;
- a naive allocator (a list of free flags, searched from the start for every block: O(n)).

Workload 1, allocate + free: a busy server, where running requests hold all but 64 blocks and each
repetition allocates 16 blocks and frees them again. Workload 2 is what the linked list is for: a
prefix-cache hit on a FREE block (lesson 04) takes that block out of the middle of the free list
while every other free block keeps its place in LRU order. The linked list unlinks it in O(1); a
stack must search for it (list.remove, O(n)), and it reuses the most recently freed block first
(LIFO): the cached prefix most likely to be asked for again is the first one it overwrites.

    python -m kvcourse.bench allocator [--quick] [--json]      # measures YOUR kvcourse/kv_cache.py
    python -m kvcourse.bench allocator --reference             # measures the reference solutions/

Method: pools are built outside the timed region; the garbage collector is paused while timing
(its full collections walk every block object, which would measure Python, not the allocator);
sizes are interleaved in every round, and the best round is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcourse.bench.common import device_name, emit, not_written, parse_args, progress, run_reference, whose_code

SIZES = (1_000, 10_000, 100_000, 1_000_000)
BATCH = 16  # blocks allocated, then freed, per repetition
FREE_WINDOW = 64  # blocks left free in the busy pool
GOAL_RATIO = 1.3
PAGED_REPS = 250  # repetitions per timed measurement (a few milliseconds)
PROBE_BLOCKS = 2_000  # the queue the pointer-read probe runs on
MAX_POINTER_READS = 16  # per queue operation: an O(1) one reads a handful, a walk reads about PROBE_BLOCKS
WALKING_SIZES = 2  # a queue that walks is timed only at the smallest sizes (a million-block walk takes minutes)


def _rounds(quick: bool) -> tuple[int, int]:
    """Timed rounds for (paged, naive): the naive allocator is slow enough to need few."""
    return (15, 3) if quick else (40, 5)


class StackAllocator:
    """A plain free list used as a stack: O(1) allocate and free, but no O(1) removal from the middle."""

    def __init__(self, num_blocks: int, num_free: int) -> None:
        self.free_ids = list(range(num_blocks - num_free, num_blocks))  # the held ones are 0 .. n - num_free - 1

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop the most recently freed blocks (LIFO)."""
        return [self.free_ids.pop() for _ in range(num_blocks)]

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Push the blocks back."""
        self.free_ids.extend(blocks)

    def touch(self, block_id: int) -> None:
        """A prefix hit on a free block: find it in the list and take it out (a linear search)."""
        self.free_ids.remove(block_id)


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


def pointer_reads(kv_cache, num_blocks: int = PROBE_BLOCKS) -> dict[str, int]:
    """Block pointers (prev/next) each queue operation reads in a queue of `num_blocks`: O(1) means a handful."""
    reads = [0]

    class CountingBlock(kv_cache.KVCacheBlock):
        """A block that counts reads of its queue pointers."""

        def __getattribute__(self, name: str):
            if name in ("prev_free_block", "next_free_block"):
                reads[0] += 1
            return object.__getattribute__(self, name)

    blocks = [CountingBlock(block_id=i) for i in range(num_blocks)]
    queue = kv_cache.FreeKVCacheBlockQueue(blocks)
    taken = [queue.popleft() for _ in range(2)]
    counts = {}
    for name, operation in (
        ("popleft", queue.popleft),
        ("append", lambda: queue.append(taken[0])),
        ("remove", lambda: queue.remove(blocks[num_blocks // 2])),
    ):
        reads[0] = 0
        operation()
        counts[name] = reads[0]
    return counts


def _busy_pool(kv_cache, num_blocks: int):
    """A paged pool in which running requests hold all but FREE_WINDOW blocks (built untimed)."""
    pool = kv_cache.BlockPool(num_blocks, enable_caching=False)
    pool.get_new_blocks(num_blocks - min(FREE_WINDOW, num_blocks // 2))
    return pool


def _microseconds_per_op(one_round: Callable[[], object], reps: int, ops_per_round: int) -> float:
    """Time `reps` rounds with torch.utils.benchmark (garbage collection off, as timeit does); µs per operation."""
    from torch.utils.benchmark import Timer

    measurement = Timer(stmt="one_round()", globals={"one_round": one_round}).timeit(reps)
    return measurement.mean / ops_per_round * 1e6


def _time_per_block(pool, reps: int) -> float:
    """Microseconds per block for `reps` rounds of allocate BATCH blocks + free them."""
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
    return _microseconds_per_op(lambda: free_blocks(get_new_blocks(BATCH)), reps, BATCH)


def _free_pool(kv_cache, num_blocks: int):
    """A paged pool whose blocks are all free (an idle server whose free blocks still cache prefixes)."""
    return kv_cache.BlockPool(num_blocks, enable_caching=False)


def _middle_ids(num_blocks: int) -> list[int]:
    """Block ids around the middle of the free list: the prefix hits of workload 2."""
    middle = num_blocks // 2
    return list(range(middle, middle + min(BATCH, num_blocks - middle)))


def _time_hit_linked(pool, reps: int) -> float:
    """Microseconds per hit: unlink a free block from the middle (touch), then free it again."""
    blocks = [pool.blocks[i] for i in _middle_ids(pool.num_blocks)]
    touch, free_blocks = pool.touch, pool.free_blocks

    def one_round() -> None:
        for block in blocks:
            touch([block])
            free_blocks([block])

    return _microseconds_per_op(one_round, reps, len(blocks))


def _time_hit_stack(stack: StackAllocator, reps: int) -> float:
    """Microseconds per hit for the stack: search the block out of the list, then push it back."""
    ids = _middle_ids(len(stack.free_ids))

    def one_round() -> None:
        for block_id in ids:
            stack.touch(block_id)
            stack.free_blocks([block_id])

    return _microseconds_per_op(one_round, reps, len(ids))


def _measure(
    make: Callable[[int], object], sizes: Sequence[int], reps: Callable[[int], int], rounds: int, desc: str
) -> dict[int, float]:
    """Best-of-`rounds` time per block at every size, sizes interleaved within each round."""
    return _measure_with(make, _time_per_block, sizes, reps, rounds, desc)


def _measure_with(
    make: Callable[[int], object],
    time_one: Callable[[object, int], float],
    sizes: Sequence[int],
    reps: Callable[[int], int],
    rounds: int,
    desc: str,
) -> dict[int, float]:
    """Best-of-`rounds` of `time_one` at every size, sizes interleaved within each round."""
    pools = {n: make(n) for n in progress(sizes, f"{desc}: building pools")}
    best = {n: float("inf") for n in sizes}
    for _ in progress(range(rounds), f"{desc}: timing"):
        for n in sizes:
            best[n] = min(best[n], time_one(pools[n], reps(n)))
    return best


def run(quick: bool, _sizes: Sequence[int] = SIZES, *, reference: bool = False) -> dict:
    """Measure both allocators at every size (yours, or with reference=True solutions/); notebook 03 plots it."""
    if reference:
        return run_reference("allocator", {"quick": quick, "_sizes": list(_sizes)})
    import kvcourse.kv_cache as kv_cache

    reads = pointer_reads(kv_cache)
    walks = {op: n for op, n in reads.items() if n > MAX_POINTER_READS}
    if walks:  # O(n): a million-block pool would take minutes per round; the small sizes already show it
        _sizes = list(_sizes)[:WALKING_SIZES]
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
    stack = _measure(
        lambda n: StackAllocator(n, min(FREE_WINDOW, n // 2)), _sizes, lambda n: PAGED_REPS, _rounds(quick)[0], "stack"
    )
    hit_linked = _measure_with(
        lambda n: _free_pool(kv_cache, n), _time_hit_linked, _sizes, lambda n: 20, _rounds(quick)[0], "linked hits"
    )
    stack_budget = 2e6 if quick else 1e7  # list entries searched per timed measurement
    hit_stack = _measure_with(
        lambda n: StackAllocator(n, n),
        _time_hit_stack,
        _sizes,
        lambda n: max(1, int(stack_budget // (n * BATCH))),
        _rounds(quick)[1],
        "stack hits",
    )
    smallest, largest = min(_sizes), max(_sizes)
    return {
        "device": device_name(),
        "allocator": whose_code("kv_cache"),
        "quick": quick,
        "per_block_us": {str(n): round(paged[n], 4) for n in _sizes},
        "stack_per_block_us": {str(n): round(stack[n], 4) for n in _sizes},
        "naive_per_block_us": {str(n): round(naive[n], 4) for n in _sizes},
        "hit_linked_us": {str(n): round(hit_linked[n], 4) for n in _sizes},
        "hit_stack_us": {str(n): round(hit_stack[n], 4) for n in _sizes},
        "ratio": round(paged[largest] / paged[smallest], 3),
        "stack_ratio": round(stack[largest] / stack[smallest], 3),
        "naive_ratio": round(naive[largest] / naive[smallest], 3),
        "hit_linked_ratio": round(hit_linked[largest] / hit_linked[smallest], 3),
        "hit_stack_ratio": round(hit_stack[largest] / hit_stack[smallest], 3),
        "pointer_reads": reads,
        "meets_goal": not walks
        and max(paged[largest] / paged[smallest], hit_linked[largest] / hit_linked[smallest]) <= GOAL_RATIO,
    }


def report(result: dict) -> str:
    """The table a person reads: per-block times side by side, then both ratios."""
    sizes = list(result["per_block_us"])
    paged_rounds, naive_rounds = _rounds(result["quick"])
    lines = [
        f"Allocator study on {result['device']}: microseconds per block (best of {paged_rounds} rounds for "
        f"the O(1) ones, {naive_rounds} for the O(n) ones){' --quick' if result['quick'] else ''}",
        f"measured: {result['allocator']}; stack: a Python list of free ids; naive: free flags scanned from the start",
        f"1) allocate + free: all but {FREE_WINDOW} blocks held; allocate {BATCH} blocks, free them",
        "2) prefix hit on a free block: take one from the middle of an all-free list, then free it",
        f"{'blocks':>10}  {'1) paged':>9}  {'1) stack':>9}  {'1) naive':>9}  {'2) linked':>10}  {'2) stack':>9}",
    ]
    for n in sizes:
        lines.append(
            f"{int(n):>10,}  {result['per_block_us'][n]:>9.3f}  {result['stack_per_block_us'][n]:>9.3f}  "
            f"{result['naive_per_block_us'][n]:>9.3f}  {result['hit_linked_us'][n]:>10.3f}  "
            f"{result['hit_stack_us'][n]:>9.3f}"
        )
    lines.append(
        f"ratio largest/smallest pool: 1) paged {result['ratio']:.2f}, stack {result['stack_ratio']:.2f}, "
        f"naive {result['naive_ratio']:.1f}; 2) linked {result['hit_linked_ratio']:.2f}, "
        f"stack {result['hit_stack_ratio']:.1f}"
    )
    reads = result.get("pointer_reads", {})
    walking = {op: n for op, n in reads.items() if n > MAX_POINTER_READS}
    reads_text = ", ".join(f"{op} {n}" for op, n in reads.items())
    if walking:
        lines.append(
            f"your queue does not meet the goal: pointers read per operation in a {PROBE_BLOCKS:,}-block queue: "
            f"{reads_text}; {' and '.join(walking)} {'walks' if len(walking) == 1 else 'walk'} the list (O(n)), "
            "so only the smallest pools were timed"
        )
    elif result.get("meets_goal", True):
        lines.append(
            f"your pool meets the goal: ratios 1) paged and 2) linked <= {GOAL_RATIO}, and each queue operation reads a "
            f"handful of pointers ({reads_text}) whatever the queue's length"
        )
    else:
        lines.append(
            f"your pool does not meet the goal: ratio 1) paged or 2) linked is above {GOAL_RATIO} (pointer reads: {reads_text}; "
            "a busy machine can also stretch one timing: run the cell again)"
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

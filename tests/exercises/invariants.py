"""The KV manager's invariants, checked after every call a graded test makes (notebooks 03 and 04).

`checked(manager)` (or `checked(pool)`) returns a stand-in that forwards every attribute to the real
object and, after each method call, checks what must hold whatever the call was:

- the free queue is one consistent doubly linked list (forwards and backwards agree, no cycle), it
  holds exactly the blocks nobody holds (ref_cnt == 0), each once, and num_free_blocks counts them;
- a block outside the queue has no queue pointers; no ref count is negative;
- the prefix cache's hash map and the blocks' own hashes agree (each published block once);
- for a manager: no block twice in one table, each block's ref_cnt equals the number of tables
  holding it, and the free count adds up (free + held == num_blocks).

So an ordering bug is caught by the call that makes it, with a message naming the broken rule. A raw
error raised inside the learner's code by the pool's own guards (a double free, a block queued twice,
more blocks taken than are free) is reported as the rule it breaks, not as a bare ValueError.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any


class InvariantBroken(AssertionError):
    """One of the KV manager's invariants does not hold (the message names it)."""


# (words the pool's own guard uses, the rule it means): matched against errors raised in learner code
RULES = (
    ("freed twice", "a block was given back more times than it is held (a double free)"),
    (
        "already in the free-block queue",
        "a block was put in the free queue while it was already there: only the holder that leaves last queues it",
    ),
    (
        "is not in the free-block queue",
        "a block was taken out of the free queue while it was not in it (a held block treated as free?)",
    ),
    ("queue is empty", "a block was taken from an empty free queue: check there is room BEFORE taking any block"),
    ("are free", "more blocks were taken from the pool than are free: check there is room BEFORE taking any block"),
)


def _fail(where: str, rule: str) -> None:
    raise InvariantBroken(f"after {where}: {rule}")


def _walk(queue, limit: int) -> tuple[list, str | None]:
    """The free queue front to back by the next pointers, checking each step's back pointer."""
    blocks, prev, block = [], queue.fake_head, queue.fake_head.next_free_block
    while block is not queue.fake_tail:
        if block is None:
            return blocks, "the free queue's next pointers end in None before reaching its tail sentinel"
        if block.prev_free_block is not prev:
            return blocks, (
                f"block {block.block_id}'s prev pointer does not point at the block before it in the free "
                "queue (walking forwards and backwards disagree)"
            )
        blocks.append(block)
        if len(blocks) > limit:
            return blocks, "the free queue's next pointers loop (a block is linked into the queue twice)"
        prev, block = block, block.next_free_block
    if queue.fake_tail.prev_free_block is not prev:
        return blocks, "the tail sentinel's prev pointer is not the last block of the free queue"
    return blocks, None


def pool_problem(pool) -> str | None:
    """The first broken invariant of a BlockPool, in words, or None."""
    queue = pool.free_block_queue
    queued, problem = _walk(queue, len(pool.blocks))
    if problem:
        return problem
    if queue.num_free_blocks != len(queued):
        return "num_free_blocks does not count the blocks actually in the free queue"
    ids = [block.block_id for block in queued]
    if len(set(ids)) != len(ids):
        return "a block appears twice in the free queue"
    in_queue = {id(block) for block in queued}
    for block in pool.blocks:
        if block.ref_cnt < 0:
            return f"block {block.block_id} has a negative ref_cnt (freed more often than it was held)"
        if block.ref_cnt > 0 and id(block) in in_queue:
            return f"block {block.block_id} is held (ref_cnt {block.ref_cnt}) but still in the free queue"
        if block.ref_cnt == 0 and id(block) not in in_queue:
            return f"block {block.block_id} is held by nobody (ref_cnt 0) but is missing from the free queue"
        if id(block) not in in_queue and (block.prev_free_block is not None or block.next_free_block is not None):
            return f"block {block.block_id} is out of the free queue but still has queue pointers"
    return _hash_problem(pool)


def _hash_problem(pool) -> str | None:
    """The hash map and the blocks' hashes must agree."""
    table = pool.cached_block_hash_to_block
    all_blocks = {id(block) for block in pool.blocks}
    for block_hash, block in table.items():
        if id(block) not in all_blocks:
            return "the prefix cache maps a hash to a block that is not one of the pool's blocks"
        if block.block_hash != block_hash:
            return (
                f"the prefix cache maps a hash to block {block.block_id}, which carries another hash "
                "(a stale entry: a reused block must leave the hash map)"
            )
    for block in pool.blocks:
        if block.block_hash is not None and table.get(block.block_hash) is not block:
            return f"block {block.block_id} carries a hash the prefix cache does not map to it (a stale hash)"
        if (block.block_hash is None) != (block.token_ids is None):
            return f"block {block.block_id} has a hash without tokens, or tokens without a hash"
    return None


def manager_problem(manager) -> str | None:
    """The first broken invariant of a KVCacheManager (its pool's first), in words, or None."""
    pool = manager.block_pool
    problem = pool_problem(pool)
    if problem:
        return problem
    holders: Counter = Counter()
    for request_id, table in manager.req_to_blocks.items():
        seen = Counter(id(block) for block in table)
        twice = next((block for block in table if seen[id(block)] > 1), None)
        if twice is not None:
            return (
                f"request {request_id}'s block table holds block {twice.block_id} twice "
                "(a block handed out while it was already in the table?)"
            )
        holders.update(seen)
    for block in pool.blocks:
        if block.ref_cnt != holders[id(block)]:
            return (
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {holders[id(block)]} block table(s) "
                "hold it: every holder adds one, every release takes one away"
            )
    held = sum(block.ref_cnt > 0 for block in pool.blocks)
    if manager.get_num_free_blocks() + held != manager.num_blocks:
        return "the free blocks and the held blocks do not add up to num_blocks"
    return None


def assert_valid(target, where: str = "this call") -> None:
    """Raise InvariantBroken naming the first broken invariant of a manager or a pool."""
    problem = manager_problem(target) if hasattr(target, "req_to_blocks") else pool_problem(target)
    if problem:
        _fail(where, problem)


def rule_for(error: BaseException, method: str = "") -> str | None:
    """The rule a raw error from the pool's guards (or a missing key) means, or None for any other error."""
    text = str(error)
    if isinstance(error, ValueError):
        return next((rule for words, rule in RULES if words in text), None)
    if isinstance(error, KeyError) and method == "free":
        return "free of an unknown or already freed request must change nothing (it has no table any more)"
    if isinstance(error, KeyError):
        return (
            f"a dictionary had no entry {text}: a request's table or hash chain that is not there, or a "
            "prefix-cache hash already deleted (the hash map and the blocks' hashes disagree)"
        )
    if isinstance(error, AttributeError) and "NoneType" in text and "free_block" in text:
        return "a free-queue pointer was None where a neighbour must be: the linked list is broken"
    return None


class Checked:
    """Forwards everything to `target`; after every method call, checks the invariants (see the module)."""

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name == "block_pool":
            return Checked(value)
        if not callable(value) or getattr(value, "__self__", None) is not self._target:
            return value

        @functools.wraps(value)
        def call(*args, **kwargs):
            where = f"{type(self._target).__name__}.{name}"
            try:
                result = value(*args, **kwargs)
            except (ValueError, KeyError, AttributeError) as error:
                rule = rule_for(error, name)
                if rule is None:
                    raise
                raise InvariantBroken(f"during {where}: {rule} (the pool said: {error})") from error
            assert_valid(self._target, where)
            return result

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._target, name)

    def __repr__(self) -> str:
        return f"checked({self._target!r})"


def checked(target: Any) -> Any:
    """`target` (a KVCacheManager or a BlockPool) with its invariants checked after every call."""
    assert_valid(target, "construction")
    return Checked(target)

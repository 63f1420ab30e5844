"""Eviction policies for the prefix cache: which free block gives up its cached prefix when the pool needs one.

Your `BlockPool` (lessons 03 and 04) evicts the block that has been free the longest (LRU): the free
queue is the eviction order. Here the free blocks stay in that same queue (so counts, `touch` and
every check of lesson 03 still hold), and a heap ranks them by a policy's `eviction_key`:
`get_new_blocks` hands out the lowest-ranked free block instead of the queue's front.

- `LRUBlockPool`: the same order as your `BlockPool` (given: it checks the machinery);
- `FIFOBlockPool`: first cached, first evicted, however often a block is hit;
- `LFUBlockPool`: keeps the most shared prefixes, the least frequently used goes first.

Plug one into a manager with `with_policy(KVCacheManager(...), FIFOBlockPool)`; notebook 04 scores
them on Mooncake's chat trace (`kvcourse.bench.trace`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvcourse.core.kv_cache_utils import BlockHash, KVCacheBlock
from kvcourse.kv_cache import BlockPool, KVCacheManager


class RankedBlockPool(BlockPool):
    """A block pool whose free blocks are evicted in the order of `eviction_key`, lowest first."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self.clock = 0  # ticks once per event (a block freed, a block published): the policies' sense of time
        self.freed_at = [0] * num_blocks  # tick at which each block last joined the free queue
        self.cached_at = [0] * num_blocks  # tick at which it was published; 0 while it holds no cached prefix
        self.num_shares = [0] * num_blocks  # holders it gained through touch (prefix hits) since it was handed out
        # (eviction key, freed_at tick, block id) for every free block; an entry goes STALE when its block
        # is revived by a hit or freed again later, and is only thrown away when it reaches the top.
        self.free_heap: list[tuple[tuple, int, int]] = []
        for block in self.blocks:  # all free at first, in id order (as the free queue)
            self._push(block)

    def _tick(self) -> int:
        """The next moment of the pool's clock."""
        self.clock += 1
        return self.clock

    def _push(self, block: KVCacheBlock) -> None:
        """Rank a block that just became free (its key is final while it stays free)."""
        self.freed_at[block.block_id] = self._tick()
        heapq.heappush(self.free_heap, (self.eviction_key(block), self.freed_at[block.block_id], block.block_id))

    def eviction_key(self, block: KVCacheBlock) -> tuple:
        """The policy: free blocks with smaller keys are evicted first (subclasses say how)."""
        raise NotImplementedError(f"{type(self).__name__} is a RankedBlockPool without an eviction_key.")

    def _pop_victim(self) -> KVCacheBlock:
        """The free block this policy evicts next (called only while a block is free)."""
        # Exercise 4.7 (contract): return the block that free_heap ranks first among the blocks that are
        #   FREE now (ref_cnt 0): the smallest entry (eviction key, then freed_at tick) that is not stale.
        #   The block stays in the free queue (get_new_blocks takes it out). An entry is stale when its
        #   block is held again (a hit revived it) or was freed again since (its tick is no longer
        #   self.freed_at[block id]: the newer entry counts). Throw stale entries away as you meet them, so
        #   that each entry is looked at once: a replay hands out hundreds of thousands of blocks.
        # BEGIN SOLUTION 4.7
        while True:
            _, tick, block_id = heapq.heappop(self.free_heap)
            block = self.blocks[block_id]
            if block.ref_cnt == 0 and self.freed_at[block_id] == tick:
                return block
        # END SOLUTION

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out the free blocks the policy ranks first, each with one holder and no old prefix."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks is {num_blocks}; ask for 0 or more blocks.")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"asked for {num_blocks} blocks but only {self.get_num_free_blocks()} are free.")
        taken = []
        for _ in range(num_blocks):
            block = self._pop_victim()
            self._maybe_evict_cached_block(block)  # your 4.4: its old prefix is forgotten
            super().touch([block])  # your 3.2: out of the free queue, one holder (not a share)
            self.cached_at[block.block_id] = self.num_shares[block.block_id] = 0
            taken.append(block)
        return taken

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Your 3.2's free, then rank each block that became free, in the order given."""
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        ranked: set[int] = set()
        for block in blocks:
            if block.ref_cnt == 0 and block.block_id not in ranked:
                ranked.add(block.block_id)
                self._push(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Your 3.2's touch, counting each new holder as a share."""
        blocks = list(blocks)
        super().touch(blocks)
        for block in blocks:
            self.num_shares[block.block_id] += 1

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash], token_ids: Sequence[Sequence[int]]
    ) -> None:
        """Your 4.2's publishing, noting when each block was first published."""
        super().cache_full_blocks(blocks, block_hashes, token_ids)
        for block in blocks:
            if block.block_hash is not None and not self.cached_at[block.block_id]:
                self.cached_at[block.block_id] = self._tick()

    def reset_prefix_cache(self) -> bool:
        """Your 7.5's reset; every block then holds no prefix, so the ranks are computed again."""
        if not super().reset_prefix_cache():
            return False
        self.cached_at = [0] * self.num_blocks
        self.num_shares = [0] * self.num_blocks
        self.free_heap = [(self.eviction_key(b), self.freed_at[b.block_id], b.block_id) for b in self.blocks]
        heapq.heapify(self.free_heap)
        return True


class LRUBlockPool(RankedBlockPool):
    """Least recently used first: exactly your BlockPool's order, through the heap (a check of the machinery)."""

    def eviction_key(self, block: KVCacheBlock) -> tuple:
        """The block free the longest goes first."""
        return (self.freed_at[block.block_id],)


class FIFOBlockPool(RankedBlockPool):
    """First cached, first evicted: a hit does not buy a block more time."""

    def eviction_key(self, block: KVCacheBlock) -> tuple:
        """Publication order, whatever happened to the block since."""
        # Exercise 4.7 (contract): a key under which, among free blocks, the one PUBLISHED earliest
        #   (cached_at) is evicted first, however recently it was hit or freed; a block holding no cached
        #   prefix (cached_at 0) goes before every cached one; ties go to the block free the longest.
        # BEGIN SOLUTION 4.7
        return (self.cached_at[block.block_id], self.freed_at[block.block_id])
        # END SOLUTION


class LFUBlockPool(RankedBlockPool):
    """Least frequently used first: keeps the prefixes many requests share (a system prompt outlives a chat)."""

    def eviction_key(self, block: KVCacheBlock) -> tuple:
        """Fewest shares first, then least recently used."""
        # Exercise 4.7 (contract): a key under which a block holding no cached prefix (block_hash None)
        #   is evicted before every cached one; among cached blocks, the one shared the FEWEST times
        #   (num_shares) goes first; among equally shared blocks, the one free the longest (LRU).
        # BEGIN SOLUTION 4.7
        return (block.block_hash is not None, self.num_shares[block.block_id], self.freed_at[block.block_id])
        # END SOLUTION


POLICIES: dict[str, type[BlockPool]] = {"LRU": BlockPool, "FIFO": FIFOBlockPool, "LFU": LFUBlockPool}


def with_policy(manager: KVCacheManager, pool_class: type[BlockPool]) -> KVCacheManager:
    """Give a fresh manager a pool of another policy (same size, caching as the manager's); returns it."""
    if manager.req_to_blocks or manager.get_num_free_blocks() < manager.num_blocks:
        raise ValueError("with_policy swaps the pool of a FRESH manager; this one already holds blocks.")
    manager.block_pool = pool_class(manager.num_blocks, manager.enable_prefix_caching)
    return manager


__all__ = [
    "POLICIES",
    "FIFOBlockPool",
    "LFUBlockPool",
    "LRUBlockPool",
    "RankedBlockPool",
    "with_policy",
]

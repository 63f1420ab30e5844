"""The paged KV cache's given half: counters, read-outs and resets around the learner's free queue, pool and manager.

The learner's classes in kvcourse/kv_cache.py inherit these and hold the state (set in their __init__)
and the exercises. vLLM keeps the like in vllm/v1/core/block_pool.py and kv_cache_manager.py.
"""

from __future__ import annotations

import warnings

from kvcourse.core import kv_cache_utils as utils
from kvcourse.core.contract import KVCacheBlocks
from kvcourse.core.kv_cache_utils import KVCacheBlock, PrefixCacheStats
from kvcourse.core.request import Request


class FreeBlockQueueBase:
    """Given read-outs of the free-block queue (fake_head, fake_tail, num_free_blocks are the learner's)."""

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front (evicted first) to back: for debugging, tests and the widget."""
        blocks, block = [], self.fake_head.next_free_block
        while block is not self.fake_tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def __len__(self) -> int:
        """len(queue) reads like a list's, in O(1) (a counter, not a walk)."""
        return self.num_free_blocks


class BlockPoolBase:
    """Given counters of the block pool (blocks, free_block_queue, cached_block_hash_to_block are the learner's)."""

    def get_num_free_blocks(self) -> int:
        """Blocks no request holds (cached-free ones included: they can be reused at any time)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of all blocks held by at least one request."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def evict_free_cached_blocks(self) -> None:
        """Unpublish every cached block nobody holds (after a failed step: their K/V may never have been written)."""
        for block in self.blocks:
            if block.ref_cnt == 0:
                self.unpublish_quietly(block)

    def unpublish_quietly(self, block: KVCacheBlock) -> None:
        """Unpublish a block whose K/V was never written, without offering it to a second tier (lesson 10)."""
        hook, self.on_evict = getattr(self, "on_evict", None), None
        try:
            self._maybe_evict_cached_block(block)
        finally:
            self.on_evict = hook

    def get_num_cached_blocks(self) -> int:
        """Blocks currently published in the prefix cache (held or free)."""
        return len(self.cached_block_hash_to_block)


class KVCacheManagerBase:
    """Given read-outs and resets of the manager (block_pool, req_to_blocks, ... are the learner's)."""

    def get_num_free_blocks(self) -> int:
        """Blocks that could be handed out right now."""
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of all blocks held by at least one request."""
        return self.block_pool.usage

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's block table, logical order ([] for an unknown or freed request)."""
        return [block.block_id for block in self.req_to_blocks.get(request.id, [])]

    def get_blocks(self, request: Request) -> KVCacheBlocks:
        """The request's blocks themselves (ref counts, hashes), for the widget and the tests."""
        return KVCacheBlocks(self.req_to_blocks.get(request.id, []))

    def _check_allocation(self, request: Request, *args: object) -> list[KVCacheBlock]:
        """Reject impossible arguments before anything changes (kv_cache_utils); return the prefix hits as a list."""
        return utils.check_allocation(request, self.req_to_blocks.get(request.id, []), self.block_size, *args)

    def _record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admission's tokens and hits, for the hit-rate plot (only while caching is on)."""
        if self.enable_prefix_caching:
            self.prefix_cache_stats.record_admission(request, num_hit_tokens)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached-free block's prefix (vLLM's name); refused with a warning while any block is held."""
        held = self.num_blocks - self.get_num_free_blocks()
        if not self.block_pool.reset_prefix_cache():
            self.reset_refusal = utils.reset_refusal(held, self.num_blocks)
            warnings.warn(self.reset_refusal, stacklevel=2)
            return False
        self.reset_refusal = None
        self.prefix_cache_stats = PrefixCacheStats()  # hit rates start again from a cold cache
        return True

    def reset_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the counts so far and start new ones (one plot point per workload)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def forget_unwritten_tail(self, request: Request, num_valid_tokens: int) -> None:
        """A second tier's load fell short: unpublish the request's blocks past num_valid_tokens (recomputed later)."""
        first = num_valid_tokens // self.block_size
        for block in self.req_to_blocks.get(request.id, [])[first:]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.unpublish_quietly(block)
        if self.num_cached_block.get(request.id, 0) > first:
            self.num_cached_block[request.id] = first  # published again once recomputed

    def forget_unwritten_blocks(self) -> None:
        """After a failed step: unpublish the blocks nobody holds and drop its planned copies (they never ran)."""
        self.block_pool.evict_free_cached_blocks()
        self.pending_copies = []

    def __repr__(self) -> str:
        """The numbers to glance at in a notebook: size, free blocks, requests, caching."""
        return (
            f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.get_num_free_blocks()}, requests={len(self.req_to_blocks)}, "
            f"prefix_caching={self.enable_prefix_caching})"
        )

# kvcourse/kv_cache.py holds exercises 3.1-3.4, 4.1-4.6, 7.5: write only inside their TODO regions (the rest is given).
"""A paged KV-cache manager like vLLM v1's: free-block queue, block pool, manager (exercises 3.1-4.6, 7.5).

The manager is what the scheduler talks to (kvcourse/core/contract.py); the given pieces are in kvcourse/core/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvcourse.core import kv_cache_utils as utils
from kvcourse.core.contract import KVCacheBlocks, blocks_needed, check_cache_shape, check_token_count  # noqa: F401
from kvcourse.core.contract import MockKVCacheManager as MockKVCacheManager  # re-exported: the manager's double  # noqa: F401
from kvcourse.core.kv_cache_base import BlockPoolBase, FreeBlockQueueBase, KVCacheManagerBase
from kvcourse.core.kv_cache_utils import HASH_FUNCTION, BlockHash, KVCacheBlock, PrefixCacheStats  # noqa: F401
from kvcourse.core.request import Request

# --------------------------------------------------------------------------------------------
# Blocks and the free-block queue (exercise 3.1)
# --------------------------------------------------------------------------------------------


class FreeKVCacheBlockQueue(FreeBlockQueueBase):
    """The free blocks in eviction order, as a doubly linked list between two sentinel blocks."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.fake_head = KVCacheBlock(block_id=-1)  # sentinels: no special case for an empty list
        self.fake_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_head, *blocks, self.fake_tail]
        for left, right in zip(chain, chain[1:]):  # link neighbours: head <-> b0 <-> b1 ... <-> tail
            left.next_free_block = right
            right.prev_free_block = left
        self.num_free_blocks = len(blocks)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the front: the one that has been free the longest (LRU)."""
        if self.num_free_blocks == 0:
            raise ValueError("the free-block queue is empty: no block can be handed out.")
        # Exercise 3.1 (contract): return the block at the front (the one right after fake_head) and
        # leave the queue without it: order of the others kept, count one lower, the block's own
        # pointers None. `remove` (below, also yours) unlinks any block in O(1).
        # TODO: Exercise 3.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.1 (A doubly linked free-block queue): not written yet: edit kvcourse/kv_cache.py, FreeKVCacheBlockQueue.popleft."
        )

    def append(self, block: KVCacheBlock) -> None:
        """Put a freed block at the back, so it is reused after every block freed before it."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free-block queue.")
        # Exercise 3.1 (contract): afterwards the block is the LAST real block (just before fake_tail),
        # walking the queue forwards or backwards agrees, and num_free_blocks counts it. O(1): no walk.
        # TODO: Exercise 3.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.1 (A doubly linked free-block queue): not written yet: edit kvcourse/kv_cache.py, FreeKVCacheBlockQueue.append."
        )

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1) (a prefix-cache hit revives it)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free-block queue.")
        # Exercise 3.1 (contract): afterwards the queue holds every other block in the same order (both
        # directions), num_free_blocks is one lower, and the block's prev/next are None ("not queued").
        # TODO: Exercise 3.1: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.1 (A doubly linked free-block queue): not written yet: edit kvcourse/kv_cache.py, FreeKVCacheBlockQueue.remove."
        )


# --------------------------------------------------------------------------------------------
# The block pool (exercises 3.2, 4.3, 4.4)
# --------------------------------------------------------------------------------------------


class BlockPool(BlockPoolBase):
    """Owns every block: hands them out, takes them back, and remembers which ones hold cached prefixes.

    Given in BlockPoolBase (kvcourse/core/kv_cache_base.py): get_num_free_blocks, usage,
    evict_free_cached_blocks, get_num_cached_blocks.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        check_cache_shape(num_blocks, block_size=1)
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.on_evict: Callable[[KVCacheBlock], None] | None = None  # a second tier takes evicted blocks (8.1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out free blocks from the front of the queue, each with one holder."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks is {num_blocks}; ask for 0 or more blocks.")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"asked for {num_blocks} blocks but only {self.get_num_free_blocks()} are free.")
        # Exercise 3.2 (contract): return the num_blocks blocks at the FRONT of the free queue, in queue
        # order, each out of the queue with exactly one holder (ref_cnt 1). A block handed out may
        # still carry an old prefix-cache entry: every one must go through
        # self._maybe_evict_cached_block(block) before it is returned (notebook 04 fills that in).
        # TODO: Exercise 3.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.2 (The block pool: hand out, take back, share): not written yet: edit kvcourse/kv_cache.py, BlockPool.get_new_blocks."
        )

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one holder from each block; a block nobody holds goes to the back of the free queue."""
        blocks = list(ordered_blocks)
        utils.check_held(blocks)
        # Exercise 3.2 (contract): each block loses one holder; a block left with none joins the BACK
        # of the free queue, in the order given (so the first one given is reused first). A block
        # someone still holds stays out of the queue.
        # TODO: Exercise 3.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.2 (The block pool: hand out, take back, share): not written yet: edit kvcourse/kv_cache.py, BlockPool.free_blocks."
        )

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one holder to blocks a request shares (a prefix-cache hit or a fork)."""
        # Exercise 3.2 (contract): each block gains one holder. A block nobody held was in the free
        # queue (free, but still useful: lesson 04 shares it); afterwards it must not be, so it can
        # never be handed out to someone else while held.
        # TODO: Exercise 3.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.2 (The block pool: hand out, take back, share): not written yet: edit kvcourse/kv_cache.py, BlockPool.touch."
        )

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash], token_ids: Sequence[Sequence[int]]
    ) -> None:
        """Publish full blocks under their hash, so later requests with the same prefix can share them."""
        if not self.enable_caching:
            return
        # Exercise 4.2 (contract): afterwards each block (with its hash and tokens, given in the same
        # order) is published: cached_block_hash_to_block maps the hash to it, and the block carries
        # its block_hash and its token_ids as a tuple. Two exceptions leave things as they are: a block
        # already published (it keeps its first hash), and a hash another block already serves.
        # TODO: Exercise 4.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.2 (Hash once, publish once): not written yet: edit kvcourse/kv_cache.py, BlockPool.cache_full_blocks."
        )

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The published block for this hash, only if it really holds these tokens (a collision never hits)."""
        # Exercise 4.3 (contract): the block published under block_hash (cached_block_hash_to_block),
        # but only if it really caches these tokens (its token_ids); None for an unknown hash or for
        # a collision (same hash, other tokens).
        # TODO: Exercise 4.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.3 (Prefix-cache lookup): not written yet: edit kvcourse/kv_cache.py, BlockPool.get_cached_block."
        )

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        """Unpublish a cached-free block that is being reused, so no lookup finds its old contents."""
        if block.block_hash is None:
            return  # never published (always the case while prefix caching is off)
        if self.on_evict is not None:
            self.on_evict(block)  # a second tier (lesson 10) may keep its K/V before it is overwritten
        # Exercise 4.4 (contract): the block is about to hold new tokens. Afterwards no lookup may find
        # it under its old hash, the block carries no hash or tokens, and the prefix can be published
        # again later (by the block that recomputes it).
        # TODO: Exercise 4.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.4 (Free and LRU eviction): not written yet: edit kvcourse/kv_cache.py, BlockPool._maybe_evict_cached_block."
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (new weights, a cold-start benchmark), but only while no block is held."""
        # Exercise 7.5: reset the prefix cache (vLLM's BlockPool.reset_prefix_cache).
        #   While any block is held by a request (its K/V is in use), returns False and changes
        #   nothing. Otherwise every published block is unpublished: no lookup finds any hash any more,
        #   and no block carries a hash or tokens; the free queue keeps the same blocks in the same
        #   order (nothing is allocated or freed); returns True.
        # TODO: Exercise 7.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 7.5 (Reset the prefix cache): not written yet: edit kvcourse/kv_cache.py, BlockPool.reset_prefix_cache."
        )


# --------------------------------------------------------------------------------------------
# The hash chain (exercise 4.1)
# --------------------------------------------------------------------------------------------


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash one full block together with its parent's hash, so it names the whole prefix up to it."""
    # Exercise 4.1 (contract): a bytes digest that is equal for equal (parent, tokens) pairs, in EVERY
    # process (Python's hash() of str/bytes changes per process), and differs when the parent, a
    # token, or the tokens' order differs. HASH_FUNCTION (above) gives such digests of bytes.
    # TODO: Exercise 4.1: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 4.1 (The block hash chain): not written yet: edit kvcourse/kv_cache.py, hash_block_tokens."
    )


def hash_request_tokens(block_size: int, token_ids: Sequence[int]) -> list[BlockHash]:
    """The hash chain of every FULL block of `token_ids` (a partial last block gets no hash)."""
    # Exercise 4.1 (contract): one hash per FULL block, in order; block i's parent is block i-1's hash
    # (None for block 0); a partial last block gets none.
    # TODO: Exercise 4.1: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 4.1 (The block hash chain): not written yet: edit kvcourse/kv_cache.py, hash_request_tokens."
    )


# --------------------------------------------------------------------------------------------
# The manager the scheduler talks to (exercises 3.3, 3.4, 4.2, 4.3, 4.5, 4.6)
# --------------------------------------------------------------------------------------------


class KVCacheManager(KVCacheManagerBase):
    """Block tables for the scheduler: exact, all-or-nothing allocation over a shared block pool.

    Given in KVCacheManagerBase (kvcourse/core/kv_cache_base.py): get_num_free_blocks, usage,
    get_block_ids, get_blocks, _check_allocation, _record_admission, reset_prefix_cache,
    reset_prefix_cache_stats, forget_unwritten_blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        check_cache_shape(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[int, list[KVCacheBlock]] = {}  # request id -> its block table
        # request id -> (the request, the hash chain of its full blocks so far): computed once, extended
        # as the request grows, kept across a preemption (vLLM keeps it on the request itself)
        self.req_to_block_hashes: dict[int, tuple[Request, list[BlockHash]]] = {}
        self.num_cached_block: dict[int, int] = {}  # how many of its blocks were offered to the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the executor
        self.prefix_cache_stats = PrefixCacheStats()
        self.reset_refusal: str | None = None  # why the latest reset_prefix_cache() said no

    # ---- what the scheduler reads ----

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `allocate_slots(request, num_new_tokens)` would succeed now (changes nothing)."""
        check_token_count("num_new_tokens", num_new_tokens)
        # Exercise 3.3 (contract): True exactly when allocate_slots(request, num_new_tokens) (no prefix
        # hits) would return blocks rather than None right now, and nothing changes either way.
        # TODO: Exercise 3.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.3 (allocate_slots: all or nothing): not written yet: edit kvcourse/kv_cache.py, KVCacheManager.can_allocate."
        )

    # ---- allocation ----

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for this step's tokens, all or nothing: the blocks taken from the pool, or None."""
        # Exercise 3.3 (contract). First, self._check_allocation(...) with the four arguments raises on
        # impossible ones and returns the prefix hits as a list, `hits`. When this returns, either
        #   * the request's table (self.req_to_blocks[request.id], created at its first allocation)
        #     starts with the prefix hits `hits` (each with one more holder: self.block_pool.touch),
        #     then new blocks, and covers request.num_computed_tokens + num_new_computed_tokens +
        #     num_new_tokens tokens with no block to spare; every shared block this step writes into
        #     has been replaced by a private copy (self._shared_blocks_to_write finds them,
        #     self._copy_on_write makes the copies); the full blocks are offered to the prefix cache
        #     (self._cache_full_blocks) and, if this call is an ADMISSION, it is counted once
        #     (self._record_admission with the hit tokens, 0 without hits); the result is
        #     KVCacheBlocks(copies + new blocks), empty if none were needed;
        #   * or, if the free blocks are too few for ALL of that, it returns None and nothing at all
        #     has changed: no table, no ref count, no free-queue position, no pending copy.
        # An ADMISSION is a call made while the manager holds no table for the request (request.id not
        # in self.req_to_blocks): a new request, or one freed since (preempted). Even a call for 0 tokens
        # creates the table, so the calls after it are not admissions, whatever num_computed_tokens says.
        # Careful: a hit on a FREE block (ref_cnt 0) also uses up a free block. Lesson 04 makes hits and
        # shared blocks real; until then `hits` is empty and nothing is shared.
        # TODO: Exercise 3.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.3 (allocate_slots: all or nothing): not written yet: edit kvcourse/kv_cache.py, KVCacheManager.allocate_slots."
        )

    def _num_new_blocks(self, request: Request, num_tokens: int, num_hits: int, num_extra: int) -> int | None:
        """New blocks needed so the table covers `num_tokens` tokens, or None if the pool is short."""
        # Exercise 3.3 (contract): the number of NEW blocks that, added to the blocks the table will
        # hold (those it holds now plus num_hits prefix hits), cover num_tokens tokens exactly
        # (blocks_needed rounds up; a table that already covers them needs 0). None when those blocks
        # plus num_extra (other free blocks the step uses up: copies, hits on free blocks) exceed the
        # pool's free blocks.
        # TODO: Exercise 3.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.3 (allocate_slots: all or nothing): not written yet: edit kvcourse/kv_cache.py, KVCacheManager._num_new_blocks."
        )

    # ---- freeing ----

    def free(self, request: Request) -> None:
        """Give back a finished or preempted request's blocks; an unknown request is a no-op."""
        self.num_cached_block.pop(request.id, None)
        if request.is_complete():
            self.req_to_block_hashes.pop(request.id, None)  # a preempted request keeps its hashes
        # Exercise 3.4 (contract): afterwards the manager holds no table for the request (an unknown
        # or already freed request: nothing changes), and each of its blocks has lost this holder,
        # given back TAIL FIRST, so that the free queue reuses its tail before its head (a later
        # request with the same prefix can still share the head).
        # TODO: Exercise 3.4: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 3.4 (KVCacheManager.free): not written yet: edit kvcourse/kv_cache.py, KVCacheManager.free."
        )

    # ---- prefix caching ----

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Prefix-cache hits for a request being admitted: the cached blocks and the tokens they hold."""
        if not self.enable_prefix_caching:
            return KVCacheBlocks.empty(), 0
        # Exercise 4.3 (contract): return (KVCacheBlocks(hits), tokens the hits hold), where the hits
        # are the LONGEST run of the request's leading full blocks that the pool serves
        # (self.block_pool.get_cached_block), in order, stopping at the first miss. The block holding
        # token request.num_tokens - 1 is never a hit: the last token is always recomputed (its
        # logits give the next token). The hashes come from self._block_hashes(request).
        # TODO: Exercise 4.3: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.3 (Prefix-cache lookup): not written yet: edit kvcourse/kv_cache.py, KVCacheManager.get_computed_blocks."
        )

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """The hash chain of the request's full blocks, each block hashed once per request."""
        known = self.req_to_block_hashes.get(request.id)
        if known is None or known[0] is not request:  # a new request (or a new one reusing an id)
            self.req_to_block_hashes[request.id] = (request, [])
        # Exercise 4.2 (contract): the list self.req_to_block_hashes[request.id][1] holds the hashes
        # computed so far. Extend it IN PLACE so it holds hash_block_tokens' chain of every full
        # block of request.all_token_ids (the same list hash_request_tokens would give), and return
        # it. Blocks hashed on an earlier call are never hashed again: a request that grows by a
        # token, or is preempted and admitted again, costs at most its new full blocks.
        # TODO: Exercise 4.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.2 (Hash once, publish once): not written yet: edit kvcourse/kv_cache.py, KVCacheManager._block_hashes."
        )

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Publish every block this step fills with KNOWN tokens (a prompt's at admission), under its hash."""
        if not self.enable_prefix_caching:
            return
        # Exercise 4.2 (contract): after a step that makes the table cover num_tokens tokens, every
        # FULL block of it whose tokens are all known (positions below request.num_tokens) has been
        # offered to self.block_pool.cache_full_blocks with its hash (self._block_hashes) and its
        # tokens, each block offered once per admission: self.num_cached_block[request.id] counts the
        # leading blocks already offered (free() resets it).
        # TODO: Exercise 4.2: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.2 (Hash once, publish once): not written yet: edit kvcourse/kv_cache.py, KVCacheManager._cache_full_blocks."
        )

    # ---- parallel sampling: fork and copy-on-write ----

    def fork(self, parent: Request, child: Request) -> None:
        """Let a child sequence share every block of its parent: no copy until one of them writes."""
        utils.check_fork(self.req_to_blocks, parent, child)
        # Exercise 4.5 (contract): afterwards the child has a block table of its OWN (growing one table
        # never grows the other) listing the parent's blocks in order, and every one of those blocks
        # has one more holder. No block is taken from the pool. The child also inherits, as copies of
        # its own, the parent's hash chain (req_to_block_hashes, keyed to the child) and publishing
        # progress (num_cached_block): the shared blocks are never hashed or published again.
        # TODO: Exercise 4.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.5 (Fork and copy-on-write): not written yet: edit kvcourse/kv_cache.py, KVCacheManager.fork."
        )

    def _shared_blocks_to_write(self, request: Request, first_write: int, num_tokens: int) -> list[int]:
        """Logical indices of blocks this step writes into that another table also holds."""
        req_blocks = self.req_to_blocks.get(request.id, [])
        if all(block.ref_cnt == 1 for block in req_blocks):
            return []  # nothing shared, nothing to copy (always the case before lesson 04)
        # Exercise 4.6 (contract): this step writes token positions first_write .. num_tokens - 1.
        # Return, in increasing order, the index i of every block the table ALREADY holds that one of
        # those positions falls in and that another table holds too (ref_cnt > 1). Blocks the step
        # will add get no index; a step that writes nothing needs no copy.
        # TODO: Exercise 4.6: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.6 (The copy-on-write decision): not written yet: edit kvcourse/kv_cache.py, KVCacheManager._shared_blocks_to_write."
        )

    def _copy_on_write(self, req_blocks: list[KVCacheBlock], indices: list[int]) -> list[KVCacheBlock]:
        """Give this table private copies of shared blocks before it writes into them."""
        if not indices:
            return []  # nothing shared is written (always the case before lesson 04)
        # Exercise 4.5 (contract): for each index i, req_blocks[i] is replaced by a new block from the
        # pool and loses this holder (through the pool, so its count and queue stay right), and
        # (old id, new id) is appended to self.pending_copies for the executor. Return the new blocks
        # in the order of `indices`. The caller has checked there is room.
        # TODO: Exercise 4.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.5 (Fork and copy-on-write): not written yet: edit kvcourse/kv_cache.py, KVCacheManager._copy_on_write."
        )

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies to run before the next forward pass; the list is then cleared."""
        # Exercise 4.5 (contract): return the copies reported since the last call, oldest first, and
        # leave none pending (the executor runs each copy exactly once).
        # TODO: Exercise 4.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 4.5 (Fork and copy-on-write): not written yet: edit kvcourse/kv_cache.py, KVCacheManager.take_pending_copies."
        )

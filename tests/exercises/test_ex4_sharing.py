"""Graded tests for notebook 04: hash chain, prefix lookup, shared blocks, LRU eviction, fork + copy-on-write."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvcourse.kv_cache as kv_cache
from kvcourse.kv_cache import BlockPool, KVCacheManager, hash_block_tokens, hash_request_tokens
from kvcourse.request import Request

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = list(range(1000, 1012))  # a 12-token "system prompt": 3 full blocks of 4


def request(request_id: int, tokens: list[int], num_computed_tokens: int = 0) -> Request:
    """A request whose prompt is exactly `tokens`."""
    return Request(request_id, list(tokens), max_new_tokens=8, num_computed_tokens=num_computed_tokens)


def admit(manager: KVCacheManager, req: Request) -> int:
    """What a scheduler does: look up the prefix, allocate the rest, mark the prompt computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    new = manager.allocate_slots(req, req.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    assert new is not None, "admitting a request should succeed while enough blocks are free"
    req.num_computed_tokens = req.num_tokens
    return num_hit_tokens


def free_ids(manager: KVCacheManager) -> list[int]:
    """The free queue front to back, as ids."""
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


# ---- 4.1 the hash chain ------------------------------------------------------------------


@pytest.mark.ex4_1
def test_hash_is_repeatable_and_hashable():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4]), "the same parent and tokens should give the same hash"
    try:
        published = {first: "block 7"}
        found = published.get(hash_block_tokens(None, [1, 2, 3, 4]))
    except TypeError:
        pytest.fail("a block hash must be hashable (bytes, a tuple, ...): it is a key of the prefix-cache dict")
    assert found == "block 7", "a block hash should find its entry when used as a dictionary key"
    assert first != hash_block_tokens(None, [1, 2, 3, 5]), "different tokens should give a different hash"
    assert first != hash_block_tokens(None, [4, 3, 2, 1]), "the order of the tokens should matter"


@pytest.mark.ex4_1
def test_hash_depends_on_the_parent():
    parent_a = hash_block_tokens(None, [1, 2])
    parent_b = hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(parent_a, [5, 6]) != hash_block_tokens(parent_b, [5, 6]), (
        "the same tokens after a different prefix should give a different hash: mix in the parent's hash"
    )
    assert hash_block_tokens(parent_a, [5, 6]) != hash_block_tokens(None, [5, 6]), (
        "a block with a parent should not hash like a first block"
    )


@pytest.mark.ex4_1
def test_chain_covers_full_blocks_only():
    tokens = list(range(10))
    hashes = hash_request_tokens(4, tokens)
    assert len(hashes) == 2, "the chain should have one hash per FULL block; a partial last block gets none"
    assert hashes[0] == hash_block_tokens(None, tokens[0:4]), "the first block's parent should be None"
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8]), (
        "each block's parent should be the previous block's hash"
    )
    assert len(hash_request_tokens(4, tokens[:8])) == 2, "a sequence that ends on a block boundary hashes every block"
    assert hash_request_tokens(4, tokens[:3]) == [], "fewer tokens than a block give no hash"


@pytest.mark.ex4_1
def test_an_early_difference_changes_every_later_hash():
    a = hash_request_tokens(2, [1, 2, 3, 4, 5, 6])
    b = hash_request_tokens(2, [9, 2, 3, 4, 5, 6])
    assert all(x != y for x, y in zip(a, b)), "a change in the first block should change the hash of every later block"


@pytest.mark.ex4_1
def test_hash_is_the_same_in_another_process():
    tokens = [5, 17, 3, 99, 42, 8, 7, 1]
    here = [h.hex() if isinstance(h, bytes) else repr(h) for h in hash_request_tokens(4, tokens)]
    code = (
        "import kvcourse.kv_cache as k\n"
        f"print([h.hex() if isinstance(h, bytes) else repr(h) for h in k.hash_request_tokens(4, {tokens})])"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, "computing the hashes in a fresh Python process failed"
    assert done.stdout.strip() == repr(here), (
        "another process computed different hashes: use hashlib over a stable encoding, not Python's hash()"
    )


# ---- 4.3 prefix-cache lookup -------------------------------------------------------------


@pytest.mark.ex4_3
def test_get_cached_block_confirms_the_tokens():
    pool = BlockPool(4, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([block], [b"hash-a"], [[1, 2]])
    assert pool.get_cached_block(b"hash-a", [1, 2]) is block, "a published block should be found by its hash"
    assert pool.get_cached_block(b"hash-a", [1, 3]) is None, (
        "a hash whose block holds other tokens is a collision and must not be a hit"
    )
    assert pool.get_cached_block(b"hash-b", [1, 2]) is None, "an unknown hash should not be a hit"


@pytest.mark.ex4_3
def test_second_request_hits_the_shared_prefix():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = request(1, SYSTEM + [1, 2, 3])
    admit(manager, first)
    second = request(2, SYSTEM + [7, 8])
    hits, num_tokens = manager.get_computed_blocks(second)
    assert num_tokens == 12, "every full block of the shared prefix should be a hit"
    assert hits.get_block_ids() == manager.get_block_ids(first)[:3], (
        "the hits should be the first request's own blocks, in order"
    )


@pytest.mark.ex4_3
def test_last_token_is_always_recomputed():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(manager, request(1, SYSTEM))
    hits, num_tokens = manager.get_computed_blocks(request(2, SYSTEM))
    assert num_tokens == 8, (
        "an identical prompt must not hit the block holding its last token: that token is always recomputed"
    )
    assert len(hits) == 2, "the number of hit blocks should match the tokens they hold"


@pytest.mark.ex4_3
def test_lookup_stops_at_the_first_miss():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(manager, request(1, SYSTEM + [0]))
    changed = SYSTEM[:4] + [0, 0, 0, 0] + SYSTEM[8:] + [0]
    hits, num_tokens = manager.get_computed_blocks(request(2, changed))
    assert num_tokens == 4, "after the first block that misses, nothing later may be a hit (its prefix differs)"


@pytest.mark.ex4_3
def test_cached_blocks_after_a_miss_are_not_hits():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    pool = manager.block_pool
    blocks = pool.get_new_blocks(3)
    hashes = hash_request_tokens(4, SYSTEM)
    pool.cache_full_blocks(blocks[1:], hashes[1:], [SYSTEM[4:8], SYSTEM[8:12]])  # the first block was evicted
    pool.free_blocks(blocks)
    hits, num_tokens = manager.get_computed_blocks(request(2, SYSTEM + [0]))
    assert num_tokens == 0, (
        "after a miss, later blocks must not be hits even if they are cached (stop at the first miss)"
    )


@pytest.mark.ex4_3
def test_no_hits_when_caching_is_off_or_cache_is_cold():
    cold = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    hits, num_tokens = cold.get_computed_blocks(request(1, SYSTEM))
    assert (len(hits), num_tokens) == (0, 0), "an empty cache should give no hits"
    off = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(off, request(1, SYSTEM))
    admit(cold, request(1, SYSTEM))
    hits, num_tokens = off.get_computed_blocks(request(2, SYSTEM))
    assert (len(hits), num_tokens) == (0, 0), "with prefix caching off there should never be a hit"


@pytest.mark.ex4_3
def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kv_cache, "hash_block_tokens", lambda parent, tokens: b"always-the-same")
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(manager, request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    hits, num_tokens = manager.get_computed_blocks(request(2, [9, 9, 9, 9, 5, 6, 7, 8, 9]))
    assert num_tokens == 0, "when two different blocks share a hash, the lookup must check the tokens and miss"


# ---- 4.3 prefix-cache lookup: sharing the hits ---------------------------------------------------------------------


@pytest.fixture
def count_hashes(monkeypatch):
    """Count hash_block_tokens calls made through the kv_cache module (the manager's calls)."""
    calls = []
    real = kv_cache.hash_block_tokens

    def counting(parent, tokens):
        calls.append(tuple(tokens))
        return real(parent, tokens)

    monkeypatch.setattr(kv_cache, "hash_block_tokens", counting)
    return calls


@pytest.mark.ex4_2
def test_chain_is_the_request_chain_as_it_grows():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    req = request(1, SYSTEM + [1, 2])
    assert manager._block_hashes(req) == hash_request_tokens(4, req.all_token_ids), (
        "_block_hashes should be the hash chain of the request's full blocks"
    )
    req.output_tokens += [3, 4, 5]
    assert manager._block_hashes(req) == hash_request_tokens(4, req.all_token_ids), (
        "after the request grows, _block_hashes should extend the chain with its new full blocks"
    )


@pytest.mark.ex4_2
def test_each_block_is_hashed_once(count_hashes):
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    req = request(1, SYSTEM + [1, 2])
    for _ in range(3):
        manager._block_hashes(req)
    assert len(count_hashes) == 3, (
        f"three calls for a 3-block prompt made {len(count_hashes)} hash calls: hash each full block once "
        "per request and keep the chain (vLLM extends it as the request grows)"
    )
    manager.allocate_slots(req, req.num_tokens)  # admission publishes the full blocks: no new hash
    req.num_computed_tokens = req.num_tokens
    req.output_tokens += [3, 4]
    manager.allocate_slots(req, 2)
    assert len(count_hashes) == 4, "growing by one full block should cost exactly one more hash"


@pytest.mark.ex4_2
def test_a_preempted_request_is_not_hashed_again(count_hashes):
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    req = request(1, SYSTEM + [1])
    manager.allocate_slots(req, req.num_tokens)
    manager.free(req)  # preempted: blocks back, request not complete
    manager.allocate_slots(req, req.num_tokens)  # admitted again (recompute)
    assert len(count_hashes) == 3, "re-admitting a preempted request should reuse its hashes, not recompute them"
    assert manager._block_hashes(req) == hash_request_tokens(4, req.all_token_ids), "the chain should still be right"


@pytest.mark.ex4_2
def test_admission_publishes_the_full_prompt_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = request(1, SYSTEM + [5, 6, 7, 8, 9, 10])  # 18 tokens: 4 full blocks and 2 tokens
    manager.allocate_slots(req, req.num_tokens)
    table, published = manager.get_blocks(req).blocks, manager.block_pool.cached_block_hash_to_block
    hashes = hash_request_tokens(4, req.all_token_ids)
    assert len(published) == 4, "admission should publish every FULL block of the prompt, and only those"
    for i, block_hash in enumerate(hashes):
        assert published.get(block_hash) is table[i], f"block {i} should be published under its chain hash"
        assert table[i].token_ids == tuple(req.all_token_ids[4 * i : 4 * i + 4]), "a block keeps its tokens"
    assert table[4].block_hash is None, "a partly filled block must not be published"


@pytest.mark.ex4_2
def test_blocks_are_published_as_they_fill():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    req = request(1, [1, 2, 3, 4, 5, 6])
    manager.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    assert manager.block_pool.get_num_cached_blocks() == 1, "a 6-token prompt has one full block to publish"
    for token in (7, 8):  # two decode steps fill the second block
        req.output_tokens.append(token)
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert manager.block_pool.get_num_cached_blocks() == 2, "a block should be published once decodes fill it"
    assert manager.get_blocks(req).blocks[1].block_hash == hash_request_tokens(4, req.all_token_ids)[1]


@pytest.mark.ex4_2
def test_a_prefix_already_served_is_not_published_again():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first, second = request(1, SYSTEM), request(2, SYSTEM)  # admitted without a lookup: computed twice
    manager.allocate_slots(first, 12)
    manager.allocate_slots(second, 12)
    published = list(manager.block_pool.cached_block_hash_to_block.values())
    assert published == list(manager.get_blocks(first).blocks), (
        "the first block published for a prefix keeps serving it"
    )
    assert all(b.block_hash is None for b in manager.get_blocks(second).blocks), (
        "a block whose prefix another block already serves stays unpublished"
    )


@pytest.mark.ex4_2
def test_a_published_block_keeps_its_first_hash():
    pool = BlockPool(2, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([block], [b"first"], [[1, 2]])
    pool.cache_full_blocks([block], [b"second"], [[3, 4]])
    assert block.block_hash == b"first" and block.token_ids == (1, 2), "a published block keeps its first hash"
    assert pool.get_num_cached_blocks() == 1, "publishing a block twice must not add a second entry"


@pytest.mark.ex4_3
def test_hits_are_shared_not_copied():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = request(1, SYSTEM + [1])
    admit(manager, first)
    free_before = manager.get_num_free_blocks()
    second = request(2, SYSTEM + [2, 3])
    assert admit(manager, second) == 12, "the second request should hit the shared prefix"
    shared = manager.get_block_ids(first)[:3]
    assert manager.get_block_ids(second)[:3] == shared, "the second request's table should start with the shared blocks"
    assert all(manager.block_pool.blocks[i].ref_cnt == 2 for i in shared), "each shared block should have two holders"
    assert manager.get_num_free_blocks() == free_before - 1, "only the unshared tail should take a new block"


@pytest.mark.ex4_3
def test_hits_on_freed_blocks_leave_the_free_queue():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = request(1, SYSTEM + [1])
    admit(manager, first)
    shared = manager.get_block_ids(first)[:3]
    manager.free(first)
    second = request(2, SYSTEM + [2])
    assert admit(manager, second) == 12, "blocks of a finished request should still be hits"
    assert manager.get_block_ids(second)[:3] == shared, "the hits should be the freed request's blocks"
    assert not set(shared) & set(free_ids(manager)), "blocks taken as hits must leave the free queue"
    assert manager.get_num_free_blocks() == 4, (
        "taking hits on free blocks should lower the free count by the hits plus the new blocks"
    )


@pytest.mark.ex4_3
def test_hit_rate_counts_admitted_tokens_and_hits():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(manager, request(1, SYSTEM + [1]))
    admit(manager, request(2, SYSTEM + [2, 3]))
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 13 + 14, 12), (
        "the stats should count two admissions, their 27 tokens, and the 12 tokens the second one hit"
    )
    assert stats.hit_rate == pytest.approx(12 / 27), "hit_rate is hits / queries"


@pytest.mark.ex4_3
def test_everything_comes_back_after_sharing():
    manager = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    reqs = [request(i, SYSTEM + [i, i]) for i in range(3)]
    for req in reqs:
        admit(manager, req)
    for req in reqs:
        manager.free(req)
    assert manager.get_num_free_blocks() == 12, "after all requests end, every block should be free"
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks), (
        "after all requests end, no block should have a holder"
    )


# ---- 4.4 free and LRU eviction -----------------------------------------------------------


@pytest.mark.ex4_4
def test_reusing_a_block_forgets_its_hash():
    pool = BlockPool(2, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([block], [b"old"], [[1, 2]])
    pool.free_blocks([block])
    assert pool.get_cached_block(b"old", [1, 2]) is block, "a freed block should stay in the prefix cache"
    reused = pool.get_new_blocks(2)
    assert block in reused, "the test expected the cached block to be handed out again"
    assert pool.get_cached_block(b"old", [1, 2]) is None, "a reused block must leave the prefix cache"
    assert block.block_hash is None and block.token_ids is None, "a reused block should forget its hash and tokens"


@pytest.mark.ex4_4
def test_tail_is_evicted_before_head():
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = request(1, SYSTEM + [5, 6, 7, 8])  # 4 full blocks
    admit(manager, first)
    manager.free(first)
    admit(manager, request(2, [1, 2, 3]))  # takes one block: the first request's tail
    hits, num_tokens = manager.get_computed_blocks(request(3, SYSTEM + [0]))
    assert num_tokens == 12, "after one eviction, the head of a freed request should still be hittable"


@pytest.mark.ex4_4
def test_evicted_prefix_is_no_longer_served():
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = request(1, SYSTEM + [0])
    admit(manager, first)
    manager.free(first)
    filler = request(2, list(range(16)))
    admit(manager, filler)
    manager.free(filler)
    hits, num_tokens = manager.get_computed_blocks(request(3, SYSTEM + [0]))
    assert num_tokens == 0, "blocks overwritten by another request must not be served as hits"


@pytest.mark.ex4_4
def test_an_evicted_prefix_is_cached_again_once_recomputed():
    manager = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = request(1, SYSTEM + [0])
    admit(manager, first)
    manager.free(first)
    filler = request(2, list(range(16)))  # reuses all four blocks: the system prompt is evicted
    admit(manager, filler)
    manager.free(filler)
    again = request(3, SYSTEM + [1])
    assert admit(manager, again) == 0, "the evicted system prompt must be a miss"
    manager.free(again)
    hits, num_tokens = manager.get_computed_blocks(request(4, SYSTEM + [2]))
    assert num_tokens == 12, (
        "after an evicted prefix is recomputed, the next request with it should hit again: eviction must "
        "delete the old hash-map entry, or the recomputed blocks can never be published under it"
    )


# ---- 4.5 fork and copy-on-write ----------------------------------------------------------


def forked_pair(manager: KVCacheManager, num_tokens: int) -> tuple[Request, Request]:
    """A parent with num_tokens computed tokens and a child forked from it (parallel sampling)."""
    parent = request(1, list(range(num_tokens)), num_computed_tokens=0)
    manager.allocate_slots(parent, num_tokens)
    parent.num_computed_tokens = num_tokens
    child = request(2, list(range(num_tokens)), num_computed_tokens=num_tokens)
    manager.fork(parent, child)
    return parent, child


@pytest.mark.ex4_5
def test_fork_shares_every_block():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 6)
    assert manager.get_block_ids(child) == manager.get_block_ids(parent), (
        "a fork should share every block of the parent"
    )
    assert all(b.ref_cnt == 2 for b in manager.get_blocks(parent).blocks), "every shared block should have two holders"
    assert manager.get_num_free_blocks() == 6, "a fork should not take any new block"


@pytest.mark.ex4_5
def test_fork_gives_the_child_its_own_table():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 8)
    manager.req_to_blocks[child.id].extend(manager.block_pool.get_new_blocks(1))
    assert len(manager.get_block_ids(parent)) == 2, "growing the child's table must not grow the parent's"
    assert len(manager.get_block_ids(child)) == 3, "the child should have a table (a list) of its own"


@pytest.mark.ex4_5
def test_a_forked_child_inherits_the_hash_chain(count_hashes):
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    parent = request(1, SYSTEM + [1])
    manager.allocate_slots(parent, parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    hashed = len(count_hashes)
    child = request(2, SYSTEM + [1], num_computed_tokens=parent.num_tokens)
    manager.fork(parent, child)
    child.output_tokens += [7, 7, 7]  # the child fills its last block: one new full block
    manager._block_hashes(child)
    assert len(count_hashes) == hashed + 1, (
        "a forked child should inherit its parent's hash chain: only its own new full block is hashed"
    )
    assert manager._block_hashes(child) == hash_request_tokens(4, child.all_token_ids), "the child's chain is right"
    assert manager._block_hashes(parent) == hash_request_tokens(4, parent.all_token_ids), (
        "the child's chain must be a copy: extending it must not extend the parent's"
    )


@pytest.mark.ex4_5
def test_copy_on_write_swaps_in_a_private_copy():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 6)
    table = manager.req_to_blocks[child.id]
    shared = table[1]
    copies = manager._copy_on_write(table, [1])
    assert len(copies) == 1 and table[1] is copies[0], "the copy should take the shared block's place in the table"
    assert table[0] is manager.req_to_blocks[parent.id][0], "blocks that are not written stay shared"
    assert shared.ref_cnt == 1 and copies[0].ref_cnt == 1, "the old block loses this holder; the copy has one"
    assert manager.take_pending_copies() == [(shared.block_id, copies[0].block_id)], (
        "the copy should be reported to the executor as (src, dst)"
    )
    assert manager.get_num_free_blocks() == 5, "a copy takes exactly one block from the pool"


@pytest.mark.ex4_6
def test_only_shared_blocks_that_are_written_are_copied():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 6)
    assert manager._shared_blocks_to_write(child, 6, 7) == [1], "writing token 6 lands in shared block 1"
    assert manager._shared_blocks_to_write(child, 6, 6) == [], "a step that writes nothing needs no copy"
    assert manager._shared_blocks_to_write(child, 6, 12) == [1], (
        "blocks the step adds are new, not shared: only the table's existing blocks can need a copy"
    )
    assert manager._shared_blocks_to_write(child, 3, 7) == [0, 1], (
        "a write that starts inside block 0 and ends inside block 1 touches both shared blocks"
    )


@pytest.mark.ex4_6
def test_a_block_already_copied_is_not_copied_again():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 6)
    assert manager.allocate_slots(child, 1) is not None, "the child's first write should succeed"
    child.num_computed_tokens = 7
    manager.take_pending_copies()
    free_before = manager.get_num_free_blocks()
    assert manager.allocate_slots(child, 1) is not None, "the child's second write should succeed"
    assert manager.take_pending_copies() == [], (
        "the child's last block is its own after the first copy (ref_cnt 1): writing into it again needs no copy"
    )
    assert manager.get_num_free_blocks() == free_before, "a write into a private block takes no block"


@pytest.mark.ex4_6
def test_writing_into_a_shared_partial_block_copies_it():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 6)
    shared_last = manager.get_block_ids(parent)[1]
    new = manager.allocate_slots(child, 1)
    assert new is not None, "the child's write should succeed while blocks are free"
    child_table = manager.get_block_ids(child)
    assert child_table[0] == manager.get_block_ids(parent)[0], "the full first block should stay shared"
    assert child_table[1] != shared_last, "the child must not write into the block its parent still uses"
    assert manager.take_pending_copies() == [(shared_last, child_table[1])], "the copy should be reported as (src, dst)"
    assert manager.take_pending_copies() == [], "take_pending_copies should empty the list"
    assert manager.block_pool.blocks[shared_last].ref_cnt == 1, "after the copy, the old block has one holder left"


@pytest.mark.ex4_6
def test_writing_after_a_full_block_copies_nothing():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 8)
    manager.allocate_slots(child, 1)
    assert manager.take_pending_copies() == [], "a write into a fresh block needs no copy"


@pytest.mark.ex4_6
def test_copy_needs_a_free_block():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    parent, child = forked_pair(manager, 6)
    assert manager.allocate_slots(child, 1) is None, "a copy-on-write with no free block should fail"
    assert manager.take_pending_copies() == [], "a failed allocation must not report a copy"
    assert all(b.ref_cnt == 2 for b in manager.get_blocks(child).blocks), (
        "a failed allocation must not change ref counts"
    )


@pytest.mark.ex4_6
def test_fork_and_free_leak_nothing():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = forked_pair(manager, 6)
    manager.allocate_slots(child, 1)
    manager.allocate_slots(parent, 1)
    manager.free(parent)
    manager.free(child)
    assert manager.get_num_free_blocks() == 8, "after parent and child end, every block should be free"

"""Graded tests for notebook 04: hash chain, prefix lookup, shared blocks, LRU eviction, fork + copy-on-write."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from invariants import checked
from toy_world import ToyWorld, check_outputs, shared_prompt_workload, stand_ins

import kvcourse.kv_cache as kv_cache
from kvcourse.core.request import Request
from kvcourse.kv_cache import BlockPool, KVCacheManager, hash_block_tokens, hash_request_tokens

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = list(range(1000, 1012))  # a 12-token "system prompt": 3 full blocks of 4


def make_manager(num_blocks: int, block_size: int, upto: str, caching: bool = False) -> KVCacheManager:
    """A manager running the learner's code up to exercise `upto` (the tests' own after it), checked after each call."""
    return checked(stand_ins(KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching), upto))


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
    pool = checked(BlockPool(4, enable_caching=True))
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([block], [b"hash-a"], [[1, 2]])
    assert pool.get_cached_block(b"hash-a", [1, 2]) is block, "a published block should be found by its hash"
    assert pool.get_cached_block(b"hash-a", [1, 3]) is None, (
        "a hash whose block holds other tokens is a collision and must not be a hit"
    )
    assert pool.get_cached_block(b"hash-b", [1, 2]) is None, "an unknown hash should not be a hit"


@pytest.mark.ex4_3
def test_second_request_hits_the_shared_prefix():
    manager = make_manager(16, 4, "4.3", caching=True)
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
    manager = make_manager(16, 4, "4.3", caching=True)
    admit(manager, request(1, SYSTEM))
    hits, num_tokens = manager.get_computed_blocks(request(2, SYSTEM))
    assert num_tokens == 8, (
        "an identical prompt must not hit the block holding its last token: that token is always recomputed"
    )
    assert len(hits) == 2, "the number of hit blocks should match the tokens they hold"


@pytest.mark.ex4_3
def test_lookup_stops_at_the_first_miss():
    manager = make_manager(16, 4, "4.3", caching=True)
    admit(manager, request(1, SYSTEM + [0]))
    changed = SYSTEM[:4] + [0, 0, 0, 0] + SYSTEM[8:] + [0]
    hits, num_tokens = manager.get_computed_blocks(request(2, changed))
    assert num_tokens == 4, "after the first block that misses, nothing later may be a hit (its prefix differs)"


@pytest.mark.ex4_3
def test_cached_blocks_after_a_miss_are_not_hits():
    manager = make_manager(8, 4, "4.3", caching=True)
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
    cold = make_manager(8, 4, "4.3", caching=True)
    hits, num_tokens = cold.get_computed_blocks(request(1, SYSTEM))
    assert (len(hits), num_tokens) == (0, 0), "an empty cache should give no hits"
    off = make_manager(8, 4, "4.3")
    admit(off, request(1, SYSTEM))
    admit(cold, request(1, SYSTEM))
    hits, num_tokens = off.get_computed_blocks(request(2, SYSTEM))
    assert (len(hits), num_tokens) == (0, 0), "with prefix caching off there should never be a hit"


@pytest.mark.ex4_3
def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(kv_cache, "hash_block_tokens", lambda parent, tokens: b"always-the-same")
    manager = make_manager(16, 4, "4.3", caching=True)
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
    manager = make_manager(16, 4, "4.2", caching=True)
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
    manager = make_manager(16, 4, "4.2", caching=True)
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
    manager = make_manager(16, 4, "4.2", caching=True)
    req = request(1, SYSTEM + [1])
    manager.allocate_slots(req, req.num_tokens)
    manager.free(req)  # preempted: blocks back, request not complete
    manager.allocate_slots(req, req.num_tokens)  # admitted again (recompute)
    assert len(count_hashes) == 3, "re-admitting a preempted request should reuse its hashes, not recompute them"
    assert manager._block_hashes(req) == hash_request_tokens(4, req.all_token_ids), "the chain should still be right"


@pytest.mark.ex4_2
def test_admission_publishes_the_full_prompt_blocks():
    manager = make_manager(8, 4, "4.2", caching=True)
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
    manager = make_manager(8, 4, "4.2", caching=True)
    req = request(1, [1, 2, 3, 4, 5, 6])
    manager.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    assert manager.block_pool.get_num_cached_blocks() == 1, "a 6-token prompt has one full block to publish"
    for token in (7, 8):  # two decode steps fill the second block
        req.output_tokens.append(token)
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert manager.block_pool.get_num_cached_blocks() == 2, "a block should be published once decodes fill it"
    assert manager.get_blocks(req).blocks[1].block_hash == hash_request_tokens(4, req.all_token_ids)[1], (
        "a block filled by decodes is published under its chain hash"
    )


@pytest.mark.ex4_2
def test_a_prefix_already_served_is_not_published_again():
    manager = make_manager(8, 4, "4.2", caching=True)
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
    pool = checked(BlockPool(2, enable_caching=True))
    block = pool.get_new_blocks(1)[0]
    pool.cache_full_blocks([block], [b"first"], [[1, 2]])
    pool.cache_full_blocks([block], [b"second"], [[3, 4]])
    assert block.block_hash == b"first" and block.token_ids == (1, 2), "a published block keeps its first hash"
    assert pool.get_num_cached_blocks() == 1, "publishing a block twice must not add a second entry"


@pytest.mark.ex4_3
def test_hits_are_shared_not_copied():
    manager = make_manager(16, 4, "4.3", caching=True)
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
    manager = make_manager(8, 4, "4.3", caching=True)
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
    manager = make_manager(16, 4, "4.3", caching=True)
    admit(manager, request(1, SYSTEM + [1]))
    admit(manager, request(2, SYSTEM + [2, 3]))
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 13 + 14, 12), (
        "the stats should count two admissions, their 27 tokens, and the 12 tokens the second one hit"
    )
    assert stats.hit_rate == pytest.approx(12 / 27), "hit_rate is hits / queries"


@pytest.mark.ex4_3
def test_everything_comes_back_after_sharing():
    manager = make_manager(12, 4, "4.3", caching=True)
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
    pool = checked(BlockPool(2, enable_caching=True))
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
    manager = make_manager(4, 4, "4.4", caching=True)
    first = request(1, SYSTEM + [5, 6, 7, 8])  # 4 full blocks
    admit(manager, first)
    manager.free(first)
    admit(manager, request(2, [1, 2, 3]))  # takes one block: the first request's tail
    hits, num_tokens = manager.get_computed_blocks(request(3, SYSTEM + [0]))
    assert num_tokens == 12, "after one eviction, the head of a freed request should still be hittable"


@pytest.mark.ex4_4
def test_evicted_prefix_is_no_longer_served():
    manager = make_manager(4, 4, "4.4", caching=True)
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
    manager = make_manager(4, 4, "4.4", caching=True)
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
    manager = make_manager(8, 4, "4.5")
    parent, child = forked_pair(manager, 6)
    assert manager.get_block_ids(child) == manager.get_block_ids(parent), (
        "a fork should share every block of the parent"
    )
    assert all(b.ref_cnt == 2 for b in manager.get_blocks(parent).blocks), "every shared block should have two holders"
    assert manager.get_num_free_blocks() == 6, "a fork should not take any new block"


@pytest.mark.ex4_5
def test_fork_gives_the_child_its_own_table():
    manager = make_manager(8, 4, "4.5")
    parent, child = forked_pair(manager, 8)
    manager.req_to_blocks[child.id].extend(manager.block_pool.get_new_blocks(1))
    assert len(manager.get_block_ids(parent)) == 2, "growing the child's table must not grow the parent's"
    assert len(manager.get_block_ids(child)) == 3, "the child should have a table (a list) of its own"


@pytest.mark.ex4_5
def test_a_forked_child_inherits_the_hash_chain(count_hashes):
    manager = make_manager(8, 4, "4.5", caching=True)
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
    manager = make_manager(8, 4, "4.5")
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
    manager = make_manager(8, 4, "4.6")
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
def test_only_the_blocks_the_write_falls_in_are_named():
    manager = make_manager(8, 4, "4.6")
    parent, child = forked_pair(manager, 12)  # three full blocks, all shared
    assert manager._shared_blocks_to_write(child, 0, 2) == [0], (
        "a write into positions 0-1 falls in block 0 only: shared blocks after the written positions need no copy"
    )
    assert manager._shared_blocks_to_write(child, 4, 6) == [1], (
        "a write into positions 4-5 falls in block 1 only: neither the block before it nor the one after needs a copy"
    )


@pytest.mark.ex4_6
def test_a_block_already_copied_is_not_copied_again():
    manager = make_manager(8, 4, "4.6")
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
    manager = make_manager(8, 4, "4.6")
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
    manager = make_manager(8, 4, "4.6")
    parent, child = forked_pair(manager, 8)
    manager.allocate_slots(child, 1)
    assert manager.take_pending_copies() == [], "a write into a fresh block needs no copy"


@pytest.mark.ex4_6
def test_copy_needs_a_free_block():
    manager = make_manager(2, 4, "4.6")
    parent, child = forked_pair(manager, 6)
    assert manager.allocate_slots(child, 1) is None, "a copy-on-write with no free block should fail"
    assert manager.take_pending_copies() == [], "a failed allocation must not report a copy"
    assert all(b.ref_cnt == 2 for b in manager.get_blocks(child).blocks), (
        "a failed allocation must not change ref counts"
    )


@pytest.mark.ex4_6
def test_fork_and_free_leak_nothing():
    manager = make_manager(8, 4, "4.6")
    parent, child = forked_pair(manager, 6)
    manager.allocate_slots(child, 1)
    manager.allocate_slots(parent, 1)
    manager.free(parent)
    manager.free(child)
    assert manager.get_num_free_blocks() == 8, "after parent and child end, every block should be free"


# ---- 4.1 more of the hash's contract -------------------------------------------------------


@pytest.mark.ex4_1
def test_token_boundaries_matter():
    assert hash_block_tokens(None, [1, 23, 4, 5]) != hash_block_tokens(None, [12, 3, 4, 5]), (
        "[1, 23, 4, 5] and [12, 3, 4, 5] hash alike: joining the tokens' digits loses where one token ends; "
        "hash an encoding that keeps each token apart"
    )
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [12]), "the number of tokens must matter"
    parent = hash_block_tokens(None, [7, 7])
    assert hash_block_tokens(parent, [1, 2]) != hash_block_tokens(None, [*parent, 1, 2]), (
        "the parent's hash and the tokens must not blur into each other"
    )


@pytest.mark.ex4_1
def test_the_same_tokens_hash_alike_however_they_are_held():
    as_list = hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, (5, 6, 7, 8)) == as_list, (
        "the same tokens in a tuple and in a list hash differently: hash the token values, not the container"
    )
    assert hash_request_tokens(2, (5, 6, 7, 8)) == hash_request_tokens(2, [5, 6, 7, 8]), "the chain should agree too"


@pytest.mark.ex4_1
def test_hash_is_bytes():
    digest = hash_block_tokens(None, [3, 1, 4, 1])
    assert isinstance(digest, bytes) and len(digest) >= 16, (
        "a block hash should be a bytes digest (HASH_FUNCTION(...).digest()), the same in every process"
    )
    assert hash_block_tokens(digest, [3, 1, 4, 1]) != digest, "a block with a parent should not hash like its parent"


@pytest.mark.ex4_1
def test_chain_of_a_long_request():
    tokens = list(range(50, 83))  # 33 tokens: 8 full blocks of 4 and one token
    hashes = hash_request_tokens(4, tokens)
    assert len(hashes) == 8, "one hash per FULL block: the block that ends exactly at the last full block counts"
    parent = None
    for i, block_hash in enumerate(hashes):
        assert block_hash == hash_block_tokens(parent, tokens[4 * i : 4 * i + 4]), f"block {i}'s hash is off"
        parent = block_hash
    assert len(set(hashes)) == 8, "every block of a chain should have its own hash"


# ---- 4.2 publishing: once, known tokens only ------------------------------------------------


@pytest.fixture
def offered(monkeypatch):
    """Record every block the manager offers to the pool's prefix cache (and still publish it)."""
    calls = []

    def spy(manager):
        pool = manager.block_pool
        real = pool.cache_full_blocks

        def recording(blocks, block_hashes, token_ids):
            calls.extend(block.block_id for block in blocks)
            return real(blocks, block_hashes, token_ids)

        monkeypatch.setattr(pool, "cache_full_blocks", recording)
        return calls

    return spy


@pytest.mark.ex4_2
def test_each_full_block_is_offered_once(offered):
    manager = make_manager(8, 4, "4.2", caching=True)
    calls = offered(manager)
    req = request(1, [1, 2, 3, 4, 5, 6])
    manager.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    for token in range(7, 15):  # eight decodes: blocks 1 and 2 fill up
        req.output_tokens.append(token)
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    table = manager.get_block_ids(req)
    assert sorted(calls) == sorted(table[:3]) and len(calls) == 3, (
        "every full block should be offered to cache_full_blocks exactly once per admission: "
        "num_cached_block counts the blocks already offered, so a step offers only the blocks it fills"
    )


@pytest.mark.ex4_2
def test_only_known_tokens_are_published():
    manager = make_manager(8, 4, "4.2", caching=True)
    req = request(1, [1, 2, 3, 4, 5, 6])
    manager.allocate_slots(req, 10)  # room for 10 tokens, but only 6 are known
    assert manager.block_pool.get_num_cached_blocks() == 1, (
        "a block is published only when all its tokens are known (positions below request.num_tokens)"
    )
    req.num_computed_tokens = 6
    req.output_tokens += [7, 8]
    manager.allocate_slots(req, 2)
    assert manager.block_pool.get_num_cached_blocks() == 2, "once its tokens are known, the block is published"


@pytest.mark.ex4_2
def test_the_chain_is_kept_in_place():
    manager = make_manager(8, 4, "4.2", caching=True)
    req = request(1, SYSTEM + [1])
    first = manager._block_hashes(req)
    assert first is manager.req_to_block_hashes[req.id][1], (
        "_block_hashes should extend and return the list kept in req_to_block_hashes (in place)"
    )
    req.output_tokens += [2, 3, 4]
    assert manager._block_hashes(req) is first and len(first) == 4, "the same list grows with the request"


@pytest.mark.ex4_2
@pytest.mark.parametrize("seed", range(8))
def test_publishing_under_a_shared_prefix_workload(seed):
    manager = make_manager(8 + 2 * (seed % 3), 4, "4.2", caching=True)
    requests = shared_prompt_workload(seed)
    world = ToyWorld(manager, max_running=6)
    for req in requests:
        world.add(req)
    world.run()
    check_outputs(world, requests)


# ---- 4.3 lookup at block boundaries ----------------------------------------------------------


@pytest.mark.ex4_3
def test_a_prompt_one_past_a_block_boundary_hits_every_full_block():
    manager = make_manager(16, 4, "4.3", caching=True)
    admit(manager, request(1, SYSTEM + [1, 2]))
    hits, num_tokens = manager.get_computed_blocks(request(2, SYSTEM + [9]))  # 13 tokens: the last one in block 3
    assert num_tokens == 12, "with 13 tokens only the block holding token 12 is recomputed: blocks 0-2 are hits"
    assert len(hits) == 3, "three hit blocks hold 12 tokens"


@pytest.mark.ex4_3
def test_lookup_changes_nothing():
    manager = make_manager(16, 4, "4.3", caching=True)
    first = request(1, SYSTEM + [1])
    admit(manager, first)
    manager.free(first)
    state = ([b.ref_cnt for b in manager.block_pool.blocks], free_ids(manager))
    for _ in range(2):
        manager.get_computed_blocks(request(2, SYSTEM + [5]))
    assert ([b.ref_cnt for b in manager.block_pool.blocks], free_ids(manager)) == state, (
        "get_computed_blocks only looks: no holder is added and no block leaves the free queue "
        "(allocate_slots takes the hits)"
    )


@pytest.mark.ex4_3
@pytest.mark.parametrize("seed", range(12))
def test_hits_under_a_shared_prefix_workload(seed):
    manager = make_manager(8 + 2 * (seed % 3), 4, "4.3", caching=True)
    requests = shared_prompt_workload(seed)
    world = ToyWorld(manager, max_running=4 + 4 * (seed % 2))
    for req in requests:
        world.add(req)
    world.run()
    check_outputs(world, requests)
    assert manager.prefix_cache_stats.hits > 0, "16 requests over 3 prompts should hit the prefix cache"


# ---- 4.4 eviction under load -----------------------------------------------------------------


@pytest.mark.ex4_4
@pytest.mark.parametrize("seed", range(20))
def test_eviction_under_tight_memory_generates_exactly(seed):
    manager = make_manager(8 + 2 * (seed % 3), 4, "4.4", caching=True)
    requests = shared_prompt_workload(seed, num_prompts=3 + seed % 3)
    world = ToyWorld(manager, max_running=4 + 4 * (seed % 2))
    for req in requests:
        world.add(req)
    world.run()
    check_outputs(world, requests)


# ---- 4.5 fork and copies: the bookkeeping -----------------------------------------------------


@pytest.mark.ex4_5
def test_take_pending_copies_hands_each_copy_out_once():
    manager = make_manager(8, 4, "4.5")
    parent, child = forked_pair(manager, 6)
    manager.allocate_slots(child, 1)
    first = manager.take_pending_copies()
    assert len(first) == 1, "the child's write into the shared block should report one copy"
    assert manager.take_pending_copies() == [], (
        "take_pending_copies must leave none pending: the executor would run the same copy again next step"
    )
    assert manager.pending_copies == [], "after take_pending_copies nothing is pending"
    manager.allocate_slots(parent, 1)
    assert manager.take_pending_copies() == [], "the parent's block is its own again after the child's copy"


@pytest.mark.ex4_5
def test_copies_are_reported_oldest_first():
    manager = make_manager(12, 4, "4.5")
    parent, child = forked_pair(manager, 6)
    table = manager.req_to_blocks[child.id]
    olds = [table[0].block_id, table[1].block_id]
    copies = manager._copy_on_write(table, [0, 1])
    assert [b.block_id for b in copies] == [table[0].block_id, table[1].block_id], (
        "the copies should come back in the order of the indices, each in its place in the table"
    )
    assert manager.take_pending_copies() == list(zip(olds, [b.block_id for b in copies])), (
        "pending copies are (src, dst) pairs, oldest first"
    )


@pytest.mark.ex4_5
def test_a_forked_child_publishes_only_its_own_blocks(offered):
    manager = make_manager(12, 4, "4.5", caching=True)
    calls = offered(manager)
    parent = request(1, SYSTEM + [1, 2])
    manager.allocate_slots(parent, parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    child = request(2, SYSTEM + [1, 2], num_computed_tokens=parent.num_tokens)
    manager.fork(parent, child)
    assert manager.num_cached_block[child.id] == manager.num_cached_block[parent.id], (
        "the child inherits the parent's publishing progress (num_cached_block)"
    )
    del calls[:]
    child.output_tokens += [8, 9]
    manager.allocate_slots(child, 2)
    assert calls == [manager.get_block_ids(child)[3]], (
        "after a fork the child offers only the block it fills itself: the shared blocks are already published"
    )


@pytest.mark.ex4_5
@pytest.mark.parametrize("seed", range(16))
def test_parallel_samples_generate_exactly(seed):
    manager = make_manager(10 + 2 * (seed % 3), 4, "4.5", caching=seed % 2 == 0)
    requests = shared_prompt_workload(seed, num_requests=10)
    world = ToyWorld(manager, max_running=6)
    for i, req in enumerate(requests):
        world.add(req, forks=1 + (i % 2) if i % 3 == 0 else 0)
    world.run()
    check_outputs(world, requests)
    assert world.children, "the workload forks parallel samples"


# ---- 4.6 which blocks are copied, under load ------------------------------------------------------


@pytest.mark.ex4_6
def test_can_allocate_after_a_fork_into_a_full_pool():
    manager = make_manager(2, 4, "4.6")
    parent, child = forked_pair(manager, 6)
    assert manager.can_allocate(child, 1) is False, (
        "the child's next token goes into a shared block, which needs a copy, and no block is free: "
        "can_allocate must say no (allocate_slots returns None)"
    )
    assert manager.allocate_slots(child, 1) is None, "no free block: the copy-on-write cannot happen"


@pytest.mark.ex4_6
def test_a_write_spanning_shared_blocks_copies_each_once():
    manager = make_manager(12, 4, "4.6")
    parent = request(1, list(range(10)))
    manager.allocate_slots(parent, 10)
    parent.num_computed_tokens = 6  # the last 4 tokens are recomputed: blocks 1 and 2 are written
    child = request(2, list(range(10)), num_computed_tokens=6)
    manager.fork(parent, child)
    assert manager._shared_blocks_to_write(child, 6, 10) == [1, 2], (
        "positions 6-9 fall in blocks 1 and 2, both shared: both need a copy, each once, in order"
    )
    assert manager._shared_blocks_to_write(child, 8, 9) == [2], "position 8 falls in block 2 only"


@pytest.mark.ex4_6
@pytest.mark.parametrize("seed", range(20))
def test_forks_preemption_and_prefix_caching_generate_exactly(seed):
    manager = make_manager(10 + 2 * (seed % 3), 4, "4.6", caching=True)
    requests = shared_prompt_workload(seed, num_requests=12)
    world = ToyWorld(manager, max_running=4 + 3 * (seed % 2))
    for i, req in enumerate(requests):
        world.add(req, forks=1 if i % 4 == 1 else 0)
    world.run()
    check_outputs(world, requests)


class WorldMachine(RuleBasedStateMachine):
    """Requests arrive, fork and step at random; the toy world reads every token back, outputs must be exact."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(10, 4, "4.6", caching=True)
        self.world = ToyWorld(self.manager, max_running=5)
        self.prompts = [[(37 * p + 11 * i) % 1000 for i in range(5 + 3 * p)] for p in range(3)]
        self.requests: list[Request] = []

    @rule(prompt=st.integers(0, 2), extra=st.integers(0, 3), new=st.integers(1, 6), forks=st.integers(0, 1))
    def arrive(self, prompt: int, extra: int, new: int, forks: int) -> None:
        req = Request(len(self.requests), self.prompts[prompt] + [500 + extra] * extra, max_new_tokens=new)
        self.requests.append(req)
        self.world.add(req, forks=forks)

    @precondition(lambda self: self.world.waiting or self.world.running)
    @rule()
    def step(self) -> None:
        self.world.step()

    def teardown(self) -> None:
        self.world.run()
        check_outputs(self.world, self.requests)
        assert self.manager.get_num_free_blocks() == self.manager.num_blocks, "every request ended: all blocks free"


TestWorldMachine = pytest.mark.ex4_6(WorldMachine.TestCase)
TestWorldMachine.settings = settings(max_examples=10, stateful_step_count=25, deadline=None, derandomize=True)


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [
        pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_")))
        for i in (
            "4.1",
            "4.2",
            "4.3",
            "4.4",
            "4.5",
            "4.6",
        )
    ],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)

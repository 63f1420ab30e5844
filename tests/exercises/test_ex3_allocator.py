"""Graded tests for notebook 03: the free-block queue, the block pool, allocate_slots and free.

Every pool and manager here is wrapped by `checked` (tests/exercises/invariants.py): after each call
the KV manager's invariants must hold, so a bug is caught by the call that makes it. Methods of later
exercises (prefix caching, copy-on-write) are the tests' own (`stand_ins`): these checks need only
notebook 03's code.
"""

import random
from collections import deque
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from invariants import assert_valid, checked
from toy_world import ToyWorld, check_outputs, shared_prompt_workload, stand_ins

from kvcourse.core.request import Request
from kvcourse.kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheBlocks, KVCacheManager

STRESS_SEEDS = range(24)


def make_manager(num_blocks: int, block_size: int, upto: str, caching: bool = False) -> KVCacheManager:
    """A manager running the learner's code up to exercise `upto` (the tests' own after it), checked after each call."""
    return checked(stand_ins(KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching), upto))


def make_pool(num_blocks: int, caching: bool = False) -> BlockPool:
    """A block pool whose invariants are checked after every call."""
    return checked(BlockPool(num_blocks, enable_caching=caching))


def make_blocks(n: int) -> list[KVCacheBlock]:
    """Fresh blocks with ids 0..n-1, outside any pool."""
    return [KVCacheBlock(block_id=i) for i in range(n)]


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    """The queue front to back, as ids (walks the next pointers)."""
    return [block.block_id for block in queue.get_all_free_blocks()]


def backwards_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    """Walk the prev pointers from the tail: catches a list whose two directions disagree."""
    ids, block = [], queue.fake_tail.prev_free_block
    while block is not queue.fake_head:
        ids.append(block.block_id)
        block = block.prev_free_block
    return ids[::-1]


def request(request_id: int, num_prompt_tokens: int) -> Request:
    """A request with a prompt of the given length."""
    return Request(request_id, list(range(100, 100 + num_prompt_tokens)), max_new_tokens=8)


# ---- 3.1 the free-block queue ------------------------------------------------------------


@pytest.mark.ex3_1
def test_popleft_takes_blocks_front_to_back():
    queue = FreeKVCacheBlockQueue(make_blocks(4))
    taken = [queue.popleft().block_id for _ in range(3)]
    assert taken == [0, 1, 2], "popleft should return the blocks in queue order, front first"
    assert queue.num_free_blocks == 1, "popleft should count each block it takes out of num_free_blocks"
    assert queue_ids(queue) == [3], "after popleft the taken blocks must no longer be in the queue"


@pytest.mark.ex3_1
def test_popleft_unlinks_the_block():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    block = queue.popleft()
    assert block.prev_free_block is None and block.next_free_block is None, (
        "a block taken out of the queue should have both pointers set to None"
    )
    assert queue.fake_head.next_free_block.block_id == 1, (
        "after popleft the head sentinel should point at the next block"
    )


@pytest.mark.ex3_1
def test_append_puts_a_block_at_the_back():
    queue = FreeKVCacheBlockQueue(make_blocks(3))
    first = queue.popleft()
    queue.append(first)
    assert queue_ids(queue) == [1, 2, 0], "append should put the block at the back of the queue"
    assert backwards_ids(queue) == [1, 2, 0], "append should also set the prev pointers (walking back disagrees)"
    assert queue.num_free_blocks == 3, "append should count the block in num_free_blocks"


@pytest.mark.ex3_1
def test_append_to_an_empty_queue():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    a, b = queue.popleft(), queue.popleft()
    queue.append(b)
    queue.append(a)
    assert queue_ids(queue) == [1, 0], "appending to an empty queue should work and keep the order of the appends"
    assert queue.popleft() is b, "the first block appended should be the first one popped"


@pytest.mark.ex3_1
def test_remove_from_the_middle():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue_ids(queue) == [0, 1, 3, 4], "remove should unlink exactly that block and keep the others in order"
    assert backwards_ids(queue) == [0, 1, 3, 4], "remove should rewire the prev pointers too"
    assert queue.num_free_blocks == 4, "remove should count the block out of num_free_blocks"
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None, (
        "a removed block should have both pointers set to None"
    )


@pytest.mark.ex3_1
def test_remove_the_first_and_last_blocks():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    assert queue_ids(queue) == [1, 2], "removing the first or the last block should work like any other"
    assert backwards_ids(queue) == [1, 2], "after removing the ends, walking backwards should agree"
    queue.append(blocks[0])
    assert queue_ids(queue) == [1, 2, 0], "a removed block can be appended again"


@pytest.mark.ex3_1
def test_queue_matches_a_simple_model():
    rng = random.Random(3)
    blocks = make_blocks(12)
    queue, model = FreeKVCacheBlockQueue(blocks), deque(range(12))
    outside: list[int] = []
    for _ in range(300):
        op = rng.choice(["popleft", "append", "remove"])
        if op == "popleft" and model:
            expected = model.popleft()
            assert queue.popleft().block_id == expected, "popleft returned a block out of order"
            outside.append(expected)
        elif op == "append" and outside:
            block_id = outside.pop(rng.randrange(len(outside)))
            queue.append(blocks[block_id])
            model.append(block_id)
        elif op == "remove" and model:
            block_id = rng.choice(list(model))
            queue.remove(blocks[block_id])
            model.remove(block_id)
        assert queue_ids(queue) == list(model), "after a mix of popleft/append/remove the queue order is wrong"
        assert queue.num_free_blocks == len(model), "num_free_blocks drifted from the number of blocks in the queue"
    assert backwards_ids(queue) == list(model), "the prev pointers disagree with the next pointers"


# ---- 3.2 the block pool ------------------------------------------------------------------


@pytest.mark.ex3_2
def test_get_new_blocks_takes_from_the_front():
    pool = make_pool(6)
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3], (
        "get_new_blocks should take blocks from the front of the free queue"
    )
    assert all(b.ref_cnt == 1 for b in blocks), "a newly handed-out block should have exactly one holder"
    assert pool.get_num_free_blocks() == 2, "the free count should drop by the number of blocks handed out"


@pytest.mark.ex3_2
def test_get_zero_blocks():
    pool = make_pool(3)
    assert pool.get_new_blocks(0) == [], "asking for no blocks should give an empty list"
    assert pool.get_num_free_blocks() == 3, "asking for no blocks should change nothing"


@pytest.mark.ex3_2
def test_free_blocks_returns_them_to_the_back():
    pool = make_pool(5)
    taken = pool.get_new_blocks(3)
    pool.free_blocks([taken[1], taken[0]])
    assert pool.get_num_free_blocks() == 4, "freed blocks should count as free again"
    assert taken[0].ref_cnt == 0 and taken[1].ref_cnt == 0, "a freed block should have no holder left"
    order = [b.block_id for b in pool.get_new_blocks(4)]
    assert order == [3, 4, 1, 0], "freed blocks should be reused last, in the order they were freed"


@pytest.mark.ex3_2
def test_a_block_with_another_holder_stays_out_of_the_queue():
    pool = make_pool(3)
    block = pool.get_new_blocks(1)[0]
    block.ref_cnt += 1  # a second request holds it too
    pool.free_blocks([block])
    assert block.ref_cnt == 1, "free_blocks should take away exactly one holder"
    assert pool.get_num_free_blocks() == 2, "a block that someone still holds must not go back to the free queue"
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3, "when the last holder frees it, the block should be free again"


@pytest.mark.ex3_2
def test_free_blocks_accepts_any_iterable():
    pool = make_pool(4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4, "free_blocks should accept any iterable, such as reversed(...)"


@pytest.mark.ex3_2
def test_every_handed_out_block_goes_through_eviction(monkeypatch):
    pool = make_pool(4, caching=True)
    seen = []
    monkeypatch.setattr(pool, "_maybe_evict_cached_block", lambda block: seen.append(block.block_id))
    blocks = pool.get_new_blocks(3)
    assert seen == [b.block_id for b in blocks], (
        "every block get_new_blocks hands out must go through _maybe_evict_cached_block: a cached free block "
        "still carries its old hash, and a lookup would serve its new contents as the old prefix"
    )


@pytest.mark.ex3_2
def test_touch_adds_a_holder():
    pool = make_pool(4, caching=True)
    held = pool.get_new_blocks(1)[0]
    pool.touch([held])
    assert held.ref_cnt == 2, "touch should add one holder to a block already in use"
    assert pool.get_num_free_blocks() == 3, "touching a block in use should not change the free count"


@pytest.mark.ex3_2
def test_touch_revives_a_free_block():
    pool = make_pool(4, caching=True)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a, b])
    pool.touch([a])
    assert a.ref_cnt == 1, "touching a free block should give it one holder"
    assert pool.get_num_free_blocks() == 3, "touching a free block should take it out of the free queue"
    assert a not in pool.free_block_queue.get_all_free_blocks(), "a touched block must not stay in the free queue"
    assert a not in pool.get_new_blocks(3), "a touched block must never be handed out to someone else"


@pytest.mark.ex3_2
def test_usage_follows_the_pool():
    pool = make_pool(8)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.25), "usage should be the share of blocks handed out"
    pool.free_blocks(blocks)
    assert pool.usage == 0.0, "usage should be back to zero once everything is freed"


# ---- 3.3 allocate_slots ------------------------------------------------------------------


@pytest.mark.ex3_3
def test_prompt_gets_ceil_blocks():
    manager = make_manager(10, 4, "3.3")
    req = request(1, 10)
    new = manager.allocate_slots(req, 10)
    assert new is not None, "allocate_slots should succeed when enough blocks are free"
    assert len(manager.get_block_ids(req)) == 3, (
        "a prompt got the wrong number of blocks: ceil(tokens / block_size), a partial block counts"
    )
    assert new.get_block_ids() == manager.get_block_ids(req), "a first allocation should return all the new blocks"
    assert manager.get_num_free_blocks() == 7, "the free count should drop by the blocks handed out"


@pytest.mark.ex3_3
def test_decode_steps_fill_the_last_block_first():
    manager = make_manager(10, 4, "3.3")
    req = request(1, 10)
    manager.allocate_slots(req, 10)
    req.num_computed_tokens = 10
    counts = []
    for _ in range(5):  # tokens 11..15
        new = manager.allocate_slots(req, 1)
        assert new is not None, "a decode step should succeed while blocks are free"
        counts.append(len(new))
        req.num_computed_tokens += 1
    assert counts == [0, 0, 1, 0, 0], "a decode step should take a new block only when the last one is full"
    assert len(manager.get_block_ids(req)) == 4, "after the decode steps the table has the wrong number of blocks"


@pytest.mark.ex3_3
def test_already_covered_step_returns_empty_not_none():
    manager = make_manager(4, 4, "3.3")
    req = request(1, 3)
    manager.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    new = manager.allocate_slots(req, 1)
    assert new is not None, "a step that needs no new block should succeed (an empty result, not None)"
    assert len(new) == 0, "a step that needs no new block should return no new blocks"
    ahead = request(2, 8)
    manager.allocate_slots(ahead, 8)  # room for 8 tokens, none computed yet
    again = manager.allocate_slots(ahead, 4)
    assert again is not None and len(again) == 0, (
        "a table that already covers more than the tokens asked for needs no new block: 0, never fewer"
    )
    assert len(manager.get_block_ids(ahead)) == 2, "a step that needs no block must leave the table as it was"


@pytest.mark.ex3_3
def test_computed_tokens_count_towards_the_table():
    manager = make_manager(10, 4, "3.3")
    req = request(1, 20)
    manager.allocate_slots(req, 6, num_new_computed_tokens=6)
    assert len(manager.get_block_ids(req)) == 3, "the table must cover num_new_computed_tokens + num_new_tokens"
    req.num_computed_tokens = 12
    manager.allocate_slots(req, 5)
    assert len(manager.get_block_ids(req)) == 5, "the table must cover num_computed_tokens + num_new_tokens"


@pytest.mark.ex3_3
def test_all_or_nothing_when_short():
    manager = make_manager(4, 4, "3.3")
    first, second = request(1, 12), request(2, 8)
    manager.allocate_slots(first, 12)
    before = manager.get_block_ids(first)
    assert manager.allocate_slots(second, 8) is None, "allocate_slots should fail when too few blocks are free"
    assert manager.get_num_free_blocks() == 1, "a failed allocation must not take any block"
    assert second.id not in manager.req_to_blocks, "a failed allocation must not give the request a table"
    assert manager.get_block_ids(first) == before, "a failed allocation must not touch other requests"
    assert manager.allocate_slots(second, 4) is not None, "an allocation that exactly fits should succeed"
    assert manager.get_num_free_blocks() == 0, "an exact fit should use the last free block"


@pytest.mark.ex3_3
def test_failed_decode_keeps_the_table():
    manager = make_manager(2, 2, "3.3")
    req = request(1, 4)
    manager.allocate_slots(req, 4)
    req.num_computed_tokens = 4
    before = manager.get_block_ids(req)
    assert manager.allocate_slots(req, 1) is None, "a decode that needs a block when none is free should fail"
    assert manager.get_block_ids(req) == before, "a failed decode must leave the request's table as it was"


@pytest.mark.ex3_3
def test_can_allocate_agrees_with_allocate_slots():
    rng = random.Random(7)
    manager = make_manager(12, 3, "3.3")
    reqs = [request(i, rng.randint(1, 10)) for i in range(6)]
    for _ in range(60):
        req = rng.choice(reqs)
        n = rng.randint(0, 7)
        expected = manager.can_allocate(req, n)
        got = manager.allocate_slots(req, n)
        assert (got is not None) == expected, "can_allocate should say exactly whether allocate_slots succeeds"
        if got is not None:
            req.num_computed_tokens += n
        held = len(manager.get_block_ids(req))
        assert held == -(-req.num_computed_tokens // 3), "a table should hold ceil(computed tokens / block_size) blocks"


def freed_blocks(manager: KVCacheManager, num_blocks: int) -> list[KVCacheBlock]:
    """Blocks a finished request left behind: free (ref_cnt 0), usable as prefix hits."""
    blocks = manager.block_pool.get_new_blocks(num_blocks)
    manager.block_pool.free_blocks(reversed(blocks))  # as free() does: tail first
    return blocks


def pool_state(manager: KVCacheManager) -> tuple:
    """Everything a failed allocation must leave alone."""
    pool = manager.block_pool
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [b.ref_cnt for b in pool.blocks],
        {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
    )


@pytest.mark.ex3_3
def test_hits_on_free_blocks_share_them():
    manager = make_manager(6, 4, "3.3")
    hits = freed_blocks(manager, 2)
    req = request(1, 12)
    new = manager.allocate_slots(req, 4, num_new_computed_tokens=8, new_computed_blocks=KVCacheBlocks(hits))
    assert new is not None, "an admission with prefix hits should succeed while enough blocks are free"
    table = manager.get_block_ids(req)
    assert table[:2] == [b.block_id for b in hits], "the table should start with the hit blocks, in order"
    assert len(table) == 3, "hits cover their tokens: only the rest needs new blocks"
    assert new.get_block_ids() == table[2:], "allocate_slots should return only the blocks it took new"
    assert all(b.ref_cnt == 1 for b in hits), "each hit block should gain one holder"
    assert manager.get_num_free_blocks() == 3, "hits on free blocks leave the free queue, like the new blocks"


@pytest.mark.ex3_3
def test_hits_on_free_blocks_count_against_the_limit():
    manager = make_manager(4, 4, "3.3")
    hits = freed_blocks(manager, 2)
    manager.allocate_slots(request(2, 4), 4)  # one block held: 3 free, two of them the hits
    req = request(1, 16)
    before = pool_state(manager)
    got = manager.allocate_slots(req, 8, num_new_computed_tokens=8, new_computed_blocks=KVCacheBlocks(hits))
    assert got is None, (
        "2 hits on free blocks + 2 new blocks need 4 free blocks but only 3 are free: a hit on a FREE block "
        "uses up a free block too, so allocate_slots must return None"
    )
    assert pool_state(manager) == before, (
        "a failed allocate_slots must touch nothing: no ref count, no free-queue position, no table"
    )
    assert manager.get_block_ids(req) == [] and req.id not in manager.req_to_blocks, (
        "a failed admission must not leave a table behind (not even an empty one)"
    )
    assert manager.allocate_slots(req, 4, num_new_computed_tokens=8, new_computed_blocks=KVCacheBlocks(hits)), (
        "with one new block instead of two the admission fits exactly and should succeed"
    )
    assert manager.get_num_free_blocks() == 0, "an exact fit should use every free block"


@pytest.mark.ex3_3
def test_usage_after_allocation():
    manager = make_manager(10, 2, "3.3")
    manager.allocate_slots(request(1, 5), 5)
    assert manager.usage == pytest.approx(0.3), "usage should be the share of blocks held"


# ---- 3.4 free ----------------------------------------------------------------------------


@pytest.mark.ex3_4
def test_free_gives_every_block_back():
    manager = make_manager(8, 4, "3.4")
    req = request(1, 13)
    manager.allocate_slots(req, 13)
    manager.free(req)
    assert manager.get_num_free_blocks() == 8, "free should give back every block of the request"
    assert req.id not in manager.req_to_blocks, (
        "after free the manager should hold no table for it (not even an empty one)"
    )


@pytest.mark.ex3_4
def test_free_returns_the_tail_first():
    manager = make_manager(4, 2, "3.4")
    req = request(1, 8)
    manager.allocate_slots(req, 8)
    table = manager.get_block_ids(req)
    manager.free(req)
    free_order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order == table[::-1], "free should give the blocks back in reverse order, tail first"


@pytest.mark.ex3_4
def test_free_unknown_or_twice_is_harmless():
    manager = make_manager(4, 2, "3.4")
    req, other = request(1, 3), request(2, 3)
    manager.allocate_slots(req, 3)
    manager.allocate_slots(other, 3)
    manager.free(req)
    manager.free(req)
    manager.free(request(99, 1))
    assert manager.get_num_free_blocks() == 2, "freeing a request twice, or one never seen, must change nothing"
    assert len(manager.get_block_ids(other)) == 2, "freeing one request must not touch another one"


@pytest.mark.ex3_4
def test_preempted_request_starts_again():
    manager = make_manager(4, 2, "3.4")
    req = request(1, 5)
    manager.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    manager.free(req)
    req.num_computed_tokens = 0
    assert manager.allocate_slots(req, 5) is not None, "a freed request should be able to allocate again from scratch"
    assert len(manager.get_block_ids(req)) == 3, "after a free, a new allocation should start from an empty table"


# ---- 3.1 O(1): pointer reads counted -------------------------------------------------------


class CountingBlock(KVCacheBlock):
    """A block that counts every read of its queue pointers: a walk through the queue cannot hide."""

    reads: ClassVar[list[int]] = [0]

    def __getattribute__(self, name: str):
        if name in ("prev_free_block", "next_free_block"):
            CountingBlock.reads[0] += 1
        return object.__getattribute__(self, name)


def pointer_reads(operation) -> int:
    """How many queue pointers of real blocks `operation()` reads."""
    CountingBlock.reads[0] = 0
    operation()
    return CountingBlock.reads[0]


@pytest.mark.ex3_1
@pytest.mark.parametrize("operation", ["popleft", "append", "remove"])
def test_queue_operations_do_not_walk_the_queue(operation):
    blocks = [CountingBlock(block_id=i) for i in range(3000)]
    queue = FreeKVCacheBlockQueue(blocks)
    taken = [queue.popleft() for _ in range(3)]
    calls = {
        "popleft": queue.popleft,
        "append": lambda: queue.append(taken[0]),
        "remove": lambda: queue.remove(blocks[1500]),
    }
    reads = pointer_reads(calls[operation])
    assert reads <= 16, (
        f"{operation} read {reads} block pointers in a queue of about 3,000 blocks: it walks the list. It must "
        "be O(1): reach the ends through the sentinels (fake_head, fake_tail) and a block's neighbours through "
        "its own prev/next"
    )
    assert queue_ids(queue) == backwards_ids(queue), f"after {operation} the two directions of the queue disagree"


@pytest.mark.ex3_1
def test_counting_the_queue_is_o1():
    blocks = [CountingBlock(block_id=i) for i in range(2000)]
    queue = FreeKVCacheBlockQueue(blocks)
    reads = pointer_reads(lambda: (len(queue), queue.num_free_blocks))
    assert reads == 0, "len(queue) should read the counter, not walk the queue"
    queue.remove(blocks[7])
    queue.append(blocks[7])
    assert queue.num_free_blocks == 2000 and len(queue_ids(queue)) == 2000, "remove + append changed the count"


# ---- 3.2 the pool under load (the tests' own manager on top of your pool) -------------------


@pytest.mark.ex3_2
def test_touch_then_free_keeps_lru_order():
    pool = make_pool(6, caching=True)
    blocks = pool.get_new_blocks(6)
    pool.free_blocks(blocks)
    pool.touch([blocks[2], blocks[4]])
    assert queue_ids(pool.free_block_queue) == [0, 1, 3, 5], "touch must unlink exactly the touched free blocks"
    pool.free_blocks([blocks[4], blocks[2]])
    assert queue_ids(pool.free_block_queue) == [0, 1, 3, 5, 4, 2], (
        "a block whose last holder leaves joins the BACK of the free queue, in the order given"
    )
    assert pool.get_new_blocks(2) == [blocks[0], blocks[1]], "get_new_blocks should take the front of the queue"


@pytest.mark.ex3_2
def test_touch_twice_in_one_call_holds_twice():
    pool = make_pool(3)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 2, "each touch adds one holder"
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 2, "a block with a holder left stays out of the free queue"
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3, "the last holder's free puts it back"


@pytest.mark.ex3_2
@pytest.mark.parametrize("seed", STRESS_SEEDS)
def test_pool_under_a_shared_prefix_workload(seed):
    manager = make_manager(8 + 2 * (seed % 3), 4, "3.2", caching=True)
    requests = shared_prompt_workload(seed)
    world = ToyWorld(manager, max_running=4 + 4 * (seed % 2))
    for request in requests:
        world.add(request)
    world.run()
    check_outputs(world, requests)
    assert manager.get_num_free_blocks() == manager.num_blocks, "when every request has ended, every block is free"


# ---- 3.3 allocate_slots: order, accounting, failure paths -------------------------------------


def free_in_front(manager: KVCacheManager, num_hits: int) -> list[KVCacheBlock]:
    """Freed blocks at the FRONT of the free queue (the next ones get_new_blocks would hand out)."""
    blocks = manager.block_pool.get_new_blocks(manager.num_blocks)
    manager.block_pool.free_blocks(blocks)
    return blocks[:num_hits]


@pytest.mark.ex3_3
def test_a_free_hit_at_the_front_of_the_queue_is_not_handed_out_again():
    manager = make_manager(6, 4, "3.3")
    hits = free_in_front(manager, 2)
    req = request(1, 12)
    new = manager.allocate_slots(req, 4, num_new_computed_tokens=8, new_computed_blocks=KVCacheBlocks(hits))
    assert new is not None, "the admission fits and should succeed"
    table = manager.get_block_ids(req)
    assert len(set(table)) == len(table) == 3, (
        "the table holds a block twice: a hit on a FREE block is still in the free queue until it is touched, "
        "so it must be taken out (touched) before any new block is taken from the pool"
    )
    assert table[:2] == [b.block_id for b in hits], "the table should start with the hits"


@pytest.mark.ex3_3
def test_an_admission_is_counted_once(monkeypatch):
    manager = make_manager(10, 4, "3.3")
    counted = []
    monkeypatch.setattr(manager, "_record_admission", lambda req, hit_tokens: counted.append((req.id, hit_tokens)))
    req = request(1, 6)
    manager.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    for _ in range(4):
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert counted == [(1, 0)], (
        "_record_admission must be called once per admission (the request's first allocation), not on "
        "every allocate_slots: decodes are not admissions"
    )
    manager.free(req)
    req.num_computed_tokens = 0
    hits = free_in_front(manager, 1)
    other = request(2, 6)
    manager.allocate_slots(other, 2, num_new_computed_tokens=4, new_computed_blocks=KVCacheBlocks(hits))
    assert counted[-1] == (2, 4), "an admission with prefix hits is counted with the tokens the hits hold"
    manager.allocate_slots(request(3, 6), 2, num_new_computed_tokens=4)
    assert counted[-1] == (3, 0), "an admission without prefix hits is counted with 0 hit tokens"


@pytest.mark.ex3_3
def test_hits_on_held_blocks_use_up_no_free_block():
    manager = make_manager(4, 4, "3.3")
    first = request(1, 8)
    manager.allocate_slots(first, 8)  # blocks 0 and 1, held: 2 free
    hits = manager.get_blocks(first).blocks
    second = request(2, 16)
    got = manager.allocate_slots(second, 8, num_new_computed_tokens=8, new_computed_blocks=KVCacheBlocks(hits))
    assert got is not None, (
        "2 hits on HELD blocks + 2 new blocks need only the 2 free blocks: a hit on a block someone holds "
        "takes nothing from the free queue, so this admission fits exactly"
    )
    assert manager.get_num_free_blocks() == 0, "an exact fit should use every free block"


@pytest.mark.ex3_3
def test_a_failed_admission_is_not_counted(monkeypatch):
    manager = make_manager(2, 4, "3.3")
    counted = []
    monkeypatch.setattr(manager, "_record_admission", lambda req, hit_tokens: counted.append(req.id))
    assert manager.allocate_slots(request(1, 12), 12) is None, "12 tokens do not fit 2 blocks of 4"
    assert counted == [], "an allocation that returns None changes nothing: no admission is counted"


def shared_child(manager: KVCacheManager, num_tokens: int) -> tuple[Request, Request]:
    """A parent and a child sharing every block (as a fork leaves them), without needing notebook 04."""
    parent = request(1, num_tokens)
    manager.allocate_slots(parent, num_tokens)
    parent.num_computed_tokens = num_tokens
    child = request(2, num_tokens)
    child.prompt_tokens = list(parent.prompt_tokens)
    child.num_computed_tokens = num_tokens
    manager.fork(parent, child)
    return parent, child


@pytest.mark.ex3_3
def test_can_allocate_counts_the_copy_a_shared_block_needs():
    manager = make_manager(4, 4, "3.3")
    parent, child = shared_child(manager, 6)  # 2 shared blocks, the second one partly filled
    manager.allocate_slots(request(3, 8), 8)  # the last 2 free blocks
    assert manager.get_num_free_blocks() == 0, "setup: the pool is full"
    assert manager.can_allocate(child, 1) is False, (
        "can_allocate says yes, but writing the child's next token into its shared last block needs a private "
        "copy, and no block is free: it must agree with allocate_slots, copy-on-write included"
    )
    assert manager.allocate_slots(child, 1) is None, "with no free block the copy-on-write cannot happen"
    assert manager.take_pending_copies() == [], "a failed allocation must not leave a pending copy"


@pytest.mark.ex3_3
def test_can_allocate_changes_nothing():
    manager = make_manager(6, 4, "3.3")
    parent, child = shared_child(manager, 6)
    before = pool_state(manager)
    for n in (0, 1, 3, 9, 40):
        manager.can_allocate(child, n)
        manager.can_allocate(request(5, 3), n)
    assert pool_state(manager) == before and 5 not in manager.req_to_blocks, "can_allocate must change nothing"
    assert manager.take_pending_copies() == [], "can_allocate must not report copies"


@pytest.mark.ex3_3
def test_a_write_into_a_shared_block_returns_the_copy_and_the_new_blocks():
    manager = make_manager(10, 4, "3.3")
    parent, child = shared_child(manager, 6)
    new = manager.allocate_slots(child, 4)  # positions 6..9: the shared block 1, then one new block
    assert new is not None, "there is room for the copy and the new block"
    table = manager.get_block_ids(child)
    assert len(table) == 3 and table[0] == manager.get_block_ids(parent)[0], (
        "the child keeps sharing the block it does not write"
    )
    assert new.get_block_ids() == table[1:], (
        "allocate_slots should return the copy first, then the new blocks (every block this step took)"
    )
    assert manager.take_pending_copies() == [(manager.get_block_ids(parent)[1], table[1])], (
        "the copy of the shared block should be pending as (src, dst)"
    )


@pytest.mark.ex3_3
def test_a_failed_write_into_a_shared_block_changes_nothing():
    manager = make_manager(4, 4, "3.3")
    parent, child = shared_child(manager, 6)  # 2 shared, 2 free
    before = pool_state(manager)
    assert manager.allocate_slots(child, 7) is None, "a copy plus two new blocks do not fit 2 free blocks"
    assert pool_state(manager) == before, "a failed allocate_slots must touch nothing (no copy half made)"
    assert manager.take_pending_copies() == [], "a failed allocation must not report a copy"
    assert manager.allocate_slots(child, 6) is not None, "a copy plus one new block fit exactly"


@pytest.mark.ex3_3
def test_prompt_blocks_are_offered_to_the_prefix_cache_at_admission():
    manager = make_manager(12, 4, "3.3", caching=True)
    req = request(1, 10)
    manager.allocate_slots(req, 10)
    again = request(2, 10)
    hits, num_tokens = manager.get_computed_blocks(again)
    assert num_tokens == 8, (
        "allocate_slots should offer the full blocks it covers to the prefix cache (self._cache_full_blocks, "
        "with the whole table)"
    )
    assert hits.get_block_ids() == manager.get_block_ids(req)[:2], "the published blocks are the request's own"


@pytest.mark.ex3_3
@pytest.mark.parametrize("seed", STRESS_SEEDS)
def test_shared_prompts_under_tight_memory_generate_exactly(seed):
    manager = make_manager(8 + 2 * (seed % 3), 4, "3.3", caching=True)
    requests = shared_prompt_workload(seed)  # 16 requests sharing 3 prompts
    world = ToyWorld(manager, max_running=4 + 4 * (seed % 2))
    for request_ in requests:
        world.add(request_)
    world.run()
    check_outputs(world, requests)
    stats = manager.prefix_cache_stats
    assert stats.requests == world.admissions, (
        "the prefix-cache stats count a different number of admissions than took place: record an admission "
        "once, when the request gets its first blocks"
    )


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model that only counts tokens and blocks."""

    upto = "3.3"  # the exercise whose code is under test (free is the tests' own before 3.4)

    def __init__(self) -> None:
        super().__init__()
        self.block_size, self.num_blocks = 3, 10
        self.manager = make_manager(self.num_blocks, self.block_size, self.upto)
        self.computed: dict[int, int] = {}  # the model: request id -> tokens its table covers
        self.requests: dict[int, Request] = {}

    def model_free(self) -> int:
        return self.num_blocks - sum(-(-n // self.block_size) for n in self.computed.values())

    @rule(request_id=st.integers(0, 4), num_tokens=st.integers(0, 11))
    def allocate(self, request_id: int, num_tokens: int) -> None:
        req = self.requests.setdefault(request_id, request(request_id, 12))
        covered = self.computed.get(request_id, 0)
        held = -(-covered // self.block_size)
        needed = max(0, -(-(covered + num_tokens) // self.block_size) - held)
        fits = needed <= self.model_free()
        assert self.manager.can_allocate(req, num_tokens) is fits, "can_allocate disagrees with the free blocks"
        got = self.manager.allocate_slots(req, num_tokens)
        assert (got is not None) is fits, "allocate_slots should succeed exactly when enough blocks are free"
        if got is not None:
            assert len(got) == needed, "allocate_slots returned a different number of new blocks than it needed"
            self.computed[request_id] = covered + num_tokens
            req.num_computed_tokens += num_tokens

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests.pop(request_id)
        table = self.manager.get_block_ids(req)
        self.manager.free(req)
        self.computed.pop(request_id, None)
        tail = [b.block_id for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()][-len(table) :]
        assert not table or tail == table[::-1], "free should put the request's blocks at the back, tail first"

    @invariant()
    def tables_match_the_model(self) -> None:
        assert_valid(self.manager._target, "the last call")
        for request_id, req in self.requests.items():
            covered = self.computed.get(request_id, 0)
            assert len(self.manager.get_block_ids(req)) == -(-covered // self.block_size), (
                "a table should hold exactly ceil(tokens / block_size) blocks, no block to spare"
            )
        assert self.manager.get_num_free_blocks() == self.model_free(), "the free count drifted from the model"


class FreeMachine(AllocatorMachine):
    """The same, with the learner's free (exercise 3.4)."""

    upto = "3.4"


MACHINE_SETTINGS = settings(max_examples=30, stateful_step_count=25, deadline=None, derandomize=True)
TestAllocatorMachine = pytest.mark.ex3_3(AllocatorMachine.TestCase)
TestAllocatorMachine.settings = MACHINE_SETTINGS
TestFreeMachine = pytest.mark.ex3_4(FreeMachine.TestCase)
TestFreeMachine.settings = MACHINE_SETTINGS


# ---- 3.4 free: what is left behind ---------------------------------------------------------


@pytest.mark.ex3_4
def test_free_of_a_shared_block_keeps_it_for_the_other_holder():
    manager = make_manager(6, 4, "3.4")
    parent, child = shared_child(manager, 8)
    manager.free(child)
    assert child.id not in manager.req_to_blocks, "after free the child has no table"
    assert all(b.ref_cnt == 1 for b in manager.get_blocks(parent).blocks), (
        "freeing one holder of a shared block must leave it held by the other"
    )
    assert manager.get_num_free_blocks() == 4, "a block the parent still holds must not be free"


@pytest.mark.ex3_4
def test_a_freed_request_shares_nothing_with_its_old_table():
    manager = make_manager(6, 4, "3.4")
    req = request(1, 8)
    manager.allocate_slots(req, 8)
    table = manager.get_block_ids(req)
    manager.free(req)
    req.num_computed_tokens = 0
    manager.allocate_slots(req, 4)
    assert len(manager.get_block_ids(req)) == 1, "a new allocation after free starts from an empty table"
    assert manager.get_block_ids(req)[0] not in table[1:], "after free the tail block is reused last, not first"
    assert manager.get_num_free_blocks() == 5, "after free and one new block, five blocks should be free"


@pytest.mark.ex3_4
@pytest.mark.parametrize("seed", STRESS_SEEDS[:12])
def test_preemption_and_sharing_leave_nothing_behind(seed):
    manager = make_manager(8 + 2 * (seed % 3), 4, "3.4", caching=True)
    requests = shared_prompt_workload(seed)
    world = ToyWorld(manager, max_running=8)
    for request_ in requests:
        world.add(request_)
    world.run()
    check_outputs(world, requests)
    assert not manager.req_to_blocks, "every request ended: the manager should hold no table"
    assert manager.get_num_free_blocks() == manager.num_blocks, "every request ended: every block should be free"


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [
        pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_")))
        for i in (
            "3.1",
            "3.2",
            "3.3",
            "3.4",
        )
    ],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)

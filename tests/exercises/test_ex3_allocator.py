"""Graded tests for notebook 03: the free-block queue, the block pool, allocate_slots and free."""

import random
from collections import deque

import pytest

from kvcourse.kv_cache import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheBlocks, KVCacheManager
from kvcourse.request import Request


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
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3], (
        "get_new_blocks should take blocks from the front of the free queue"
    )
    assert all(b.ref_cnt == 1 for b in blocks), "a newly handed-out block should have exactly one holder"
    assert pool.get_num_free_blocks() == 2, "the free count should drop by the number of blocks handed out"


@pytest.mark.ex3_2
def test_get_zero_blocks():
    pool = BlockPool(3)
    assert pool.get_new_blocks(0) == [], "asking for no blocks should give an empty list"
    assert pool.get_num_free_blocks() == 3, "asking for no blocks should change nothing"


@pytest.mark.ex3_2
def test_free_blocks_returns_them_to_the_back():
    pool = BlockPool(5)
    taken = pool.get_new_blocks(3)
    pool.free_blocks([taken[1], taken[0]])
    assert pool.get_num_free_blocks() == 4, "freed blocks should count as free again"
    assert taken[0].ref_cnt == 0 and taken[1].ref_cnt == 0, "a freed block should have no holder left"
    order = [b.block_id for b in pool.get_new_blocks(4)]
    assert order == [3, 4, 1, 0], "freed blocks should be reused last, in the order they were freed"


@pytest.mark.ex3_2
def test_a_block_with_another_holder_stays_out_of_the_queue():
    pool = BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    block.ref_cnt += 1  # a second request holds it too
    pool.free_blocks([block])
    assert block.ref_cnt == 1, "free_blocks should take away exactly one holder"
    assert pool.get_num_free_blocks() == 2, "a block that someone still holds must not go back to the free queue"
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 3, "when the last holder frees it, the block should be free again"


@pytest.mark.ex3_2
def test_free_blocks_accepts_any_iterable():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 4, "free_blocks should accept any iterable, such as reversed(...)"


@pytest.mark.ex3_2
def test_every_handed_out_block_goes_through_eviction(monkeypatch):
    pool = BlockPool(4, enable_caching=True)
    seen = []
    monkeypatch.setattr(pool, "_maybe_evict_cached_block", lambda block: seen.append((block.block_id, block.ref_cnt)))
    blocks = pool.get_new_blocks(3)
    assert [block_id for block_id, _ in seen] == [b.block_id for b in blocks], (
        "every block get_new_blocks hands out must go through _maybe_evict_cached_block: a cached free block "
        "still carries its old hash, and a lookup would serve its new contents as the old prefix"
    )
    assert all(ref_cnt == 0 for _, ref_cnt in seen), (
        "evict a block's old hash before it gets its new holder (while nobody holds it)"
    )


@pytest.mark.ex3_2
def test_touch_adds_a_holder():
    pool = BlockPool(4, enable_caching=True)
    held = pool.get_new_blocks(1)[0]
    pool.touch([held])
    assert held.ref_cnt == 2, "touch should add one holder to a block already in use"
    assert pool.get_num_free_blocks() == 3, "touching a block in use should not change the free count"


@pytest.mark.ex3_2
def test_touch_revives_a_free_block():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a, b])
    pool.touch([a])
    assert a.ref_cnt == 1, "touching a free block should give it one holder"
    assert pool.get_num_free_blocks() == 3, "touching a free block should take it out of the free queue"
    assert a not in pool.free_block_queue.get_all_free_blocks(), "a touched block must not stay in the free queue"
    assert a not in pool.get_new_blocks(3), "a touched block must never be handed out to someone else"


@pytest.mark.ex3_2
def test_usage_follows_the_pool():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.25), "usage should be the share of blocks handed out"
    pool.free_blocks(blocks)
    assert pool.usage == 0.0, "usage should be back to zero once everything is freed"


# ---- 3.3 allocate_slots ------------------------------------------------------------------


@pytest.mark.ex3_3
def test_prompt_gets_ceil_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=4)
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
    manager = KVCacheManager(num_blocks=10, block_size=4)
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
    manager = KVCacheManager(num_blocks=4, block_size=4)
    req = request(1, 3)
    manager.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    new = manager.allocate_slots(req, 1)
    assert new is not None, "a step that needs no new block should succeed (an empty result, not None)"
    assert len(new) == 0, "a step that needs no new block should return no new blocks"


@pytest.mark.ex3_3
def test_computed_tokens_count_towards_the_table():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    req = request(1, 20)
    manager.allocate_slots(req, 6, num_new_computed_tokens=6)
    assert len(manager.get_block_ids(req)) == 3, "the table must cover num_new_computed_tokens + num_new_tokens"
    req.num_computed_tokens = 12
    manager.allocate_slots(req, 5)
    assert len(manager.get_block_ids(req)) == 5, "the table must cover num_computed_tokens + num_new_tokens"


@pytest.mark.ex3_3
def test_all_or_nothing_when_short():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    first, second = request(1, 12), request(2, 8)
    manager.allocate_slots(first, 12)
    before = manager.get_block_ids(first)
    assert manager.allocate_slots(second, 8) is None, "allocate_slots should fail when too few blocks are free"
    assert manager.get_num_free_blocks() == 1, "a failed allocation must not take any block"
    assert manager.get_block_ids(second) == [], "a failed allocation must not give the request a table"
    assert manager.get_block_ids(first) == before, "a failed allocation must not touch other requests"
    assert manager.allocate_slots(second, 4) is not None, "an allocation that exactly fits should succeed"
    assert manager.get_num_free_blocks() == 0, "an exact fit should use the last free block"


@pytest.mark.ex3_3
def test_failed_decode_keeps_the_table():
    manager = KVCacheManager(num_blocks=2, block_size=2)
    req = request(1, 4)
    manager.allocate_slots(req, 4)
    req.num_computed_tokens = 4
    before = manager.get_block_ids(req)
    assert manager.allocate_slots(req, 1) is None, "a decode that needs a block when none is free should fail"
    assert manager.get_block_ids(req) == before, "a failed decode must leave the request's table as it was"


@pytest.mark.ex3_3
def test_can_allocate_agrees_with_allocate_slots():
    rng = random.Random(7)
    manager = KVCacheManager(num_blocks=12, block_size=3)
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
    manager = KVCacheManager(num_blocks=6, block_size=4)
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
    manager = KVCacheManager(num_blocks=4, block_size=4)
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
    assert manager.get_block_ids(req) == [], "a failed admission must not leave a table behind"
    assert manager.allocate_slots(req, 4, num_new_computed_tokens=8, new_computed_blocks=KVCacheBlocks(hits)), (
        "with one new block instead of two the admission fits exactly and should succeed"
    )
    assert manager.get_num_free_blocks() == 0, "an exact fit should use every free block"


@pytest.mark.ex3_3
def test_usage_after_allocation():
    manager = KVCacheManager(num_blocks=10, block_size=2)
    manager.allocate_slots(request(1, 5), 5)
    assert manager.usage == pytest.approx(0.3), "usage should be the share of blocks held"


# ---- 3.4 free ----------------------------------------------------------------------------


@pytest.mark.ex3_4
def test_free_gives_every_block_back():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    req = request(1, 13)
    manager.allocate_slots(req, 13)
    manager.free(req)
    assert manager.get_num_free_blocks() == 8, "free should give back every block of the request"
    assert manager.get_block_ids(req) == [], "after free the request should have no table"


@pytest.mark.ex3_4
def test_free_returns_the_tail_first():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    req = request(1, 8)
    manager.allocate_slots(req, 8)
    table = manager.get_block_ids(req)
    manager.free(req)
    free_order = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order == table[::-1], "free should give the blocks back in reverse order, tail first"


@pytest.mark.ex3_4
def test_free_unknown_or_twice_is_harmless():
    manager = KVCacheManager(num_blocks=4, block_size=2)
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
    manager = KVCacheManager(num_blocks=4, block_size=2)
    req = request(1, 5)
    manager.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    manager.free(req)
    req.num_computed_tokens = 0
    assert manager.allocate_slots(req, 5) is not None, "a freed request should be able to allocate again from scratch"
    assert len(manager.get_block_ids(req)) == 3, "after a free, a new allocation should start from an empty table"

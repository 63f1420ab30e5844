"""Graded tests for Exercise 4.7: eviction policies (the ranked pool's victim, FIFO and LFU keys)."""

import random

import pytest

from kvcourse.eviction import FIFOBlockPool, LFUBlockPool, LRUBlockPool, RankedBlockPool
from kvcourse.kv_cache import BlockPool

pytestmark = pytest.mark.ex4_7


def publish(pool: BlockPool, blocks: list, tag: int) -> None:
    """Publish held blocks under hashes of their own (one made-up token each)."""
    pool.cache_full_blocks(blocks, [bytes([tag, b.block_id]) for b in blocks], [[tag, b.block_id] for b in blocks])


def ids(blocks) -> list[int]:
    """Block ids, for comparisons."""
    return [b.block_id for b in blocks]


def check_queue(pool: BlockPool) -> None:
    """The free queue holds exactly the blocks nobody holds."""
    queued = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    assert queued == {b.block_id for b in pool.blocks if b.ref_cnt == 0}, (
        "a block handed out must leave the free queue, and only free blocks may be in it"
    )


# ---- the ranked pool's victim ----------------------------------------------------------------


def test_a_fresh_pool_hands_out_in_id_order():
    pool = LRUBlockPool(4)
    assert ids(pool.get_new_blocks(4)) == [0, 1, 2, 3], "a fresh LRU pool should hand out blocks in id order"
    assert all(b.ref_cnt == 1 for b in pool.blocks), "every block handed out should have one holder"
    check_queue(pool)


def test_a_block_revived_by_a_hit_is_never_handed_out():
    pool = LRUBlockPool(4)
    blocks = pool.get_new_blocks(4)
    publish(pool, blocks, 1)
    pool.free_blocks(blocks)
    pool.touch([blocks[0]])  # a prefix hit: block 0 is held again
    handed = pool.get_new_blocks(3)
    assert blocks[0].block_id not in ids(handed), "a block a request holds again must not be handed out"
    assert blocks[0].ref_cnt == 1, "the revived block should keep exactly its one holder"
    check_queue(pool)


def test_a_block_freed_again_counts_from_its_last_free():
    pool = LRUBlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    publish(pool, [a, b, c], 1)
    pool.free_blocks([a])
    pool.free_blocks([b])
    pool.touch([a])  # a hit on a ...
    pool.free_blocks([a])  # ... which is freed again, after b
    (victim,) = pool.get_new_blocks(1)
    assert victim is b, "a block freed again must be ranked by its LAST free: an older heap entry of it is stale"


class ReverseIdPool(RankedBlockPool):
    """A test policy: the highest block id goes first."""

    def eviction_key(self, block):
        return (-block.block_id,)


def test_victims_come_in_the_order_of_the_key():
    pool = ReverseIdPool(5)
    assert ids(pool.get_new_blocks(3)) == [4, 3, 2], "victims should come smallest key first (here: highest id)"
    assert ids(pool.get_new_blocks(2)) == [1, 0], "the remaining free blocks should follow in key order"


def test_pop_victim_leaves_the_block_in_the_queue():
    pool = LRUBlockPool(3)
    victim = pool._pop_victim()
    assert victim.ref_cnt == 0, "_pop_victim should return a free block"
    assert pool.get_num_free_blocks() == 3, (
        "the block stays in the free queue: _pop_victim only chooses it (get_new_blocks takes it out)"
    )
    check_queue(pool)


def test_stale_entries_are_thrown_away_as_they_are_met():
    pool = LRUBlockPool(50)
    blocks = pool.get_new_blocks(50)
    assert pool.free_heap == [], (
        "once every block is handed out, no heap entry can still name a free block: pop entries as you use them"
    )
    pool.free_blocks(blocks)
    pool.touch(blocks[:10])
    pool.free_blocks(blocks[:10])
    pool.get_new_blocks(50)
    assert pool.free_heap == [], "stale entries met on the way should be popped too, not kept"


def _random_workout(pool: BlockPool, seed: int, steps: int = 400) -> list[list[int]]:
    """Seeded allocations, frees and prefix hits on free blocks; returns what each allocation handed out."""
    rng = random.Random(seed)
    held: list = []
    handed: list[list[int]] = []
    tag = 0
    for _ in range(steps):
        action = rng.random()
        free = pool.get_num_free_blocks()
        if action < 0.4 and free:
            blocks = pool.get_new_blocks(rng.randint(1, min(4, free)))
            tag = (tag + 1) % 250
            publish(pool, blocks[: rng.randint(0, len(blocks))], tag)
            held.extend(blocks)
            handed.append(ids(blocks))
        elif action < 0.75 and held:
            rng.shuffle(held)
            n = rng.randint(1, len(held))
            pool.free_blocks(held[:n])
            del held[:n]
        else:
            cached_free = [b for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
            if cached_free:
                hit = rng.choice(cached_free)
                pool.touch([hit])
                held.append(hit)
        check_queue(pool)
    return handed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_lru_policy_hands_out_what_your_block_pool_does(seed):
    assert _random_workout(LRUBlockPool(12), seed) == _random_workout(BlockPool(12, True), seed), (
        "the ranked pool with the LRU key should hand out exactly the blocks BlockPool's free queue does"
    )


@pytest.mark.parametrize("policy", [FIFOBlockPool, LFUBlockPool])
def test_every_policy_keeps_the_pool_consistent(policy):
    handed = _random_workout(policy(12), seed=3)
    assert handed, "the workout should have allocated blocks"


# ---- FIFO --------------------------------------------------------------------------------------


def test_fifo_evicts_the_first_published_however_recently_hit():
    pool = FIFOBlockPool(2)
    first, second = pool.get_new_blocks(2)
    publish(pool, [first], 1)
    publish(pool, [second], 2)
    pool.free_blocks([first, second])
    pool.touch([first])  # a hit: under LRU this would buy it time
    pool.free_blocks([first])
    (victim,) = pool.get_new_blocks(1)
    assert victim is first, "FIFO should evict the block published first, even though it was hit since"


def test_fifo_evicts_an_empty_block_before_a_cached_one():
    pool = FIFOBlockPool(3)
    x, y, z = pool.get_new_blocks(3)
    publish(pool, [x, y], 1)
    pool.free_blocks([x, y])
    pool.free_blocks([z])  # z holds no cached prefix, and was freed last
    (victim,) = pool.get_new_blocks(1)
    assert victim is z, "a block holding no cached prefix should be evicted before any cached one"
    assert ids(pool.get_new_blocks(1)) == [x.block_id], "then the earliest published block should go"


def test_fifo_breaks_ties_least_recently_freed():
    pool = FIFOBlockPool(3)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])  # none published: only the order of freeing differs
    assert ids(pool.get_new_blocks(3)) == [2, 0, 1], "among blocks with no prefix, the one free the longest goes first"


# ---- LFU ---------------------------------------------------------------------------------------


def test_lfu_keeps_the_more_shared_block():
    pool = LFUBlockPool(2)
    popular, once = pool.get_new_blocks(2)
    publish(pool, [popular, once], 1)
    pool.free_blocks([popular, once])
    for _ in range(2):  # two hits on `popular`
        pool.touch([popular])
        pool.free_blocks([popular])
    pool.touch([once])  # one hit on `once`, freed last
    pool.free_blocks([once])
    (victim,) = pool.get_new_blocks(1)
    assert victim is once, "LFU should evict the block shared fewer times, even if it was freed more recently"


def test_lfu_evicts_an_empty_block_before_a_cached_one():
    pool = LFUBlockPool(2)
    cached, empty = pool.get_new_blocks(2)
    publish(pool, [cached], 1)
    pool.free_blocks([cached])
    pool.free_blocks([empty])  # no prefix, freed last, no shares either
    (victim,) = pool.get_new_blocks(1)
    assert victim is empty, "a block holding no cached prefix should be evicted before any cached one"


def test_lfu_breaks_ties_least_recently_freed():
    pool = LFUBlockPool(3)
    blocks = pool.get_new_blocks(3)
    publish(pool, blocks, 1)
    pool.free_blocks([blocks[1], blocks[2], blocks[0]])  # equally shared (never)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 0], "among equally shared blocks, the one free the longest goes first"


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_"))) for i in ("4.7",)],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)

"""Graded tests for exercises 8.1-8.3: the CPU tier itself (offer on eviction, the lookup, the loads).

The tier is tested alone: its blocks are made here, published under hashes of this file's own (the
tier treats a hash as an opaque name), so nothing here depends on exercises 3.x-4.x.
"""

from __future__ import annotations

import random

import pytest

from kvcourse.core.contract import KVCacheBlocks
from kvcourse.core.kv_cache_utils import KVCacheBlock
from kvcourse.core.request import Request
from kvcourse.offload import CPUOffloadTier

SIZE = 4  # tokens per block


def chain(token_ids: list[int]) -> list[bytes]:
    """A hash per full block naming the whole prefix up to it (a stand-in for 4.1's chain)."""
    return [repr(tuple(token_ids[: (i + 1) * SIZE])).encode() for i in range(len(token_ids) // SIZE)]


def tier_of(capacity: int) -> CPUOffloadTier:
    """A tier whose requests' hashes come from `chain`."""
    return CPUOffloadTier(capacity, SIZE, lambda request: chain(request.all_token_ids))


def evicted(block_id: int, tokens: list[int], parent: list[int] | None = None) -> KVCacheBlock:
    """A full, published device block being evicted (hash = its whole prefix)."""
    prefix = (parent or []) + tokens
    return KVCacheBlock(block_id, block_hash=repr(tuple(prefix)).encode(), token_ids=tuple(tokens))


def blocks_of(token_ids: list[int], first_id: int = 0) -> list[KVCacheBlock]:
    """The device blocks of a prompt's full blocks, as the pool would evict them."""
    return [
        evicted(first_id + i, token_ids[i * SIZE : (i + 1) * SIZE], token_ids[: i * SIZE])
        for i in range(len(token_ids) // SIZE)
    ]


def check_tier(tier: CPUOffloadTier) -> None:
    """What the contract fixes at all times: capacity, one slot per entry, slots in range."""
    slots = [entry.slot for entry in tier.entries.values()]
    assert len(tier.entries) <= tier.num_blocks, (
        f"the tier holds {len(tier.entries)} blocks but has room for {tier.num_blocks}: never exceed its capacity"
    )
    assert len(set(slots)) == len(slots), f"two entries share a CPU slot ({slots}): each entry needs its own slot"
    assert all(0 <= s < tier.num_blocks for s in slots), f"a slot is out of range 0..{tier.num_blocks - 1}: {slots}"
    assert not set(slots) & set(tier.free_slots), "a slot an entry uses must not also be listed in free_slots"


# ---- 8.1 offer on eviction -----------------------------------------------------------------------


@pytest.mark.ex8_1
def test_an_offered_block_is_stored_with_one_save():
    tier = tier_of(4)
    a, b = blocks_of(list(range(8)), first_id=5)
    tier.offer(a)
    tier.offer(b)
    assert tier.lru_order() == [a.block_hash, b.block_hash], "stored blocks should be in the tier, newest last (MRU)"
    slots = [tier.entries[a.block_hash].slot, tier.entries[b.block_hash].slot]
    assert tier.pending_saves == [(5, slots[0]), (6, slots[1])], (
        "each stored block needs exactly one save (device block id, its slot), in the order offered"
    )
    assert tier.entries[a.block_hash].token_ids == a.token_ids, "an entry must keep the block's tokens as a tuple"
    check_tier(tier)


@pytest.mark.ex8_1
def test_a_block_already_held_is_not_copied_again():
    tier = tier_of(4)
    [a] = blocks_of(list(range(4)))
    tier.offer(a)
    tier.take_transfers()
    again = evicted(9, list(range(4)))  # the same prefix, evicted again from another device block
    tier.offer(again)
    assert len(tier) == 1, "a hash the tier holds must not get a second entry"
    assert tier.pending_saves == [], "a block whose hash the tier already holds must not be copied out again"
    check_tier(tier)


@pytest.mark.ex8_1
def test_a_full_tier_drops_only_its_least_recently_used_block_or_refuses():
    tier = tier_of(2)
    a, b, c = blocks_of(list(range(12)))
    tier.offer(a)
    tier.offer(b)
    tier.take_transfers()
    slot_a = tier.entries[a.block_hash].slot
    order = tier.lru_order()
    tier.offer(c)
    check_tier(tier)
    if tier.holds(c.block_hash):
        assert not tier.holds(order[0]) and tier.holds(order[1]), (
            "a full tier makes room by dropping its LEAST recently used entry, and only that one"
        )
        assert tier.pending_saves == [(c.block_id, slot_a)], "the newcomer takes the dropped entry's slot, saved once"
        assert tier.stats.dropped == 1, "each dropped entry is counted in stats.dropped"
    else:
        assert tier.lru_order() == order and tier.pending_saves == [], "a refused block must change nothing"


@pytest.mark.ex8_1
def test_a_slot_a_load_reads_is_never_dropped():
    tier = tier_of(2)
    a, b, c = blocks_of(list(range(12)))
    tier.offer(a)
    tier.offer(b)
    tier.take_transfers()
    tier.pinned.add(tier.entries[a.block_hash].slot)  # a load reads a's slot this step
    tier.offer(c)
    assert tier.holds(a.block_hash), "an entry whose slot is pinned (a load reads it this step) must never be dropped"
    assert all(slot != tier.entries[a.block_hash].slot for _, slot in tier.pending_saves), (
        "a pinned slot must not be overwritten by a save"
    )
    check_tier(tier)


@pytest.mark.ex8_1
def test_when_every_slot_is_pinned_the_block_is_not_stored():
    tier = tier_of(2)
    a, b, c = blocks_of(list(range(12)))
    tier.offer(a)
    tier.offer(b)
    tier.take_transfers()
    tier.pinned.update(entry.slot for entry in tier.entries.values())
    tier.offer(c)
    assert not tier.holds(c.block_hash) and tier.pending_saves == [], (
        "with every slot pinned there is no room: the block is not stored and nothing is saved"
    )
    assert tier.holds(a.block_hash) and tier.holds(b.block_hash), "pinned entries must stay"


@pytest.mark.ex8_1
def test_many_offers_keep_the_tier_consistent():
    rng = random.Random(8)
    tier = tier_of(5)
    prompts = [[rng.randrange(100) for _ in range(8)] for _ in range(12)]
    for step in range(60):
        block = rng.choice(blocks_of(rng.choice(prompts), first_id=10 * step))
        before = tier.lru_order()
        held = {h: e.slot for h, e in tier.entries.items()}
        tier.offer(block)
        check_tier(tier)
        gone = [h for h in before if not tier.holds(h)]
        assert len(gone) <= 1, "one offer drops at most one entry"
        if gone:
            unpinned = [h for h in before if held[h] not in tier.pinned]
            assert gone == unpinned[:1], "a drop must take the least recently used entry that is not pinned"
        saves = len(tier.pending_saves)
        if block.block_hash not in held and tier.holds(block.block_hash):
            assert tier.pending_saves[-1] == (block.block_id, tier.entries[block.block_hash].slot), (
                "a newly stored block gets one save into its own slot"
            )
        else:
            assert saves == 0 or tier.pending_saves[-1][0] != block.block_id, "a block not stored now is not saved"
        if rng.random() < 0.3:
            tier.take_transfers()
        if rng.random() < 0.2 and tier.entries:
            tier.pinned.add(rng.choice(list(tier.entries.values())).slot)


# ---- 8.2 how many more tokens the tier holds -----------------------------------------------------


def stored(tier: CPUOffloadTier, token_ids: list[int], indices: list[int]) -> None:
    """Put some of a prompt's blocks in the tier."""
    all_blocks = blocks_of(token_ids)
    for i in indices:
        tier.offer(all_blocks[i])
    tier.take_transfers()


@pytest.mark.ex8_2
def test_the_run_after_the_device_hits_is_counted():
    tier = tier_of(16)
    tokens = list(range(1, 22))  # 5 full blocks and a partial one
    stored(tier, tokens, [0, 1, 2, 3, 4])
    request = Request(1, tokens, max_new_tokens=3)
    assert tier.get_num_new_matched_tokens(request, 0) == 20, "every full block the tier holds counts, from the start"
    assert tier.get_num_new_matched_tokens(request, 8) == 12, (
        "the count starts after the device's hits (num_computed_tokens) and counts only tokens past them"
    )


@pytest.mark.ex8_2
def test_the_run_stops_at_the_first_block_the_tier_lacks():
    tier = tier_of(16)
    tokens = list(range(1, 22))
    stored(tier, tokens, [0, 1, 3, 4])
    request = Request(1, tokens, max_new_tokens=3)
    assert tier.get_num_new_matched_tokens(request, 0) == 8, "the run stops at the first missing block (block 2)"
    assert tier.get_num_new_matched_tokens(request, 12) == 8, "from block 3 on, blocks 3 and 4 are a run again"


@pytest.mark.ex8_2
def test_the_block_holding_the_last_token_is_never_loaded():
    tier = tier_of(16)
    tokens = list(range(1, 17))  # exactly 4 full blocks
    stored(tier, tokens, [0, 1, 2, 3])
    request = Request(1, tokens, max_new_tokens=3)
    assert tier.get_num_new_matched_tokens(request, 0) == 12, (
        "the block holding the last token is always recomputed (its logits give the next token): 3 blocks, not 4"
    )


@pytest.mark.ex8_2
def test_a_hash_collision_never_loads():
    tier = tier_of(16)
    tokens = list(range(1, 22))
    stored(tier, tokens, [0, 1, 2])
    entry = tier.entries[chain(tokens)[1]]
    entry.token_ids = (0, 0, 0, 0)  # same hash, other tokens: a collision
    request = Request(1, tokens, max_new_tokens=3)
    assert tier.get_num_new_matched_tokens(request, 0) == 4, (
        "an entry whose tokens differ from the block's is a miss (a collision never loads)"
    )


@pytest.mark.ex8_2
def test_asking_changes_nothing():
    tier = tier_of(16)
    tokens = list(range(1, 22))
    stored(tier, tokens, [2, 0, 1])
    order = tier.lru_order()
    tier.get_num_new_matched_tokens(Request(1, tokens, max_new_tokens=3), 0)
    assert tier.lru_order() == order, "asking must not change the tier's LRU order"
    assert not tier.pinned and not tier.pending_loads, "asking must not pin a slot or queue a load"


# ---- 8.3 the loads after allocation --------------------------------------------------------------


@pytest.mark.ex8_3
def test_loads_are_queued_pinned_and_promoted():
    tier = tier_of(16)
    tokens = list(range(1, 22))
    stored(tier, tokens, [0, 1, 2, 3, 4])
    hashes = chain(tokens)
    request = Request(1, tokens, max_new_tokens=3)
    request.num_computed_tokens = 4  # one device hit
    num = tier.update_state_after_alloc(request, KVCacheBlocks([40, 41, 42]), 12)
    assert num == 12, "all three blocks are still in the tier: the loads bring 12 tokens"
    slots = [tier.entries[h].slot for h in hashes[1:4]]
    assert tier.pending_loads == [(slots[0], 40), (slots[1], 41), (slots[2], 42)], (
        "each load is (the entry's slot, the device block), in the request's block order, starting after the hits"
    )
    assert tier.pinned >= set(slots), "every slot a load reads must be pinned until the copy runs"
    assert tier.lru_order()[-3:] == hashes[1:4], "a loaded entry is promoted to most recently used"


@pytest.mark.ex8_3
def test_a_block_dropped_meanwhile_stops_the_loads():
    tier = tier_of(16)
    tokens = list(range(1, 22))
    stored(tier, tokens, [0, 1, 2, 3])
    hashes = chain(tokens)
    request = Request(1, tokens, max_new_tokens=3)
    del tier.entries[hashes[1]]  # dropped after the scheduler asked
    num = tier.update_state_after_alloc(request, KVCacheBlocks([10, 11, 12, 13]), 16)
    assert num == 4, "only the blocks before the first one the tier lost load; the rest are recomputed"
    assert [block for _, block in tier.pending_loads] == [10], (
        "no load for a block the tier lost, nor for any after it (the request's prefix must be unbroken)"
    )
    assert tier.stats.failed == 3, "the blocks that will not load are counted in stats.failed"


@pytest.mark.ex8_3
def test_a_changed_entry_is_not_loaded():
    tier = tier_of(16)
    tokens = list(range(1, 22))
    stored(tier, tokens, [0, 1])
    tier.entries[chain(tokens)[0]].token_ids = (9, 9, 9, 9)
    request = Request(1, tokens, max_new_tokens=3)
    assert tier.update_state_after_alloc(request, KVCacheBlocks([3, 4]), 8) == 0, (
        "an entry whose tokens differ from the block's must not be loaded"
    )
    assert tier.pending_loads == [] and not tier.pinned, "nothing loads, nothing is pinned"


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [
        pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_")))
        for i in ("8.1", "8.2", "8.3")  # 8.4 and 8.5: test_ex8_scheduling.py
    ],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)

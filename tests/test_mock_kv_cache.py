"""The mock KV-cache manager counts blocks exactly, all or nothing, and the handle hides what a block is."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.core.contract import KVCacheBlocks, KVCacheManagerProtocol, MockKVCacheManager, blocks_needed
from kvcourse.core.request import Request


def req(request_id: int = 0, computed: int = 0) -> Request:
    request = Request(id=request_id, prompt_tokens=[1] * 64, max_new_tokens=8)
    request.num_computed_tokens = computed
    return request


@dataclass
class FakeBlock:
    block_id: int


def test_handle_over_ints_and_block_objects():
    assert KVCacheBlocks([3, 1]).get_block_ids() == [3, 1]
    assert KVCacheBlocks([FakeBlock(5), FakeBlock(2)]).get_block_ids() == [5, 2]
    both = KVCacheBlocks([FakeBlock(5)]) + KVCacheBlocks([7])
    assert both.get_block_ids() == [5, 7] and len(both) == 2
    assert len(KVCacheBlocks.empty()) == 0 and not KVCacheBlocks.empty()
    assert KVCacheBlocks([1, 2]) == KVCacheBlocks([FakeBlock(1), FakeBlock(2)])


def test_mock_obeys_the_protocol():
    assert isinstance(MockKVCacheManager(4, 4), KVCacheManagerProtocol)


@pytest.mark.parametrize(
    "num_blocks, block_size, word",
    [(0, 4, "num_blocks"), (-1, 4, "num_blocks"), (4, 0, "block_size"), (4, -2, "block_size")],
)
def test_bad_sizes(num_blocks, block_size, word):
    with pytest.raises(ValueError, match=word):
        MockKVCacheManager(num_blocks, block_size)


def test_negative_token_counts_are_refused():
    manager = MockKVCacheManager(4, 4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(req(), -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        manager.allocate_slots(req(), 1, num_new_computed_tokens=-1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.can_allocate(req(), -5)


def test_exact_block_arithmetic():
    manager = MockKVCacheManager(num_blocks=10, block_size=16)
    r = req()
    assert len(manager.allocate_slots(r, 15)) == 1  # 15 tokens: 1 block
    r.num_computed_tokens = 15
    assert len(manager.allocate_slots(r, 1)) == 0  # 16th token fits the block
    r.num_computed_tokens = 16
    assert len(manager.allocate_slots(r, 1)) == 1  # 17th needs a new block
    r.num_computed_tokens = 17
    assert len(manager.allocate_slots(r, 32)) == 2  # 49 tokens: 4 blocks in all
    assert manager.get_block_ids(r) == [0, 1, 2, 3]
    assert manager.get_num_free_blocks() == 6 and manager.usage == pytest.approx(0.4)


def test_all_or_nothing_and_free():
    manager = MockKVCacheManager(num_blocks=3, block_size=4)
    a, b = req(0), req(1)
    assert manager.allocate_slots(a, 8) is not None
    assert not manager.can_allocate(b, 5)
    assert manager.allocate_slots(b, 5) is None
    assert manager.get_block_ids(b) == [] and manager.get_num_free_blocks() == 1
    assert manager.can_allocate(b, 4) and manager.allocate_slots(b, 4).get_block_ids() == [2]
    manager.free(a)
    manager.free(a)  # twice: harmless
    manager.free(req(42))  # unknown: harmless
    assert manager.get_num_free_blocks() == 2 and manager.get_block_ids(a) == []


def test_no_prefix_hits_and_no_computed_blocks_accepted():
    manager = MockKVCacheManager(4, 4)
    blocks, num = manager.get_computed_blocks(req())
    assert len(blocks) == 0 and num == 0
    assert manager.allocate_slots(req(), 4, 0, blocks) is not None
    with pytest.raises(ValueError, match="caches no prefixes"):
        manager.allocate_slots(req(1), 4, 4, KVCacheBlocks([0]))


def test_verbose_prints_the_lessons_lines(capsys):
    manager = MockKVCacheManager(100, 16, verbose=True)
    r = req()
    manager.allocate_slots(r, 17)
    manager.free(r)
    out = capsys.readouterr().out
    assert "[Cache] Allocated 2 blocks for Req 0. Free blocks: 98" in out
    assert "[Cache] Freed 2 blocks from Req 0. Free blocks: 100" in out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.booleans()), max_size=40),
    st.integers(1, 12),
    st.integers(1, 5),
)
def test_random_operations_keep_counts_exact(ops, num_blocks, block_size):
    manager = MockKVCacheManager(num_blocks, block_size)
    requests = {i: req(i) for i in range(4)}
    for rid, n, do_free in ops:
        r = requests[rid]
        if do_free:
            manager.free(r)
            r.num_computed_tokens = 0
            continue
        before = manager.get_num_free_blocks()
        expected = max(0, blocks_needed(r.num_computed_tokens + n, block_size) - len(manager.get_block_ids(r)))
        assert manager.can_allocate(r, n) == (expected <= before)
        got = manager.allocate_slots(r, n)
        if expected > before:
            assert got is None and manager.get_num_free_blocks() == before
        else:
            assert len(got) == expected and manager.get_num_free_blocks() == before - expected
            r.num_computed_tokens += n
        assert len(manager.get_block_ids(r)) == blocks_needed(r.num_computed_tokens, block_size)
        held = [b for q in requests.values() for b in manager.get_block_ids(q)]
        assert len(held) == len(set(held)) and manager.get_num_free_blocks() + len(held) == num_blocks
    for r in requests.values():
        manager.free(r)
    assert manager.get_num_free_blocks() == num_blocks

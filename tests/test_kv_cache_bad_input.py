"""Bad input to the reference allocator: a ValueError that names the problem, and documented no-ops."""

from __future__ import annotations

import pytest
from reference import load_reference

from kvcourse.core.request import Request

kv = load_reference("kv_cache")


def request(request_id: int, n: int) -> Request:
    """A request with an n-token prompt."""
    return Request(request_id, list(range(n)), max_new_tokens=4)


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_non_positive_num_blocks(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        kv.KVCacheManager(num_blocks, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        kv.BlockPool(num_blocks)


@pytest.mark.parametrize("block_size", [0, -1])
def test_non_positive_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        kv.KVCacheManager(4, block_size)


def test_negative_token_counts():
    manager = kv.KVCacheManager(4, 4)
    req = request(1, 3)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(req, -1)
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        manager.allocate_slots(req, 1, num_new_computed_tokens=-4)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.can_allocate(req, -2)
    assert manager.get_num_free_blocks() == 4 and manager.get_block_ids(req) == [], "a rejected call changed state"


def test_double_free_inside_the_pool():
    pool = kv.BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    with pytest.raises(ValueError, match=r"block 0 freed twice"):
        pool.free_blocks([blocks[0]])
    assert pool.get_num_free_blocks() == 3, "a rejected double free changed the free count"


def test_same_block_twice_in_one_free_is_refused_before_anything_changes():
    pool = kv.BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    with pytest.raises(ValueError, match="freed twice"):
        pool.free_blocks([block, block])
    assert block.ref_cnt == 1, "a rejected free changed the ref count"


def test_asking_the_pool_for_too_many_blocks():
    pool = kv.BlockPool(2)
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="0 or more"):
        pool.get_new_blocks(-1)


def test_queue_misuse():
    blocks = [kv.KVCacheBlock(i) for i in range(2)]
    queue = kv.FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="already in the free-block queue"):
        queue.append(blocks[0])
    queue.remove(blocks[0])
    with pytest.raises(ValueError, match="not in the free-block queue"):
        queue.remove(blocks[0])
    queue.popleft()
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()


def test_free_of_unknown_request_is_a_no_op():
    manager = kv.KVCacheManager(4, 4, enable_prefix_caching=True)
    manager.free(request(7, 3))
    assert manager.get_num_free_blocks() == 4
    assert manager.get_block_ids(request(7, 3)) == []


def test_hits_only_at_admission():
    manager = kv.KVCacheManager(8, 2, enable_prefix_caching=True)
    first = request(1, 5)
    manager.allocate_slots(first, 5)
    first.num_computed_tokens = 5
    second = request(2, 5)
    hits, n = manager.get_computed_blocks(second)
    assert n == 4
    with pytest.raises(ValueError, match="num_new_computed_tokens"):
        manager.allocate_slots(second, 1, n - 1, hits)
    with pytest.raises(ValueError, match="only taken when a request is admitted"):
        manager.allocate_slots(first, 1, n, hits)


def test_fork_misuse():
    manager = kv.KVCacheManager(8, 2)
    parent, child = request(1, 3), request(2, 3)
    with pytest.raises(ValueError, match="holds no blocks"):
        manager.fork(parent, child)
    manager.allocate_slots(parent, 3)
    parent.num_computed_tokens = 3
    with pytest.raises(ValueError, match="num_computed_tokens"):
        manager.fork(parent, child)
    child.num_computed_tokens = 3
    manager.fork(parent, child)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.fork(parent, child)

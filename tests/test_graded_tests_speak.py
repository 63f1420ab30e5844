"""Every failure of a graded test speaks: no bare assert, and the KV invariant checker itself can fail.

The grader shows the first failing assertion's message as "What failed"; an assert without one
shows "a check failed (the test gave no message)". So every assert in tests/exercises carries a
message naming the rule it checks. The invariant checker (tests/exercises/invariants.py) that the
3.x and 4.x tests run after every call is checked here on broken states, one per invariant.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.reference import load_reference

GRADED = Path(__file__).resolve().parent / "exercises"
sys.path.insert(0, str(GRADED))
from invariants import InvariantBroken, checked, manager_problem, pool_problem  # noqa: E402


@pytest.mark.parametrize("path", sorted(GRADED.glob("*.py")), ids=lambda p: p.name)
def test_every_assert_has_a_message(path):
    tree = ast.parse(path.read_text())
    bare = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert) and node.msg is None]
    assert not bare, f"{path.name}: asserts without a message on lines {bare}; say which rule broke, in words"


@pytest.fixture
def kv():
    """The reference kv_cache module."""
    return load_reference("kv_cache")


def test_a_valid_manager_passes(kv):
    manager = kv.KVCacheManager(8, 4, enable_prefix_caching=True)
    request = load_reference("kv_cache").Request(1, list(range(10)), max_new_tokens=2)
    manager.allocate_slots(request, 10)
    assert manager_problem(manager) is None, "a manager after a correct allocation broke no invariant"


def test_each_broken_invariant_is_named(kv):
    def fresh():
        manager = kv.KVCacheManager(6, 4, enable_prefix_caching=True)
        request = kv.Request(1, list(range(9)), max_new_tokens=2)
        manager.allocate_slots(request, 9)
        return manager, manager.block_pool, manager.req_to_blocks[1]

    manager, pool, table = fresh()
    table.append(table[0])
    table[0].ref_cnt += 1
    assert "twice" in manager_problem(manager), "a block held twice in one table must be named"
    manager, pool, table = fresh()
    table[0].ref_cnt += 1
    assert "ref_cnt" in manager_problem(manager), "a ref count that disagrees with the tables must be named"
    manager, pool, table = fresh()
    pool.free_block_queue.num_free_blocks += 1
    assert "num_free_blocks" in pool_problem(pool), "a wrong free count must be named"
    manager, pool, table = fresh()
    last = pool.free_block_queue.fake_tail.prev_free_block
    last.prev_free_block = pool.free_block_queue.fake_head
    assert "prev pointer" in pool_problem(pool), "a queue whose two directions disagree must be named"
    manager, pool, table = fresh()
    table[0].block_hash = b"stale"
    assert "hash" in pool_problem(pool), "a block hash the map does not know must be named"
    manager, pool, table = fresh()
    pool.free_block_queue.remove(pool.free_block_queue.fake_head.next_free_block)
    assert "missing from the free queue" in pool_problem(pool), "a free block out of the queue must be named"


def test_checked_reports_the_call_and_translates_pool_errors(kv):
    manager = checked(kv.KVCacheManager(4, 4))
    request = kv.Request(1, list(range(5)), max_new_tokens=2)
    manager.allocate_slots(request, 5)
    blocks = list(manager.get_blocks(request).blocks)
    manager.free(request)
    with pytest.raises(InvariantBroken, match="double free"):
        manager.block_pool.free_blocks(blocks)

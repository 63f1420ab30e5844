"""The block-table widget: snapshots are right, the HTML is deterministic, stepping changes the view."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from reference import load_reference

from kvcourse.core.request import Request
from kvcourse.viz.widgets import (
    CACHED_FREE,
    FREE,
    USED,
    BlockTableWidget,
    Recorder,
    Snapshot,
    render_html,
    request_color,
    snapshot,
)

# ------------------------------------------------------------------------------------------------
# A tiny scripted paged manager, so these tests do not depend on the exercise code.


@dataclass
class FakeBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class FakeFreeQueue(list):
    """The free queue as a list, front first, with the pool's read-out method."""

    def get_all_free_blocks(self) -> list[FakeBlock]:
        return list(self)


@dataclass
class FakeManager:
    num_blocks: int
    block_size: int
    tables: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.block_pool = SimpleNamespace(blocks=[FakeBlock(i) for i in range(self.num_blocks)])
        self.block_pool.free_block_queue = FakeFreeQueue(self.block_pool.blocks)

    def take(self, request: Request, block_ids: list[int]) -> None:
        """Put blocks in the request's table (a shared block just gains a holder)."""
        self.tables.setdefault(request.id, []).extend(block_ids)
        for block_id in block_ids:
            block = self.block_pool.blocks[block_id]
            if block.ref_cnt == 0:
                self.block_pool.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free(self, request: Request) -> None:
        for block_id in reversed(self.tables.pop(request.id, [])):
            block = self.block_pool.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.block_pool.free_block_queue.append(block)

    def get_block_ids(self, request: Request) -> list[int]:
        return list(self.tables.get(request.id, []))

    def get_num_free_blocks(self) -> int:
        return len(self.block_pool.free_block_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks


def scripted_run() -> tuple[FakeManager, list[Request], list[Snapshot]]:
    """Two requests share a cached prefix block, one grows, one finishes (block_size 4, 8 blocks)."""
    manager = FakeManager(num_blocks=8, block_size=4)
    r0 = Request(id=0, prompt_tokens=list(range(6)), max_new_tokens=3)
    r1 = Request(id=1, prompt_tokens=list(range(5)), max_new_tokens=3)
    snaps = [snapshot(manager, [r0, r1], "start")]
    manager.take(r0, [3, 5])
    manager.block_pool.blocks[3].block_hash = 111  # r0's first block is full: cached
    r0.num_computed_tokens = 6
    snaps.append(snapshot(manager, [r0, r1], "r0 prefilled"))
    manager.take(r1, [3, 0])  # r1 hits r0's first block, gets a new second block
    r1.num_computed_tokens = 5
    snaps.append(snapshot(manager, [r0, r1], "r1 shares block 3"))
    manager.free(r0)
    snaps.append(snapshot(manager, [r0, r1], "r0 finished"))
    manager.free(r1)
    snaps.append(snapshot(manager, [r0, r1], "all finished"))
    return manager, [r0, r1], snaps


# ------------------------------------------------------------------------------------------------
# Snapshot correctness


def test_snapshot_records_owners_fill_ref_counts_and_tables() -> None:
    _, _, snaps = scripted_run()
    shared = snaps[2]
    assert shared.tables == {0: [3, 5], 1: [3, 0]}
    b3, b5, b0 = shared.blocks[3], shared.blocks[5], shared.blocks[0]
    assert (b3.owners, b3.ref_cnt, b3.num_tokens, b3.cached, b3.state) == ((0, 1), 2, 4, True, USED)
    assert (b5.owners, b5.num_tokens, b5.state) == ((0,), 2, USED)  # 6 tokens = one full block + 2
    assert (b0.owners, b0.num_tokens) == ((1,), 1)  # 5 tokens = one full block + 1
    assert shared.num_free_blocks == 5 and shared.usage == pytest.approx(3 / 8)
    assert shared.count(USED) == 3 and shared.count(FREE) == 5


def test_freed_cached_block_is_cached_free_and_last_in_eviction_order() -> None:
    _, _, snaps = scripted_run()
    after_r0 = snaps[3]
    assert after_r0.blocks[3].state == USED, "block 3 is still held by r1"
    assert after_r0.blocks[5].state == FREE and after_r0.tables == {1: [3, 0]}
    done = snaps[4]
    assert done.blocks[3].state == CACHED_FREE and done.blocks[3].num_tokens == 4
    assert done.block_tables == () and done.num_free_blocks == 8
    assert done.eviction_order[-2:] == (0, 3), "r1 freed tail first: block 0, then block 3"
    assert done.count(CACHED_FREE) == 1


def test_snapshot_is_plain_data_that_does_not_follow_the_manager() -> None:
    manager, (r0, _), snaps = scripted_run()
    before = render_html(snaps[1])
    manager.take(r0, [1, 2])
    r0.num_computed_tokens = 12
    assert render_html(snaps[1]) == before
    assert snaps[1].tables == {0: [3, 5]}


def test_recorder_as_on_step_callback_labels_each_iteration() -> None:
    manager = FakeManager(num_blocks=4, block_size=2)
    running = Request(id=7, prompt_tokens=[1, 2, 3], max_new_tokens=2, num_computed_tokens=3)
    waiting = Request(id=2, prompt_tokens=[1], max_new_tokens=1)
    manager.take(running, [2, 1])
    scheduler = SimpleNamespace(kv_cache_manager=manager, active_pool={7: running}, waiting_queue=deque([waiting]))
    batch = [SimpleNamespace(request_id=7, tokens=[3], is_decode=False)]
    recorder = Recorder()
    recorder(1, batch, scheduler)
    (snap,) = recorder.snapshots
    assert snap.label == "iteration 1: prefill r7 (1)"
    assert snap.tables == {7: [2, 1]}, "a waiting request with no blocks has no table row"
    assert snap.blocks[1].num_tokens == 1 and snap.blocks[2].num_tokens == 2


# ------------------------------------------------------------------------------------------------
# Deterministic HTML


def test_html_is_identical_for_identical_runs_and_counts_every_block() -> None:
    first = [render_html(s) for s in scripted_run()[2]]
    second = [render_html(s) for s in scripted_run()[2]]
    assert first == second
    for page, snap in zip(first, scripted_run()[2]):
        assert len(re.findall(r'class="kv-block ', page)) == snap.num_blocks
        assert page.count('data-state="used"') == snap.count(USED)
        assert page.count('data-state="cached-free"') == snap.count(CACHED_FREE)
    assert "0x" not in "".join(first), "no addresses in the HTML"


def test_shared_block_shows_ref_count_and_both_owner_colours() -> None:
    page = render_html(scripted_run()[2][2])
    block3 = re.search(r'<div class="kv-block [^"]*" data-block-id="3".*?</div></div>', page).group(0)
    assert 'data-ref-cnt="2"' in block3 and "×2" in block3 and "kv-block-shared" in block3
    assert request_color(0) in block3 and request_color(1) in block3


def test_request_colour_is_fixed_by_id() -> None:
    assert request_color(3) == request_color(3)
    assert request_color(0) != request_color(1)


# ------------------------------------------------------------------------------------------------
# The widget


def test_slider_and_step_buttons_change_the_rendered_html() -> None:
    snaps = scripted_run()[2]
    widget = BlockTableWidget(snaps)
    assert widget.view.value == widget.to_html(0)
    widget.slider.value = 2
    assert widget.view.value == widget.to_html(2) != widget.to_html(0)
    assert 'data-step="2"' in widget.view.value
    forward, back = widget.children[0].children[3], widget.children[0].children[1]
    forward.click()
    assert widget.step == 3 and widget.view.value == widget.to_html(3)
    for _ in range(5):
        forward.click()
    assert widget.step == len(snaps) - 1, "stepping stops at the last snapshot"
    back.click()
    assert widget.step == len(snaps) - 2
    assert widget.play.max == widget.slider.max == len(snaps) - 1


def test_widget_reprs_are_deterministic_and_short() -> None:
    one, two = BlockTableWidget(scripted_run()[2]), BlockTableWidget(scripted_run()[2])
    assert repr(one) == repr(two) == "BlockTableWidget(5 steps, 8 blocks of 4 tokens; step 0)"
    bundle = one._repr_mimebundle_()
    assert bundle["text/plain"] == repr(one) and len(bundle["text/plain"]) <= 110
    assert bundle["text/html"] == two._repr_html_() == one.to_html(0)
    assert "application/vnd.jupyter.widget-view+json" in bundle


# ------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_raises_clear_value_errors() -> None:
    snaps = scripted_run()[2]
    with pytest.raises(ValueError, match="at least one Snapshot"):
        BlockTableWidget([])
    with pytest.raises(ValueError, match="out of range"):
        BlockTableWidget(snaps, step=5)
    with pytest.raises(ValueError, match="out of range"):
        BlockTableWidget(snaps).to_html(-1)
    with pytest.raises(ValueError, match="Snapshot objects"):
        BlockTableWidget(["not a snapshot"])
    other = snapshot(FakeManager(num_blocks=3, block_size=4), [])
    with pytest.raises(ValueError, match="different pools"):
        BlockTableWidget([snaps[0], other])
    with pytest.raises(ValueError, match="get_block_ids"):
        snapshot(object(), [])
    r = Request(id=1, prompt_tokens=[1], max_new_tokens=1)
    with pytest.raises(ValueError, match="same request id twice"):
        snapshot(FakeManager(4, 2), [r, r])
    broken = FakeManager(4, 2, tables={1: [9]})
    with pytest.raises(ValueError, match="outside the pool"):
        snapshot(broken, [r])


# ------------------------------------------------------------------------------------------------
# Against the reference allocator and scheduler (skipped until they exist)


def _consistent(snap: Snapshot, num_blocks: int) -> None:
    """Every block is in exactly one place, and the manager's counts agree with the grid."""
    assert snap.num_blocks == num_blocks
    assert snap.count(FREE) + snap.count(CACHED_FREE) == snap.num_free_blocks
    held = [b for _, table in snap.block_tables for b in table]
    assert {b.block_id for b in snap.blocks if b.state == USED} == set(held)
    for block in snap.blocks:
        assert block.ref_cnt == sum(table.count(block.block_id) for _, table in snap.block_tables)


def test_snapshot_of_the_reference_manager() -> None:
    kv_cache = load_reference("kv_cache")
    manager = kv_cache.KVCacheManager(num_blocks=6, block_size=4)
    a = Request(id=0, prompt_tokens=list(range(10)), max_new_tokens=2)
    b = Request(id=1, prompt_tokens=list(range(3)), max_new_tokens=2)
    assert manager.allocate_slots(a, 10) is not None and manager.allocate_slots(b, 3) is not None
    a.num_computed_tokens, b.num_computed_tokens = 10, 3
    snap = snapshot(manager, [a, b], "both prefilled")
    _consistent(snap, 6)
    assert [snap.blocks[i].num_tokens for i in snap.tables[0]] == [4, 4, 2]
    manager.free(a)
    _consistent(snapshot(manager, [a, b]), 6)


def test_record_run_with_the_reference_scheduler() -> None:
    kv_cache, scheduler_module = load_reference("kv_cache"), load_reference("scheduler")
    from kvcourse.viz.widgets import record_run

    manager = kv_cache.KVCacheManager(num_blocks=12, block_size=4)
    scheduler = scheduler_module.StallFreeScheduler(token_budget=16, max_batch_size=4, kv_cache_manager=manager)
    for i, length in enumerate([9, 5, 14, 3]):
        scheduler.add_request(Request(id=i, prompt_tokens=list(range(1, length + 1)), max_new_tokens=4))
    snaps, trace = record_run(scheduler)
    assert len(snaps) == len(trace.steps) + 1
    assert len(snaps) >= 3 and snaps[0].count(USED) == 0
    for snap in snaps:
        _consistent(snap, 12)
    assert snaps[-1].num_free_blocks == 12, "every block comes back when the run ends"
    pages = [render_html(s) for s in snaps]
    assert len(set(pages)) > 1, "the picture changes as the run goes"


def test_snapshot_shows_the_reference_prefix_cache_sharing_and_cached_free_blocks() -> None:
    kv_cache = load_reference("kv_cache")
    manager = kv_cache.KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Request(id=0, prompt_tokens=list(range(10)), max_new_tokens=2)
    manager.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    b = Request(id=1, prompt_tokens=list(range(9)) + [42], max_new_tokens=2)
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    manager.allocate_slots(b, b.num_tokens - num_hit_tokens, num_hit_tokens, hits)
    b.num_computed_tokens = b.num_tokens
    shared = snapshot(manager, [a, b])
    _consistent(shared, 8)
    assert [shared.blocks[i].ref_cnt for i in hits.get_block_ids()] == [2, 2]
    assert all(shared.blocks[i].cached and shared.blocks[i].owners == (0, 1) for i in hits.get_block_ids())
    manager.free(a)
    manager.free(b)
    done = snapshot(manager, [a, b])
    _consistent(done, 8)
    assert done.count(CACHED_FREE) == 2 and done.count(USED) == 0
    assert list(done.eviction_order) == [
        blk.block_id for blk in manager.block_pool.free_block_queue.get_all_free_blocks()
    ]
    assert 'data-state="cached-free"' in render_html(done) and "next reused" in render_html(done)


def test_long_batches_are_summarised_in_the_label() -> None:
    from kvcourse.viz.widgets import describe_batch

    batch = [SimpleNamespace(request_id=i, tokens=[1], is_decode=i > 0) for i in range(8)]
    assert describe_batch(batch) == "1 prefill chunk, 7 decodes"
    assert describe_batch([]) == "nothing scheduled"

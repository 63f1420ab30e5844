"""The block-table widget: watch a paged KV cache hand out, share and free blocks, step by step.

    snapshots, trace = record_run(scheduler)       # kvcourse.toy.run, one Snapshot per step
    BlockTableWidget(snapshots, step=3)            # slider + play/step buttons over the run

    recorder = Recorder()                          # or: an on_step callback for your own loop
    toy.run(scheduler, on_step=recorder)           # ... then BlockTableWidget(recorder.snapshots)
    snapshot(manager, requests, "label")           # one moment by hand (shows as HTML by itself)

In the page: `.kv-widget` (data-step, data-num-blocks, data-num-free) holds one `.kv-block` per
physical block (classes kv-block-used / kv-block-free / kv-block-cached-free, kv-block-shared;
data-block-id, data-state, data-owners, data-ref-cnt, data-tokens, data-cached) and the block
tables (`tr.kv-table-row[data-request-id]`, `.kv-entry[data-logical][data-block-id]`).

A `Snapshot` is plain data taken from a manager at one moment; the widget only draws snapshots,
so the same run always draws the same HTML (it is also the static view where widgets don't run).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import ipywidgets as widgets

from kvcourse.core.contract import SchedulerProtocol
from kvcourse.core.request import Request

# A qualitative palette (Tableau 10 + 6): request i is always drawn in PALETTE[i % len(PALETTE)].
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#2f4b7c",
    "#a05195",
    "#008080",
    "#d45087",
    "#665191",
    "#bcbd22",
    "#17becf",
)
CACHED_COLOR = "#b8b8b8"
USED, FREE, CACHED_FREE = "used", "free", "cached-free"


def request_color(request_id: int) -> str:
    """The colour a request is drawn in: fixed by its id, so it is the same in every step and run."""
    return PALETTE[int(request_id) % len(PALETTE)]


@dataclass(frozen=True)
class BlockState:
    """One physical block at one moment: who holds it, how full it is, whether it is cached."""

    block_id: int
    owners: tuple[int, ...]  # ids of the requests whose block tables hold this block, sorted
    num_tokens: int  # tokens whose K/V are written in it (0..block_size)
    ref_cnt: int
    cached: bool  # holds a prefix-cache hash (lesson 04)

    @property
    def state(self) -> str:
        """'used' (someone holds it), 'cached-free' (free but still hittable) or 'free'."""
        if self.ref_cnt > 0 or self.owners:
            return USED
        return CACHED_FREE if self.cached else FREE


@dataclass(frozen=True, repr=False)
class Snapshot:
    """The whole cache at one moment, as plain data (safe to keep after the manager moves on)."""

    label: str
    block_size: int
    blocks: tuple[BlockState, ...]
    block_tables: tuple[tuple[int, tuple[int, ...]], ...]  # (request id, physical ids by logical index)
    num_free_blocks: int
    usage: float
    eviction_order: tuple[int, ...] = ()  # free block ids, the next one to be reused first

    @property
    def num_blocks(self) -> int:
        """Physical blocks in the pool."""
        return len(self.blocks)

    @property
    def tables(self) -> dict[int, list[int]]:
        """Block tables as a dict: request id -> physical block ids (logical index = position)."""
        return {rid: list(ids) for rid, ids in self.block_tables}

    def count(self, state: str) -> int:
        """How many blocks are in `state` ('used', 'free' or 'cached-free')."""
        return sum(block.state == state for block in self.blocks)

    def __repr__(self) -> str:
        return (
            f"Snapshot({self.label!r}: {self.num_blocks} blocks of {self.block_size} tokens, "
            f"{self.num_free_blocks} free, usage {self.usage:.1%}, {len(self.block_tables)} block tables)"
        )

    def _repr_html_(self) -> str:
        return render_html(self)


def _usage(manager: BlockTableSource) -> float:
    """The manager's own usage figure (the contract's `usage` property)."""
    return float(manager.usage)


@runtime_checkable
class BlockTableSource(Protocol):
    """What a snapshot reads from a KV-cache manager: a part of the contract (KVCacheManagerProtocol)."""

    num_blocks: int
    block_size: int

    def get_block_ids(self, request: Request) -> list[int]: ...

    def get_num_free_blocks(self) -> int: ...

    @property
    def usage(self) -> float: ...


@runtime_checkable
class _FreeQueue(Protocol):
    """The paged pool's free queue: it lists its blocks front (handed out first) to back."""

    def get_all_free_blocks(self) -> list[Any]: ...


@runtime_checkable
class _PagedPool(Protocol):
    """A paged manager's block pool: the KVCacheBlock objects (ref counts, hashes) and the free queue."""

    blocks: list[Any]
    free_block_queue: _FreeQueue


@runtime_checkable
class _PagedManager(Protocol):
    """A KV-cache manager with a block pool (the paged one); the mock only counts blocks."""

    block_pool: _PagedPool


def _pool(manager: BlockTableSource) -> _PagedPool | None:
    """The manager's block pool, or None for a manager that only counts (the mock)."""
    if isinstance(manager, _PagedManager) and isinstance(manager.block_pool, _PagedPool):
        return manager.block_pool
    return None


def _pool_blocks(manager: BlockTableSource) -> list[Any] | None:
    """The manager's KVCacheBlock objects (ref counts, hashes), or None for a manager without a pool."""
    pool = _pool(manager)
    return list(pool.blocks) if pool is not None else None


def _eviction_order(manager: BlockTableSource) -> tuple[int, ...]:
    """Free block ids in the order the pool will hand them out (empty for a manager without a pool)."""
    pool = _pool(manager)
    if pool is None or not isinstance(pool.free_block_queue, _FreeQueue):
        return ()
    return tuple(block.block_id for block in pool.free_block_queue.get_all_free_blocks())


def _fill(num_computed_tokens: int, logical_index: int, block_size: int) -> int:
    """Tokens of a request's logical block `logical_index` that are already in the cache."""
    return max(0, min(block_size, num_computed_tokens - logical_index * block_size))


def _check_snapshot_inputs(manager: BlockTableSource, requests: list[Request]) -> None:
    """A snapshot needs a paged manager and each request once; say which is wrong."""
    if not isinstance(manager, BlockTableSource):
        raise ValueError(
            f"snapshot needs a KV-cache manager with get_block_ids() and block_size, got {type(manager).__name__}."
        )
    ids = [request.id for request in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"snapshot got the same request id twice: {sorted(ids)}; pass each request once.")


_Tables = list[tuple[int, tuple[int, ...]]]


def _read_tables(
    manager: BlockTableSource, requests: list[Request], num_blocks: int, block_size: int
) -> tuple[_Tables, dict[int, set[int]], dict[int, int]]:
    """Each request's block table, plus who holds each block and how many tokens it holds."""
    tables: _Tables = []
    owners: dict[int, set[int]] = {}
    tokens: dict[int, int] = {}
    for request in sorted(requests, key=lambda r: r.id):
        table = tuple(int(b) for b in manager.get_block_ids(request))
        for index, block_id in enumerate(table):
            if not 0 <= block_id < num_blocks:
                raise ValueError(
                    f"request {request.id}'s block table holds block {block_id}, outside the pool "
                    f"(blocks 0..{num_blocks - 1})."
                )
            owners.setdefault(block_id, set()).add(request.id)
            filled = _fill(request.num_computed_tokens, index, block_size)
            tokens[block_id] = max(tokens.get(block_id, 0), filled)
        if table:
            tables.append((request.id, table))
    return tables, owners, tokens


def _block_states(
    pool_blocks: list[Any] | None, num_blocks: int, block_size: int, owners: dict[int, set[int]], tokens: dict[int, int]
) -> tuple[BlockState, ...]:
    """One BlockState per physical block; ref counts and hashes come from the pool when it has them."""
    states = []
    for block_id in range(num_blocks):
        real = pool_blocks[block_id] if pool_blocks is not None else None
        held_by = tuple(sorted(owners.get(block_id, ())))
        ref_cnt = len(held_by) if real is None else int(real.ref_cnt)
        cached = real is not None and real.block_hash is not None
        filled = tokens.get(block_id, block_size if cached else 0)  # only full blocks get a hash
        states.append(BlockState(block_id, held_by, filled, ref_cnt, cached))
    return tuple(states)


def snapshot(manager: BlockTableSource, requests: Iterable[Request], label: str = "") -> Snapshot:
    """Record the manager's blocks and the given requests' block tables as plain data."""
    requests = list(requests)
    _check_snapshot_inputs(manager, requests)
    pool_blocks = _pool_blocks(manager)
    num_blocks = len(pool_blocks) if pool_blocks is not None else int(manager.num_blocks)
    block_size = int(manager.block_size)
    tables, owners, tokens = _read_tables(manager, requests, num_blocks, block_size)
    return Snapshot(
        label=label,
        block_size=block_size,
        blocks=_block_states(pool_blocks, num_blocks, block_size, owners, tokens),
        block_tables=tuple(tables),
        num_free_blocks=int(manager.get_num_free_blocks()),
        usage=_usage(manager),
        eviction_order=_eviction_order(manager),
    )


# ----------------------------------------------------------------------------------------------
# Recording a scheduler run


def scheduler_requests(scheduler: SchedulerProtocol) -> list[Request]:
    """Every request the scheduler still knows: running ones first, then the waiting queue."""
    found: dict[int, Request] = {}
    for request in [*scheduler.active_pool.values(), *scheduler.waiting_queue]:
        found.setdefault(request.id, request)
    return list(found.values())


def _manager_of(scheduler: SchedulerProtocol) -> BlockTableSource:
    """The scheduler's KV-cache manager (a memory-blind scheduler has none to record)."""
    if scheduler.kv_cache_manager is None:
        raise ValueError(f"{type(scheduler).__name__} has no kv_cache_manager to record.")
    return scheduler.kv_cache_manager


def describe_batch(batch: Sequence[Any], limit: int = 6) -> str:
    """A short label for one step's batch: 'prefill r0 (12), decode r1' (counts when it is long)."""
    if not batch:
        return "nothing scheduled"
    if len(batch) > limit:
        decodes = sum(bool(seq.is_decode) for seq in batch)
        prefills = len(batch) - decodes
        return f"{prefills} prefill chunk{'s' * (prefills != 1)}, {decodes} decode{'s' * (decodes != 1)}"
    parts = []
    for seq in batch:
        if seq.is_decode:
            parts.append(f"decode r{seq.request_id}")
        else:
            parts.append(f"prefill r{seq.request_id} ({len(seq.tokens)})")
    return ", ".join(parts)


class Recorder:
    """An `on_step(iteration, batch, scheduler)` callback for kvcourse.toy.run: one Snapshot per step."""

    def __init__(self, extra_requests: Iterable[Request] = ()) -> None:
        self.snapshots: list[Snapshot] = []
        self.extra_requests = list(extra_requests)

    def record(self, manager: BlockTableSource, requests: Iterable[Request], label: str) -> Snapshot:
        """Take and keep one snapshot."""
        known = {request.id: request for request in list(requests) + self.extra_requests}
        taken = snapshot(manager, known.values(), label)
        self.snapshots.append(taken)
        return taken

    def record_scheduler(self, scheduler: SchedulerProtocol, label: str) -> Snapshot:
        """Snapshot the scheduler's manager with every request the scheduler knows."""
        return self.record(_manager_of(scheduler), scheduler_requests(scheduler), label)

    def __call__(self, iteration: int, batch: Sequence[Any], scheduler: SchedulerProtocol) -> None:
        self.record_scheduler(scheduler, f"iteration {iteration}: {describe_batch(batch)}")


def record_run(scheduler: SchedulerProtocol, executor: Any = None, **run_kwargs: Any) -> tuple[list[Snapshot], Any]:
    """Run `scheduler` with kvcourse.toy.run; return its snapshots (the start, then one per step) and the trace."""
    from kvcourse import toy

    recorder = Recorder()
    recorder.record_scheduler(scheduler, "before the first step")
    if executor is not None:
        run_kwargs["executor"] = executor
    trace = toy.run(scheduler, on_step=recorder, **run_kwargs)
    return recorder.snapshots, trace


# ----------------------------------------------------------------------------------------------
# Drawing


def _block_size_px(num_blocks: int) -> int:
    """Big squares for a small pool, small ones for a large pool (the grid stays on one screen)."""
    return 36 if num_blocks <= 64 else 26 if num_blocks <= 256 else 14


def _blocks_per_row(num_blocks: int) -> int:
    """Rows of 10 for a small pool (easy to count), wider rows for a large one."""
    return 10 if num_blocks <= 40 else 16 if num_blocks <= 256 else 40


def _fill_background(block: BlockState) -> str:
    """One colour per owner: a single owner is solid, a shared block is striped in its owners' colours."""
    if not block.owners:
        return CACHED_COLOR
    colors = [request_color(owner) for owner in block.owners]
    if len(colors) == 1:
        return colors[0]
    stops = ", ".join(f"{c} {i * 5}px {(i + 1) * 5}px" for i, c in enumerate(colors))
    return f"repeating-linear-gradient(135deg, {stops})"


def _block_title(block: BlockState, block_size: int) -> str:
    """Hover text: the block's whole state in words."""
    who = ", ".join(f"r{owner}" for owner in block.owners) or {FREE: "free", CACHED_FREE: "free, cached"}.get(
        block.state, "no table"
    )
    return f"block {block.block_id}: {who}; {block.num_tokens}/{block_size} tokens; ref count {block.ref_cnt}"


def _fill_html(block: BlockState, block_size: int) -> str:
    """The coloured bar: its height is the share of the block's slots that hold K/V."""
    if not block.num_tokens:
        return ""
    height = round(100 * block.num_tokens / block_size)
    opacity = 0.45 if block.state == CACHED_FREE else 0.9
    return (
        f'<div class="kv-fill" style="position:absolute;left:0;right:0;bottom:0;height:{height}%;'
        f'background:{_fill_background(block)};opacity:{opacity}"></div>'
    )


def _labels_html(block: BlockState, block_size: int, px: int) -> str:
    """The block id, its ref count when shared (×n), and # when it holds a published hash."""
    if px < 20:
        return ""
    ink = "#fff" if block.state == USED and 4 * block.num_tokens >= 3 * block_size else "#333"  # on the bar or not
    corner = f"position:absolute;top:-1px;font-size:9px;color:{ink}"
    label = f'<span class="kv-block-id" style="position:relative;color:{ink}">{block.block_id}</span>'
    if block.ref_cnt > 1:
        label += f'<span class="kv-ref" style="{corner};right:1px;font-weight:bold">×{block.ref_cnt}</span>'
    if block.cached:
        label += f'<span class="kv-hash" style="{corner};left:2px">#</span>'
    return label


def _block_html(block: BlockState, block_size: int, px: int) -> str:
    """One physical block: a square whose coloured bar rises with its fill, with data-* for tests."""
    state = block.state
    border = {USED: _border_color(block), FREE: "#d0d0d0", CACHED_FREE: "#888"}[state]
    line = "dashed" if state == CACHED_FREE else "solid"
    classes = f"kv-block kv-block-{state}" + (" kv-block-shared" if block.ref_cnt > 1 else "")
    owners = " ".join(str(owner) for owner in block.owners)
    return (
        f'<div class="{classes}" data-block-id="{block.block_id}" data-state="{state}" '
        f'data-owners="{owners}" data-ref-cnt="{block.ref_cnt}" data-tokens="{block.num_tokens}" '
        f'data-cached="{str(block.cached).lower()}" title="{html.escape(_block_title(block, block_size))}" '
        f'style="position:relative;box-sizing:border-box;width:{px}px;height:{px}px;'
        f"border:2px {line} {border};border-radius:3px;background:#fff;display:flex;"
        f'align-items:center;justify-content:center;font-size:10px;overflow:hidden">'
        f"{_fill_html(block, block_size)}{_labels_html(block, block_size, px)}</div>"
    )


def _border_color(block: BlockState) -> str:
    """A used block is outlined in its (first) owner's colour; a held block with no table, in black."""
    return request_color(block.owners[0]) if block.owners else "#000"


def _tables_html(snap: Snapshot) -> str:
    """The per-request block tables: logical index -> physical block, in the request's colour."""
    if not snap.block_tables:
        return '<div class="kv-tables" style="margin-top:6px;color:#666">no request holds blocks</div>'
    shared = {block.block_id for block in snap.blocks if block.ref_cnt > 1}
    rows = []
    for rid, table in snap.block_tables:
        color = request_color(rid)
        cells = "".join(
            f'<span class="kv-entry" data-logical="{i}" data-block-id="{b}" style="display:inline-block;'
            f"min-width:22px;margin:1px;padding:0 3px;border:1px solid {color};border-radius:3px;"
            f'text-align:center;{"font-weight:bold;" if b in shared else ""}">{b}</span>'
            for i, b in enumerate(table)
        )
        rows.append(
            f'<tr class="kv-table-row" data-request-id="{rid}"><th style="text-align:left;padding-right:6px;'
            f'color:{color};white-space:nowrap">r{rid} ({len(table)})</th><td>{cells}</td></tr>'
        )
    return (
        '<div class="kv-tables-title" style="margin-top:6px;color:#666;font-size:11px">block tables: '
        "position = logical block, number = physical block (bold: shared)</div>"
        '<table class="kv-tables" style="border-collapse:collapse;font-size:11px">' + "".join(rows) + "</table>"
    )


def _summary_html(snap: Snapshot, step: int | None, num_steps: int | None) -> str:
    """One line: which step, what ran, free blocks, usage; and the next free blocks to be reused."""
    where = f"step {step}/{num_steps - 1} · " if step is not None and num_steps is not None else ""
    cached = snap.count(CACHED_FREE)
    parts = [
        f"<b>{html.escape(snap.label)}</b>" if snap.label else "",
        f"free <b>{snap.num_free_blocks}</b> / {snap.num_blocks} blocks" + (f" ({cached} cached)" if cached else ""),
        f"usage <b>{snap.usage:.1%}</b>",
        f"block size {snap.block_size}",
    ]
    text = where + " · ".join(p for p in parts if p)
    if snap.eviction_order and cached:
        head = ", ".join(str(b) for b in snap.eviction_order[:8])
        more = ", …" if len(snap.eviction_order) > 8 else ""
        text += f'<br><span class="kv-evict">next reused (LRU first): {head}{more}</span>'
    return f'<div class="kv-summary" style="margin-bottom:4px">{text}</div>'


def _legend_html() -> str:
    """What the squares mean."""
    return (
        '<div class="kv-legend" style="margin-top:4px;color:#666;font-size:11px">square = physical block, '
        "bar = tokens written, colour = owning request, stripes/×n = shared (ref count n), "
        "# = cached (hash published), dashed grey = free but cached (hittable), empty = free</div>"
    )


def render_html(snap: Snapshot, step: int | None = None, num_steps: int | None = None) -> str:
    """The snapshot as self-contained HTML (inline styles only): same snapshot, same string."""
    px = _block_size_px(snap.num_blocks)
    grid = "".join(_block_html(block, snap.block_size, px) for block in snap.blocks)
    return (
        f'<div class="kv-widget" data-step="{"" if step is None else step}" data-num-blocks="{snap.num_blocks}" '
        f'data-num-free="{snap.num_free_blocks}" style="font-family:sans-serif;font-size:12px">'
        + _summary_html(snap, step, num_steps)
        + f'<div class="kv-grid" style="display:flex;flex-wrap:wrap;gap:3px;max-width:{_blocks_per_row(snap.num_blocks) * (px + 3)}px">'
        + grid
        + "</div>"
        + _legend_html()
        + _tables_html(snap)
        + "</div>"
    )


class BlockTableWidget(widgets.VBox):
    """Replay recorded snapshots: a slider, play and step buttons, and the block grid they drive."""

    def __init__(self, snapshots: Sequence[Snapshot], step: int = 0, interval_ms: int = 700) -> None:
        snapshots = tuple(snapshots)
        _check_snapshots(snapshots)
        last = len(snapshots) - 1
        if not 0 <= step <= last:
            raise ValueError(f"step {step} is out of range: this run has steps 0..{last}.")
        slider = widgets.IntSlider(value=step, min=0, max=last, description="step", continuous_update=True)
        play = widgets.Play(value=step, min=0, max=last, interval=interval_ms, description="play")
        widgets.jslink((play, "value"), (slider, "value"))
        back = widgets.Button(description="◀ step", tooltip="previous step", layout=widgets.Layout(width="72px"))
        forward = widgets.Button(description="step ▶", tooltip="next step", layout=widgets.Layout(width="72px"))
        view = widgets.HTML()
        super().__init__(children=[widgets.HBox([play, back, slider, forward]), view])
        self.snapshots = snapshots
        self.slider, self.play, self.view = slider, play, view
        back.on_click(lambda _: self._move(-1))
        forward.on_click(lambda _: self._move(+1))
        slider.observe(self._on_slider, names="value")
        view.value = self.to_html(step)

    @property
    def step(self) -> int:
        """The step on screen (0 = the first snapshot)."""
        return int(self.slider.value)

    @step.setter
    def step(self, value: int) -> None:
        self._check_step(value)
        self.slider.value = value

    def _move(self, delta: int) -> None:
        """Step buttons: one snapshot back or forward, stopping at the ends."""
        self.slider.value = max(0, min(len(self.snapshots) - 1, self.step + delta))

    def _on_slider(self, change: dict) -> None:
        self.view.value = self.to_html(change["new"])

    def _check_step(self, step: int) -> None:
        if not isinstance(step, int) or not 0 <= step < len(self.snapshots):
            raise ValueError(f"step {step!r} is out of range: this run has steps 0..{len(self.snapshots) - 1}.")

    def to_html(self, step: int | None = None) -> str:
        """Static HTML of one step (default: the one on screen); identical for identical snapshots."""
        step = self.step if step is None else step
        self._check_step(step)
        return render_html(self.snapshots[step], step, len(self.snapshots))

    def _repr_html_(self) -> str:
        return self.to_html()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """The live widget, plus static HTML for viewers without a kernel (nbval compares the text)."""
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = repr(self)
        bundle["text/html"] = self.to_html()
        return bundle

    def __repr__(self) -> str:
        first = self.snapshots[0]
        return (
            f"BlockTableWidget({len(self.snapshots)} steps, {first.num_blocks} blocks of "
            f"{first.block_size} tokens; step {self.step})"
        )


def _check_snapshots(snapshots: tuple[Snapshot, ...]) -> None:
    """A replay needs at least one snapshot, all of the same pool."""
    if not snapshots:
        raise ValueError("BlockTableWidget needs at least one Snapshot (did the run record anything?).")
    for snap in snapshots:
        if not isinstance(snap, Snapshot):
            raise ValueError(f"BlockTableWidget takes Snapshot objects, got {type(snap).__name__}.")
    shapes = {(snap.num_blocks, snap.block_size) for snap in snapshots}
    if len(shapes) > 1:
        raise ValueError(f"the snapshots come from different pools (num_blocks, block_size): {sorted(shapes)}.")


__all__ = [
    "PALETTE",
    "BlockState",
    "BlockTableWidget",
    "Recorder",
    "Snapshot",
    "describe_batch",
    "record_run",
    "render_html",
    "request_color",
    "scheduler_requests",
    "snapshot",
]

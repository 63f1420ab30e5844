"""GET /debug/blocks: the block-table widget's Snapshot, taken between two steps, as JSON and back.

The widget (kvcourse.viz.widgets) only draws snapshots, so a notebook can watch a running server's
cache by polling this endpoint and handing the snapshots to `BlockTableWidget`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcourse.viz.widgets import BlockState, Snapshot, scheduler_requests, snapshot


def take_snapshot(engine: Any, label: str) -> Snapshot:
    """The engine's cache and every request it holds (call it in the engine thread, between steps)."""
    return snapshot(engine.kv_cache_manager, scheduler_requests(engine.scheduler), label)


def snapshot_to_json(snap: Snapshot) -> dict[str, Any]:
    """A Snapshot as plain JSON data."""
    return dataclasses.asdict(snap)


def snapshot_from_json(data: dict[str, Any]) -> Snapshot:
    """The Snapshot that snapshot_to_json wrote (tuples restored, so it draws and compares the same)."""
    return Snapshot(
        label=data["label"],
        block_size=int(data["block_size"]),
        blocks=tuple(BlockState(**{**b, "owners": tuple(b["owners"])}) for b in data["blocks"]),
        block_tables=tuple((int(rid), tuple(ids)) for rid, ids in data["block_tables"]),
        num_free_blocks=int(data["num_free_blocks"]),
        usage=float(data["usage"]),
        eviction_order=tuple(data.get("eviction_order", ())),
    )

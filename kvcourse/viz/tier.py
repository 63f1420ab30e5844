"""Lesson 10's picture: the device pool and the CPU tier side by side, and the blocks each step moves between them.

`record_tier_run(engine, rounds)` steps an LLMEngine with a tier through rounds of prompts and keeps one
`TierFrame` per step that moved blocks; `TierFrames` draws them as static HTML (one row of device blocks,
one row of CPU slots, saves in orange, loads in blue), so the picture needs no kernel (the website).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SAVE, LOAD, HELD, CACHED, EMPTY = "#f28e2b", "#4e79a7", "#59a14f", "#bab0ac", "#ffffff"


@dataclass
class TierFrame:
    """One step: which device blocks are held or cached, which CPU slots are used, what moved."""

    step: int
    device: list[str]  # per device block: "held", "cached" (free, still published) or "free"
    tier: list[bool]  # per CPU slot: holds a block
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, CPU slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (CPU slot, device block)
    waiting_for_kvs: list[int] = field(default_factory=list)  # request ids in WAITING_FOR_REMOTE_KVS


def _cell(color: str, border: str, label: str, title: str) -> str:
    """One square, coloured, with a tooltip."""
    return (
        f'<span title="{html.escape(title)}" style="display:inline-block;width:18px;height:18px;margin:1px;'
        f'background:{color};border:2px solid {border};font:9px monospace;text-align:center">{label}</span>'
    )


def frame_html(frame: TierFrame) -> str:
    """One frame as HTML: the device row over the CPU row, moved blocks outlined."""
    saved = {block for block, _ in frame.saves}
    loaded = {block for _, block in frame.loads}
    written = {slot for _, slot in frame.saves}
    read = {slot for slot, _ in frame.loads}
    colors = {"held": HELD, "cached": CACHED, "free": EMPTY}
    device = "".join(
        _cell(colors[state], SAVE if i in saved else LOAD if i in loaded else "#ddd", "", f"device block {i}: {state}")
        for i, state in enumerate(frame.device)
    )
    tier = "".join(
        _cell(CACHED if used else EMPTY, SAVE if i in written else LOAD if i in read else "#ddd", "", f"CPU slot {i}")
        for i, used in enumerate(frame.tier)
    )
    waiting = f" · waiting for their K/V: {frame.waiting_for_kvs}" if frame.waiting_for_kvs else ""
    return (
        f"<div style='font:12px sans-serif;margin:4px 0'><b>step {frame.step}</b>: "
        f"{len(frame.saves)} saved (orange), {len(frame.loads)} loaded (blue){waiting}<br>"
        f"device&nbsp;{device}<br>CPU&nbsp;&nbsp;&nbsp;&nbsp;{tier}</div>"
    )


@dataclass
class TierFrames:
    """The frames of a run, drawn one under the other (Jupyter shows the HTML)."""

    frames: list[TierFrame]

    def _repr_html_(self) -> str:
        legend = (
            f"<div style='font:12px sans-serif'>device blocks: {_cell(HELD, '#ddd', '', 'held')} held, "
            f"{_cell(CACHED, '#ddd', '', 'cached')} free but cached, {_cell(EMPTY, '#ddd', '', 'free')} free; "
            f"outline {_cell(EMPTY, SAVE, '', 'save')} saved to the CPU, {_cell(EMPTY, LOAD, '', 'load')} "
            "loaded back</div>"
        )
        return legend + "".join(frame_html(frame) for frame in self.frames)

    def __repr__(self) -> str:
        return f"TierFrames({len(self.frames)} steps, {sum(len(f.loads) for f in self.frames)} blocks loaded)"


def _device_states(manager: Any) -> list[str]:
    """Each device block: held by a request, free but still published, or free."""
    return [
        "held" if b.ref_cnt else "cached" if b.block_hash is not None else "free" for b in manager.block_pool.blocks
    ]


def record_tier_run(engine: Any, rounds: Sequence[Sequence[Sequence[int]]], max_new_tokens: int) -> TierFrames:
    """Run each round of prompts to the end, one step at a time; keep the steps that moved blocks."""
    if engine.tier is None:
        raise ValueError("this engine has no tier: build it with num_cpu_tier_blocks > 0.")
    frames, step = [], 0
    for prompts in rounds:
        for prompt in prompts:
            engine.add_request(prompt, max_new_tokens)
        while engine.has_unfinished_requests():
            engine.step()
            step += 1
            output = engine.core.last_output
            if output is not None and (output.kv_saves or output.kv_loads):
                tier = engine.tier
                used = {entry.slot for entry in tier.entries.values()}
                frames.append(
                    TierFrame(
                        step,
                        _device_states(engine.kv_cache_manager),
                        [slot in used for slot in range(tier.num_blocks)],
                        list(output.kv_saves),
                        list(output.kv_loads),
                        list(output.loading_req_ids),
                    )
                )
    return TierFrames(frames)


__all__ = ["TierFrame", "TierFrames", "frame_html", "record_tier_run"]

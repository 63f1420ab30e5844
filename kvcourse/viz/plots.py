"""Plots of a run: the iteration timeline, KV memory against capacity, and a text memory meter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcourse.engine.llm_engine import Trace


def memory_meter(used: int, capacity: int, width: int = 30, unit: str = "tokens") -> str:
    """A one-line text meter: `[##########----|xxx] 1180/1024 tokens  OVER by 156`."""
    if capacity <= 0:
        raise ValueError(f"capacity is {capacity}; it must be positive.")
    scale = width / max(capacity, used)
    filled = round(min(used, capacity) * scale)
    over = round(max(0, used - capacity) * scale)
    empty = round(capacity * scale) - filled
    bar = "#" * filled + "-" * empty + "|" + "x" * over
    note = f"  OVER by {used - capacity}" if used > capacity else ""
    return f"[{bar}] {used}/{capacity} {unit}{note}"


def _request_colors(ids: Sequence[int]) -> dict[int, Any]:
    """A stable colour per request id."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    return {rid: palette(i % 10) for i, rid in enumerate(sorted(ids))}


def plot_timeline(trace: Trace, ax: Any = None, title: str = "Which request runs in each iteration") -> Any:
    """One row per request, one column per iteration: wide bars prefill chunks, thin ticks decodes, x preemptions."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.45 * max(3, len(trace.requests)) + 1.2))
    ids = sorted({rid for s in trace.steps for rid, _, _ in s.scheduled} | set(trace.requests))
    row = {rid: i for i, rid in enumerate(ids)}
    colors = _request_colors(ids)
    for step in trace.steps:
        for rid, kind, _ in step.scheduled:
            height = 0.8 if kind == "prefill" else 0.3
            ax.broken_barh(
                [(step.iteration - 0.5, 1.0)],
                (row[rid] - height / 2, height),
                facecolors=colors[rid],
                edgecolor="black" if kind == "prefill" else "none",
                linewidth=0.5,
            )
        for rid in step.preempted:
            ax.plot(step.iteration, row[rid], marker="x", color="red", markersize=9, mew=2)
        for rid in step.finished:
            ax.plot(step.iteration + 0.5, row[rid], marker="|", color="black", markersize=12, mew=2)
    ax.set_yticks(range(len(ids)), [f"Req {rid}" for rid in ids])
    ax.invert_yaxis()
    ax.set_xlabel("iteration")
    ax.set_xlim(0.5, len(trace.steps) + 1.0)
    ax.set_title(title)
    legend = [
        Patch(facecolor="lightgray", edgecolor="black", label="prefill chunk (tall)"),
        Patch(facecolor="gray", label="decode (thin)"),
    ]
    if any(s.preempted for s in trace.steps):
        legend.append(plt.Line2D([], [], color="red", marker="x", linestyle="", label="preempted"))
    legend.append(plt.Line2D([], [], color="black", marker="|", linestyle="", markersize=10, label="finished"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


def plot_memory(trace: Trace, capacity_tokens: int, ax: Any = None, title: str = "KV memory the plan needs") -> Any:
    """Resident KV tokens per iteration against the cache's capacity; red where the plan does not fit."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.2))
    xs = [s.iteration for s in trace.steps]
    ys = [s.resident_tokens for s in trace.steps]
    ax.step(xs, ys, where="mid", color="tab:blue", label="resident KV tokens")
    ax.axhline(capacity_tokens, color="black", linestyle="--", label=f"capacity ({capacity_tokens} tokens)")
    over = [y > capacity_tokens for y in ys]
    if any(over):
        ax.fill_between(
            xs, ys, capacity_tokens, where=over, step="mid", color="red", alpha=0.35, label="does not fit (OOM)"
        )
    ax.set_xlabel("iteration")
    ax.set_ylabel("tokens")
    ax.set_ylim(0, max(ys + [capacity_tokens]) * 1.1)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return ax


def plot_hit_rate_curve(
    curves: dict[str, dict[int, float]],
    maxima: dict[str, float] | None = None,
    paper: dict[str, float] | None = None,
    marks: dict[str, int] | None = None,
    ax: Any = None,
    title: str = "Prefix hit rate against cache capacity (request order only)",
) -> Any:
    """Hit rate per trace against capacity in tokens (log scale), the maxima and the paper's figures beside them.

    `curves`: trace name -> {capacity in tokens: hit rate}; `maxima`: the infinite-cache rate per trace
    (dotted); `paper`: the rate the paper reports per trace (a labelled tick at the right edge);
    `marks`: label -> capacity, a vertical line each (e.g. one GPU's worth of KV cache).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    for i, (name, curve) in enumerate(curves.items()):
        color = f"C{i}"
        xs = sorted(curve)
        ax.plot(xs, [100 * curve[x] for x in xs], "o-", color=color, label=f"{name} (this replay)")
        if maxima and name in maxima:
            ax.axhline(100 * maxima[name], color=color, linestyle=":", linewidth=1)
        if paper and name in paper:
            ax.plot([xs[-1]], [100 * paper[name]], marker="*", markersize=13, color=color, linestyle="")
            ax.annotate(
                f"paper: {paper[name]:.0%}",
                (xs[-1], 100 * paper[name]),
                textcoords="offset points",
                xytext=(-70, 6),
                fontsize=8,
                color=color,
            )
    for label, capacity in (marks or {}).items():
        ax.axvline(capacity, color="gray", linestyle="--", linewidth=1)
        ax.text(capacity, 97, f"{label} ", rotation=90, ha="right", va="top", fontsize=8, color="dimgray")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return ax

"""The lessons' diagrams (boxes and arrows): each lesson cell draws one with a single call.

Every function draws one figure and shows it; the arguments are the lesson's data, so a cell reads
as prose plus one call, e.g. `diagrams.block_tables([("request A", [0, 1, 2])], 6, "title")`.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

# Request colours shared by the diagrams of notebooks 03 and 04 (tableau: blue, orange, green, red).
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759"]


# ----------------------------------------------------------------------------- notebook 01
def iteration_batch() -> None:
    """One iteration's batch in a 32-token budget: decodes first, the prefill in progress, a newcomer."""
    fig, ax = plt.subplots(figsize=(9, 1.6))
    segments = [
        ("decode R0", 1, "tab:orange"),
        ("decode R1", 1, "tab:orange"),
        ("decode R2", 1, "tab:orange"),
        ("R3: last 18 prompt tokens", 18, "tab:blue"),
        ("R4: first 11", 11, "tab:cyan"),
    ]
    x = 0
    for label, width, color in segments:
        ax.add_patch(Rectangle((x, 0), width, 1, facecolor=color, edgecolor="black"))
        ax.text(
            x + width / 2,
            0.5 if width > 3 else 1.25,
            label,
            ha="center",
            va="center",
            fontsize=8,
            rotation=0 if width > 3 else 30,
        )
        x += width
    ax.set_xlim(0, 32)
    ax.set_ylim(0, 1.8)
    ax.set_yticks([])
    ax.set_xlabel("the 32 tokens of one forward pass (the token budget)")
    ax.set_title("One iteration: decodes first, then the prefill in progress, then a newcomer")
    plt.show()


# ----------------------------------------------------------------------------- notebook 02
def _role_box(ax, x: float, y: float, w: float, h: float, title: str, lines: list[str], color: str) -> None:
    """A rounded box with a bold title and a few lines of what the role holds."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color, edgecolor="black"))
    ax.text(x + w / 2, y + h - 0.1, title, ha="center", va="top", fontsize=10.5, weight="bold")
    ax.text(x + w / 2, y + h - 0.75, "\n".join(lines), ha="center", va="top", fontsize=8.5)


def _labelled_arrow(ax, start: tuple[float, float], end: tuple[float, float], label: str, dy: float = 0.1) -> None:
    """A straight arrow with its label over the middle."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, color="black"))
    ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + dy, label, ha="center", fontsize=8.5)


def _curved_arrow(ax, start: tuple[float, float], end: tuple[float, float], rad: float) -> None:
    """A grey curved arrow from start to end (rad: how much it bends, and to which side)."""
    ax.add_patch(
        FancyArrowPatch(
            start, end, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>", mutation_scale=14, color="tab:gray"
        )
    )


def _caption(ax, x: float, y: float, text: str) -> None:
    """A small grey label centred at (x, y), for what travels along an arrow."""
    ax.text(x, y, text, ha="center", fontsize=8.5, color="dimgray")


def _show(ax, xlim: tuple[float, float], ylim: tuple[float, float]) -> None:
    """Frame a box-and-arrow diagram, hide its axes, and show it."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")
    plt.show()


def scheduler_cache_executor() -> None:
    """The three parties of a step: the scheduler (policy), the KV-cache manager (mechanism), the executor."""
    fig, ax = plt.subplots(figsize=(11, 3.8))
    _role_box(
        ax,
        0.0,
        0.5,
        2.8,
        1.9,
        "Scheduler\n(policy)",
        [
            "waiting_queue, active_pool",
            "token budget, batch size",
            "who runs, who waits, who is",
            "preempted or rejected",
        ],
        "#fde2c8",
    )
    _role_box(
        ax,
        5.0,
        0.5,
        2.8,
        1.9,
        "KV-cache manager\n(mechanism)",
        ["blocks of block_size tokens", "the free blocks", "a block table per request"],
        "#cfe3f7",
    )
    _role_box(
        ax,
        10.0,
        0.5,
        2.6,
        1.9,
        "Executor\n(the model)",
        ["writes K/V into blocks", "reads them in attention", "samples next tokens"],
        "#d5efd5",
    )
    _labelled_arrow(ax, (2.85, 1.9), (4.95, 1.9), "allocate_slots(req, n)\nfree(req)")
    _labelled_arrow(ax, (4.95, 1.1), (2.85, 1.1), "KVCacheBlocks or None", dy=-0.3)
    _labelled_arrow(ax, (7.85, 1.5), (9.95, 1.5), "block tables")
    _curved_arrow(ax, (1.4, 0.45), (11.3, 0.45), 0.2)
    _caption(ax, 6.35, -0.62, "batch of ScheduledSequence (tokens, positions)")
    _curved_arrow(ax, (11.3, 2.45), (1.4, 2.45), 0.2)
    _caption(ax, 6.35, 3.45, "sampled tokens -> update_from_output(batch, sampled_token_ids)")
    _show(ax, (-0.2, 12.8), (-0.8, 3.7))


def engine_step_loop() -> None:
    """The engine's step (Exercise 1.1): three phases, each guarded, between the scheduler and the executor."""
    fig, ax = plt.subplots(figsize=(11, 2.9))
    phases = [
        (
            "1 schedule",
            ["scheduler.schedule_next_batch()", "-> SchedulerOutput (blocks secured)", "empty: Deadlock"],
            "#fde2c8",
        ),
        (
            "2 execute",
            ["executor.execute(scheduler_output)", "block copies first, then the model", "-> sampled tokens"],
            "#d5efd5",
        ),
        (
            "3 update",
            ["scheduler.update_from_output(", "    scheduler_output, sampled)", "-> the finished requests"],
            "#cfe3f7",
        ),
    ]
    for i, (title, lines, color) in enumerate(phases):
        _role_box(ax, 4.3 * i, 0.4, 3.3, 1.7, title, lines, color)
    _labelled_arrow(ax, (3.35, 1.25), (4.25, 1.25), "the plan")
    _labelled_arrow(ax, (7.65, 1.25), (8.55, 1.25), "sampled")
    _curved_arrow(ax, (10.2, 0.35), (1.6, 0.35), -0.15)
    _caption(ax, 5.9, -0.55, "next iteration (core.iteration + 1)")
    _caption(ax, 5.9, 2.55, "each phase inside core.phase(...): timed, and a fault fails only the requests it touched")
    _show(ax, (-0.2, 12.2), (-0.8, 2.8))


def block_table(table: Sequence[int], num_tokens: int, block_size: int, pool: int) -> None:
    """One request's tokens, grouped into logical blocks, mapped by its block table onto physical blocks."""
    table = list(table)
    fig, ax = plt.subplots(figsize=(11, 3.0))
    for p in range(num_tokens):  # the request's tokens, grouped into logical blocks
        x = p * 0.55 + (p // block_size) * 0.25
        ax.add_patch(Rectangle((x, 2.0), 0.5, 0.5, facecolor="#fde2c8", edgecolor="black"))
        ax.text(x + 0.25, 2.25, str(p), ha="center", va="center", fontsize=8)
    for i, block_id in enumerate(table):
        x = i * (block_size * 0.55 + 0.25) + 1.0
        ax.text(x, 1.55, f"logical {i} -> block {block_id}", ha="center", fontsize=8.5)
    ax.text(-0.1, 2.25, "token positions", ha="right", va="center", fontsize=9)
    ax.text(-0.1, 1.6, "block table", ha="right", va="center", fontsize=9)
    for b in range(pool):  # the physical pool
        x = b * 1.05
        used = b in table
        ax.add_patch(Rectangle((x, 0.2), 0.95, 0.7, facecolor="#cfe3f7" if used else "white", edgecolor="black"))
        if used:
            filled = min(block_size, num_tokens - table.index(b) * block_size)
            for s in range(filled):
                ax.add_patch(Rectangle((x + 0.04 + s * 0.22, 0.28), 0.2, 0.3, facecolor="tab:blue"))
        ax.text(x + 0.475, 0.72, f"block {b}", ha="center", fontsize=7.5)
    ax.text(-0.1, 0.55, "physical blocks", ha="right", va="center", fontsize=9)
    for i, block_id in enumerate(table):
        x0 = i * (block_size * 0.55 + 0.25) + 1.0
        ax.add_patch(
            FancyArrowPatch(
                (x0, 1.5), (block_id * 1.05 + 0.475, 0.95), arrowstyle="-|>", mutation_scale=10, color="gray"
            )
        )
    ax.set_xlim(-1.8, 10.6)
    ax.set_ylim(0, 2.7)
    ax.axis("off")
    last = {0: "all of them full", block_size / 2: "the last one is half full"}.get(
        num_tokens % block_size, "the last one is partly full"
    )
    ax.set_title(
        f"A {num_tokens}-token request with block_size {block_size}: "
        f"{_count(len(table))} blocks, anywhere in the pool; {last}"
    )
    plt.show()


def _count(n: int) -> str:
    """Small numbers in words, as the lesson's titles write them."""
    return {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}.get(n, str(n))


# ----------------------------------------------------------------------------- notebook 03
def _slot_row(ax, y: float, segments, title: str, colors: dict[str, str]) -> None:
    """segments: (start, length, request or None, kind), kind is 'used', 'reserved' or 'free'."""
    for start, length, name, kind in segments:
        color = colors.get(name, "white")
        if kind == "used":
            ax.add_patch(Rectangle((start, y), length, 0.8, color=color))
            if length >= 3:
                ax.text(start + length / 2, y + 0.4, name, ha="center", va="center", color="white", weight="bold")
        elif kind == "reserved":
            ax.add_patch(Rectangle((start, y), length, 0.8, facecolor="white", edgecolor=color, hatch="///"))
        else:
            ax.add_patch(Rectangle((start, y), length, 0.8, facecolor="#eeeeee", edgecolor="#999999"))
    ax.text(-1, y + 0.4, title, ha="right", va="center")


def fragmentation(written: dict[str, int], block_size: int, slots: int = 64) -> None:
    """Contiguous reservations (internal and external fragmentation) against blocks, for requests A–D.

    written: tokens each request has written when D arrives (A, C, D; B has finished by then).
    """
    colors = dict(zip("ABCD", PALETTE))
    contiguous = [
        (0, 9, "A", "used"),
        (9, 11, "A", "reserved"),
        (20, 12, "B", "used"),
        (32, 4, "B", "reserved"),
        (36, 5, "C", "used"),
        (41, 7, "C", "reserved"),
        (48, 16, None, "free"),
    ]
    b_done = sorted([s for s in contiguous if s[2] != "B"] + [(20, 16, None, "free")])  # B's region is a hole now
    paged, owners = [], ["A"] * 3 + ["C"] * 2 + ["D"] * 5  # blocks in the order they were handed out
    for i, name in enumerate(owners):
        used = min(block_size, written[name] - block_size * owners[:i].count(name))
        paged.append((i * block_size, used, name, "used"))
        if used < block_size:
            paged.append((i * block_size + used, block_size - used, name, "reserved"))
    paged.append((len(owners) * block_size, slots - len(owners) * block_size, None, "free"))

    fig, ax = plt.subplots(figsize=(10, 3.4))
    _slot_row(ax, 2, contiguous, "contiguous:\nA, B, C reserve their maximum", colors)
    _slot_row(ax, 1, b_done, "B finishes: 32 slots free,\nbut D needs 20 in one piece", colors)
    _slot_row(ax, 0, paged, f"paged (blocks of {block_size}):\nD fits, waste only in last blocks", colors)
    for x in range(0, slots + 1, block_size):
        ax.plot([x, x], [0, 0.8], color="white", lw=1)
    ax.annotate(
        "external fragmentation:\ntwo holes of 16", xy=(28, 1.4), xytext=(28, 1.4), ha="center", va="center", fontsize=8
    )
    ax.set_xlim(-22, slots + 1)
    ax.set_ylim(-0.3, 3)
    ax.set_yticks([])
    ax.set_xticks(range(0, slots + 1, 16))
    ax.set_xlabel("KV memory (token slots)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(
        handles=[
            Rectangle((0, 0), 1, 1, color="#4e79a7", label="token states"),
            Rectangle(
                (0, 0),
                1,
                1,
                facecolor="white",
                edgecolor="k",
                hatch="///",
                label="reserved, never written (internal fragmentation)",
            ),
            Rectangle((0, 0), 1, 1, facecolor="#eeeeee", edgecolor="#999", label="free"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28),
        ncol=3,
        frameon=False,
        fontsize=8,
    )
    fig.tight_layout()
    plt.show()


def _queue_row(ax, labels: Sequence[str], y: float, title: str, highlight: str | None = None) -> None:
    """Boxes linked both ways: the head sentinel, the free blocks front to back, the tail sentinel."""
    for i, label in enumerate(labels):
        sentinel = label in ("head", "tail")
        color = "#eeeeee" if sentinel else ("#e15759" if label == highlight else "#4e79a7")
        ax.add_patch(FancyBboxPatch((i * 1.6, y), 1, 0.6, boxstyle="round,pad=0.05", facecolor=color, edgecolor="#333"))
        ax.text(
            i * 1.6 + 0.5,
            y + 0.3,
            label,
            ha="center",
            va="center",
            color="#333" if sentinel else "white",
            weight="bold",
        )
        if i + 1 < len(labels):
            ax.annotate(
                "", xy=(i * 1.6 + 1.6, y + 0.42), xytext=(i * 1.6 + 1.05, y + 0.42), arrowprops=dict(arrowstyle="->")
            )
            ax.annotate(
                "",
                xy=(i * 1.6 + 1.05, y + 0.18),
                xytext=(i * 1.6 + 1.6, y + 0.18),
                arrowprops=dict(arrowstyle="->", color="#888"),
            )
    ax.text(-0.3, y + 0.3, title, ha="right", va="center")


def free_queue_remove() -> None:
    """The doubly linked free-block queue before and after removing a block from its middle."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    _queue_row(ax, ["head", "b0", "b1", "b3", "b2", "tail"], 1.2, "free queue\n(front = reused first)", highlight="b3")
    _queue_row(ax, ["head", "b0", "b1", "b2", "tail"], 0, "after remove(b3):\nb1.next = b2, b2.prev = b1")
    ax.text(4.8, 2.0, "next →   ← prev", ha="center", fontsize=9, color="#555")
    ax.set_xlim(-4.2, 9.8)
    ax.set_ylim(-0.2, 2.2)
    ax.axis("off")
    fig.tight_layout()
    plt.show()


# ----------------------------------------------------------------------------- notebook 04
def _label_box(ax, x, y, text, color, text_color="white", width=1.0, dashed=False) -> None:
    """One rounded box with a centred label."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            width,
            0.6,
            boxstyle="round,pad=0.04",
            facecolor=color,
            edgecolor="#333",
            linestyle="--" if dashed else "-",
        )
    )
    ax.text(x + width / 2, y + 0.3, text, ha="center", va="center", color=text_color, fontsize=9, weight="bold")


def _draw_tables(ax, tables, num_blocks: int, title: str, note: str = "") -> None:
    """Block tables (one row per request) pointing into a row of physical blocks labelled with ref counts."""
    refs = [sum(table.count(b) for _, table in tables) for b in range(num_blocks)]
    for b in range(num_blocks):
        free = refs[b] == 0
        _label_box(ax, b * 1.3, 0, f"{b}", "#dddddd" if free else "#777777", "#333" if free else "white")
        if refs[b]:
            ax.text(b * 1.3 + 0.5, -0.3, f"ref {refs[b]}", ha="center", fontsize=8)
    for row, (name, table) in enumerate(tables):
        y = 1.6 + row * 1.0
        ax.text(-0.3, y + 0.3, name, ha="right", va="center", fontsize=9, color=PALETTE[row])
        for i, b in enumerate(table):
            _label_box(ax, i * 1.3, y, f"{i}→{b}", PALETTE[row])
            ax.annotate(
                "",
                xy=(b * 1.3 + 0.5, 0.62),
                xytext=(i * 1.3 + 0.5, y - 0.02),
                arrowprops=dict(arrowstyle="->", color=PALETTE[row], alpha=0.6),
            )
    ax.text(-0.3, 0.3, "physical\nblocks", ha="right", va="center", fontsize=9)
    ax.set_title(title, fontsize=10)
    if note:
        ax.text(num_blocks * 0.65, -0.8, note, ha="center", fontsize=8, color="#555")
    ax.set_xlim(-2.2, num_blocks * 1.3)
    ax.set_ylim(-1.0, 1.9 + len(tables))
    ax.axis("off")


def block_tables(tables: list[tuple[str, list[int]]], num_blocks: int, title: str, note: str = "") -> None:
    """Requests' block tables pointing into the physical blocks, each block with its reference count."""
    fig, ax = plt.subplots(figsize=(9, 3))
    _draw_tables(ax, tables, num_blocks, title, note)
    plt.show()


def hash_chain() -> None:
    """Two prompts whose first two blocks chain to the same hashes and whose third blocks differ."""
    fig, ax = plt.subplots(figsize=(10, 2.6))
    rows = [
        ("prompt A", ["12 7 99 3", "5 5 41 8", "77 2 9 60"], ["h1", "h2", "h3"]),
        ("prompt B", ["12 7 99 3", "5 5 41 8", "31 4 4 18"], ["h1", "h2", "h3'"]),
    ]
    for row, (name, blocks, hashes) in enumerate(rows):
        y = 1.4 - row * 1.3
        ax.text(-0.2, y + 0.3, name, ha="right", va="center", fontsize=9)
        for i, (tokens, h) in enumerate(zip(blocks, hashes)):
            shared = row == 1 and i < 2
            _label_box(ax, i * 3.2, y, tokens, PALETTE[row] if not shared else PALETTE[0], width=1.6)
            _label_box(ax, i * 3.2 + 1.9, y, h, "#555555", width=0.8)
            parent = "None" if i == 0 else hashes[i - 1]
            ax.text(i * 3.2 + 1.6, y + 0.75, f"{h} = H({parent}, tokens)", fontsize=7, ha="center")
    ax.text(
        4.8,
        -0.5,
        "same tokens, same parents: same hashes h1, h2 (B can reuse A's blocks); "
        "the third blocks differ, and so would every block after them",
        ha="center",
        fontsize=8,
        color="#555",
    )
    ax.set_xlim(-2, 10)
    ax.set_ylim(-0.7, 2.4)
    ax.axis("off")
    plt.show()


def eviction_order() -> None:
    """The free queue as the eviction order: never-cached blocks first, then each request's tail before its head."""
    fig, ax = plt.subplots(figsize=(10, 1.6))
    queue = [
        ("9", "#dddddd", False),
        ("10", "#dddddd", False),
        ("B:5", PALETTE[1], True),
        ("B:4", PALETTE[1], True),
        ("A:3", PALETTE[0], True),
        ("A:2", PALETTE[0], True),
        ("A:1", PALETTE[0], True),
        ("A:0", PALETTE[0], True),
    ]
    for i, (label, color, cached) in enumerate(queue):
        _label_box(ax, i * 1.25, 0, label, color, "#333" if not cached else "white", dashed=cached)
    ax.text(-0.4, 0.3, "front:\nreused first", ha="right", va="center", fontsize=8)
    ax.text(len(queue) * 1.25, 0.3, "back:\nreused last", ha="left", va="center", fontsize=8)
    ax.text(
        5,
        -0.45,
        "never-cached blocks go first, then B's and A's blocks, each request's tail before its head "
        "(dashed: still cached, still hittable)",
        ha="center",
        fontsize=8,
        color="#555",
    )
    ax.set_xlim(-2.2, 11.5)
    ax.set_ylim(-0.7, 0.8)
    ax.axis("off")
    plt.show()


def copy_on_write() -> None:
    """Fork shares every block; the first write into the shared, partly full block copies it."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 2.8))
    _draw_tables(
        left,
        [("parent", [0, 1, 2]), ("child", [0, 1, 2])],
        5,
        "after fork: everything shared",
        "block 2 is partly full: both will write into it next",
    )
    _draw_tables(
        right,
        [("parent", [0, 1, 2]), ("child", [0, 1, 3])],
        5,
        "the child writes: copy-on-write",
        "block 2 copied to 3 (pair (2, 3) for the executor); the parent now writes 2 in place",
    )
    fig.tight_layout()
    plt.show()


# ----------------------------------------------------------------------------- notebook 05
def paged_cache_from_above(
    tables: dict[str, list[int]], lengths: dict[str, int], block_size: int, num_blocks: int
) -> None:
    """One layer's key cache seen from above: each cell one token's vectors, requests scattered over blocks."""
    colors = dict(zip(tables, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for block in range(num_blocks):
        for offset in range(block_size):
            ax.add_patch(plt.Rectangle((offset, block), 1, 1, fill=False, ec="lightgray"))
    for name, table in tables.items():
        for pos in range(lengths[name]):
            block, offset = table[pos // block_size], pos % block_size
            ax.add_patch(plt.Rectangle((offset, block), 1, 1, color=colors[name], alpha=0.6))
            ax.text(offset + 0.5, block + 0.5, f"{name}{pos}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, block_size)
    ax.set_ylim(num_blocks, 0)
    ax.set_xticks([o + 0.5 for o in range(block_size)], range(block_size))
    ax.set_yticks([b + 0.5 for b in range(num_blocks)], range(num_blocks))
    ax.set_xlabel("offset in the block")
    ax.set_ylabel("physical block id")
    ax.set_title("key_cache[num_blocks, block_size, H, D], seen from above")
    legend = "\n".join(f"{n}: {lengths[n]:>2} tokens, table {t}" for n, t in tables.items())
    fig.text(0.64, 0.5, "Block tables\n\n" + legend, va="center", family="monospace")
    fig.subplots_adjust(right=0.6)
    plt.show()

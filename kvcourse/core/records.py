"""What a step did and why a run stopped: the records every engine step yields, and the stall error.

A leaf module (it imports only the request and the contract): the engine loop, the toy runner, the
notebooks' plots and the learner's `engine_step` (kvcourse/step.py) all read these without importing
each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcourse.core.request import Request

if TYPE_CHECKING:
    from kvcourse.core.contract import SchedulerProtocol

# The parts of a step, timed (EngineStats.step_seconds), and how a fault report names each (EngineCore.phase).
PHASE_LABELS = {"schedule": "scheduling", "execute": "the executor (the model)", "update": "update_from_output"}
PHASES = tuple(PHASE_LABELS)


# ----------------------------------------------------------------------------------------------
# What a step did: one record type for the toy world and the GPT-2 engine
# ----------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """What one iteration did, for printing and plotting."""

    iteration: int
    scheduled: list[tuple[int, str, int]]  # (request id, "prefill" or "decode", tokens fed)
    positions: list[tuple[int, int]]  # (first, last) position of each scheduled sequence
    samples: list[bool]  # whether each scheduled sequence sampled a token
    resident_tokens: int  # tokens whose K/V the running requests hold during this step
    num_free_blocks: int | None  # after the step (None for a scheduler without a KV manager)
    preempted: list[int]  # request ids preempted while planning this step
    num_preemptions: int  # total so far
    finished: list[int]  # request ids finished by this step
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase (see PHASES)

    @property
    def num_tokens(self) -> int:
        """Tokens fed in this step (at most the token budget)."""
        return sum(n for _, _, n in self.scheduled)

    def __str__(self) -> str:
        """One readable line (see format_step)."""
        return format_step(self)


@dataclass
class Trace:
    """Everything a run did, step by step, plus the requests it saw."""

    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[int, Request] = field(default_factory=dict)
    capacity_blocks: int | None = None
    block_size: int | None = None

    @property
    def num_preemptions(self) -> int:
        """Preemptions over the whole run."""
        return self.steps[-1].num_preemptions if self.steps else 0

    @property
    def peak_resident_tokens(self) -> int:
        """The most KV the running requests held at once."""
        return max((s.resident_tokens for s in self.steps), default=0)

    def outputs(self) -> dict[int, list[int]]:
        """Every seen request's generated tokens, by id."""
        return {rid: list(r.output_tokens) for rid, r in sorted(self.requests.items())}

    def format(self, limit: int | None = None) -> str:
        """One readable line per iteration (the first `limit` ones when given)."""
        steps = self.steps if limit is None else self.steps[:limit]
        lines = [format_step(step) for step in steps]
        if limit is not None and len(self.steps) > limit:
            lines.append(f"... {len(self.steps) - limit} more iterations")
        return "\n".join(lines)

    def __iter__(self) -> Iterator[StepRecord]:
        """The steps, so `print(*engine.trace, sep="\\n")` prints one line each."""
        return iter(self.steps)

    def __len__(self) -> int:
        """Number of steps recorded."""
        return len(self.steps)


def format_step(step: StepRecord) -> str:
    """`it  3 | R0 decode @15 | R1 prefill 16 @0-15 | free 93` (* = samples a token)."""
    parts = []
    for (rid, kind, n), (first, last), samples in zip(step.scheduled, step.positions, step.samples):
        where = f"@{first}" if first == last else f"@{first}-{last}"
        size = "" if kind == "decode" else f" {n}"
        parts.append(f"R{rid} {kind}{size} {where}{'*' if samples and kind != 'decode' else ''}")
    line = f"it {step.iteration:>3} | " + (", ".join(parts) if parts else "nothing scheduled")
    if step.num_free_blocks is not None:
        line += f" | free {step.num_free_blocks}"
    if step.preempted:
        line += f" | preempted {', '.join(f'R{r}' for r in step.preempted)}"
    if step.finished:
        line += f" | finished {', '.join(f'R{r}' for r in step.finished)}"
    return line


class Deadlock(RuntimeError):
    """The scheduler planned an empty step while requests were unfinished: nothing can ever change."""

    trace: Trace | None = None  # the steps before the stall (set by `kvcourse.toy.run`)


class BatchContractError(RuntimeError):
    """The scheduler returned a batch entry for a request that is not running (a scheduler bug)."""


def describe_stall(scheduler: SchedulerProtocol, iteration: int) -> str:
    """Why the run cannot go on, in words a learner can act on."""
    running = list(scheduler.active_pool)
    waiting = [r.id for r in scheduler.waiting_queue]
    manager = scheduler.kv_cache_manager
    free = f"; {manager.get_num_free_blocks()} of {manager.num_blocks} blocks free" if manager is not None else ""
    head = (
        f"iteration {iteration}: the scheduler planned an empty batch with requests unfinished "
        f"(running {running}, waiting {waiting}{free})"
    )
    if running and manager is not None and manager.get_num_free_blocks() > 0:
        return (
            f"{head}: blocks are free, yet no running request was given anything to do. Does every "
            "running request land in exactly one pass: a decode once its prompt is cached, else the "
            "prefill pass (a request recomputing after a preemption has output tokens to re-feed too: "
            "see request.is_prefill_done and num_uncomputed_tokens)? The next step would be the same."
        )
    if running:
        return (
            f"{head}: each running request needs one more block, only another running request could "
            "give one back, and none of them can run to the end to do so. The next step would be the "
            "same: a deadlock."
        )
    return (
        f"{head}: nothing is running and nothing was admitted. A correct scheduler moves its oldest "
        "request forward every step; is a request that can never fit the cache in the way?"
    )


__all__ = [
    "PHASES",
    "PHASE_LABELS",
    "BatchContractError",
    "Deadlock",
    "StepRecord",
    "Trace",
    "describe_stall",
    "format_step",
]

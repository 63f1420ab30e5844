"""What one step planned, handed down whole: vLLM's `SchedulerOutput` (vllm/v1/core/sched/output.py), in miniature.

The scheduler fills one `SchedulerOutput` per step; the executor takes it whole (tokens, positions,
block tables, the block copies to make first) and `update_from_output(scheduler_output, sampled)`
closes the step with it. Nothing downstream asks the KV-cache manager again or diffs counters.

The source lesson's loop still reads it as a batch: `if not batch`, `len(batch)`, `for seq in batch`
and `batch[0]` go over the scheduled sequences.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class ScheduledSequence:
    """One request's share of a step: the tokens to feed and the position of the first one."""

    request_id: int
    tokens: list[int]
    is_decode: bool
    position_ids_start: int
    samples_token: bool = False  # True when this chunk reaches the request's num_tokens (always for a decode)

    def __post_init__(self) -> None:
        """A decode always samples: that is what a decode is for."""
        if self.is_decode:
            self.samples_token = True

    @property
    def positions(self) -> range:
        """Positions of the fed tokens in the request's sequence (what the model's position ids are)."""
        return range(self.position_ids_start, self.position_ids_start + len(self.tokens))


@dataclass
class SchedulerOutput:
    """Everything one step planned: the sequences, their blocks, the copies to make first, who left."""

    scheduled_seqs: list[ScheduledSequence] = field(default_factory=list)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)  # request id -> tokens fed this step
    block_ids: dict[int, list[int]] | None = None  # request id -> its block table (None: a memory-blind scheduler)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)  # the blocks allocate_slots added this step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the model
    preempted_req_ids: list[int] = field(default_factory=list)  # preempted while planning this step
    finished_req_ids: list[int] = field(default_factory=list)  # settled since the previous step (free their state)
    swapped_out: dict[int, int] = field(default_factory=dict)  # swap mode: request id -> tokens whose K/V went out
    swapped_in: dict[int, int] = field(default_factory=dict)  # swap mode: request id -> tokens whose K/V came back
    kv_saves: list[tuple[int, int]] = field(default_factory=list)  # second tier: (device block, CPU slot), first
    kv_loads: list[tuple[int, int]] = field(default_factory=list)  # second tier: (CPU slot, device block), then
    loading_req_ids: list[int] = field(default_factory=list)  # WAITING_FOR_REMOTE_KVS: their blocks load this step
    total_num_scheduled_tokens: int = field(init=False, default=0)  # tokens fed in this step (kept up to date)

    def __post_init__(self) -> None:
        """Count the tokens a plan was built with (add and remove keep the count from then on)."""
        self.total_num_scheduled_tokens = sum(self.num_scheduled_tokens.values())

    def add(self, sequence: ScheduledSequence, new_block_ids: list[int] | None = None) -> None:
        """Plan one request's sequence (each request at most once per step)."""
        if sequence.request_id in self.num_scheduled_tokens:
            raise ValueError(f"request {sequence.request_id} is already in this step's plan: schedule it once.")
        self.scheduled_seqs.append(sequence)
        self.num_scheduled_tokens[sequence.request_id] = len(sequence.tokens)
        self.total_num_scheduled_tokens += len(sequence.tokens)
        if new_block_ids:
            self.new_block_ids[sequence.request_id] = list(new_block_ids)

    def remove(self, request_id: int) -> None:
        """Take a request out of the plan (preempted later in the same step): its budget comes back."""
        self.scheduled_seqs = [s for s in self.scheduled_seqs if s.request_id != request_id]
        self.total_num_scheduled_tokens -= self.num_scheduled_tokens.pop(request_id, 0)
        self.new_block_ids.pop(request_id, None)
        if self.block_ids is not None:
            self.block_ids.pop(request_id, None)

    def __iter__(self) -> Iterator[ScheduledSequence]:
        """The scheduled sequences, in plan order (the source lesson's `for seq in batch`)."""
        return iter(self.scheduled_seqs)

    def __len__(self) -> int:
        """Number of scheduled sequences; an empty plan is falsy (`if not batch`)."""
        return len(self.scheduled_seqs)

    def __bool__(self) -> bool:
        """A plan is empty when it feeds nothing and loads nothing (an empty plan is a stall)."""
        return bool(self.scheduled_seqs or self.loading_req_ids or self.kv_saves or self.kv_loads)

    def __getitem__(self, index: int) -> ScheduledSequence:
        """`batch[0]`: one scheduled sequence."""
        return self.scheduled_seqs[index]


__all__ = ["ScheduledSequence", "SchedulerOutput"]

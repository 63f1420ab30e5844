"""The model runner: turn a scheduler batch into GPT-2's inputs, run one forward pass, sample greedily.

Like nano-vllm's ModelRunner and vLLM v1's GPU model runner, it packs every scheduled token of
every sequence into one row (no padding) and describes the row with a few small tensors:

    input_ids, positions, slot_mapping   [T]       one entry per scheduled token
    block_tables                         [B, max_blocks] int32, rows padded with 0 (never read)
    seq_lens                             [B]       tokens in the cache once this step has run
    query_start_loc                      [B + 1]   where each sequence's tokens start in the row
    logits_indices                       [B]       each sequence's last token: where we sample
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcourse.paged_cache import ATTENTION_IMPLEMENTATIONS, PagedKVCache


class ScheduledSequenceLike(Protocol):
    """What the runner reads from the scheduler's ScheduledSequence."""

    request_id: int
    tokens: list[int]
    is_decode: bool
    position_ids_start: int


@dataclass
class ModelInputs:
    """Everything one forward pass needs, for all scheduled sequences at once."""

    request_ids: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor

    def attention_kwargs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments that reach PagedKVCache.update and the attention function."""
        return {
            "slot_mapping": self.slot_mapping,
            "block_tables": self.block_tables,
            "seq_lens": self.seq_lens,
            "query_start_loc": self.query_start_loc,
        }


def prepare_inputs(
    batch: Sequence[ScheduledSequenceLike],
    block_tables: dict[int, list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> ModelInputs:
    """Describe a batch to the model: where each token sits in its sequence and where its K/V go."""
    if not batch:
        raise ValueError("the batch is empty: there is nothing to run.")
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    for seq in batch:
        if seq.request_id not in block_tables:
            raise ValueError(f"no block table for request {seq.request_id}: allocate its slots before running it.")
        table = block_tables[seq.request_id]
        if len(table) * block_size < seq.position_ids_start + len(seq.tokens):
            raise ValueError(
                f"request {seq.request_id}'s block table {table} is too short for its tokens up to position "
                f"{seq.position_ids_start + len(seq.tokens) - 1}: allocate its slots before running it."
            )
        # Exercise 5.5: this sequence's tokens sit at positions position_ids_start,
        # position_ids_start + 1, ... (the tokens before them are already in the cache). Position p
        # lives in logical block p // block_size, at offset p % block_size; its slot is the physical
        # block id from the table times block_size plus the offset. After this step the cache holds
        # seq_len tokens of this sequence. Set seq_positions, seq_slots (one per token) and seq_len.
        # TODO: Exercise 5.5: write your code here, then delete the raise below.
        raise NotImplementedError(
            "Exercise 5.5 (Model-runner inputs): not written yet: edit kvcourse/model_runner.py, prepare_inputs."
        )
        input_ids += seq.tokens
        positions += seq_positions
        slot_mapping += seq_slots
        seq_lens.append(seq_len)
        query_start_loc.append(query_start_loc[-1] + len(seq.tokens))
    width = max(len(block_tables[seq.request_id]) for seq in batch)
    padded = [block_tables[seq.request_id] + [0] * (width - len(block_tables[seq.request_id])) for seq in batch]
    return ModelInputs(
        request_ids=[seq.request_id for seq in batch],
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        logits_indices=torch.tensor(query_start_loc[1:], dtype=torch.long, device=device) - 1,
    )


class ModelRunner:
    """Owns the paged KV storage and runs GPT-2 on scheduler batches (nano-vllm's ModelRunner)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, attention: str = "reference") -> None:
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {sorted(ATTENTION_IMPLEMENTATIONS)}; got {attention!r}.")
        self.model = model.eval()
        self.block_size = block_size
        self.attn_implementation = ATTENTION_IMPLEMENTATIONS[attention]
        self.kv_cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.device = next(model.parameters()).device

    @contextlib.contextmanager
    def paged_attention(self) -> Iterator[None]:
        """Route the model's attention to ours for a while, then restore it (the model stays usable elsewhere)."""
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.attn_implementation)
        try:
            yield
        finally:
            self.model.set_attn_implementation(previous)

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledSequenceLike], block_tables: dict[int, list[int]]) -> dict[int, int]:
        """One forward pass over the batch; the greedy next token after each sequence's last scheduled token."""
        inputs = prepare_inputs(batch, block_tables, self.block_size, self.device)
        with self.paged_attention():
            logits = self.model(
                input_ids=inputs.input_ids[None],
                position_ids=inputs.positions[None],
                cache=self.kv_cache,
                use_cache=True,
                logits_to_keep=inputs.logits_indices,
                **inputs.attention_kwargs(),
            ).logits[0]  # [B, vocab]
        return dict(zip(inputs.request_ids, logits.argmax(dim=-1).tolist()))

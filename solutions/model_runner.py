"""The model runner's inputs: turn a step's plan into the model's token row (the runner itself: kvcourse/worker/model_runner.py).

Like nano-vllm's ModelRunner and vLLM v1's GPU model runner, it packs every scheduled token of
every sequence into one row (no padding) and describes the row with a few small tensors:

    input_ids, positions, slot_mapping   [T]       one entry per scheduled token
    block_tables                         [B, max_blocks] int32, rows padded with 0 (never read)
    seq_lens                             [B]       tokens in the cache once this step has run
    query_start_loc                      [B + 1]   where each sequence's tokens start in the row
    logits_indices                       [B]       each sequence's last token: where we sample
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvcourse.core.contract import ScheduledSequenceProtocol
from kvcourse.worker.model_runner_utils import ModelInputs


def token_layout(
    table: torch.Tensor, starts: torch.Tensor, num_tokens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each scheduled token's position and cache slot, and each sequence's cached length after the step."""
    # Exercise 5.5: with tensor operations only (no Python loop over tokens), return for the T
    # scheduled tokens, sequence after sequence:
    #   positions [T]:    sequence b's tokens sit at starts[b], starts[b] + 1, ... (the tokens before
    #                     them are already in the cache);
    #   slot_mapping [T]: position p of sequence b lives in logical block p // block_size at offset
    #                     p % block_size; its slot is table[b, that block] * block_size + the offset;
    #   seq_lens [B]:     how many tokens each sequence has in the cache once this step has run.
    # Inputs: table [B, width] (each sequence's block table, padded with 0), starts [B], num_tokens [B]
    # and query_start_loc [B + 1] (where each sequence's tokens begin in the row; query_start_loc[-1]
    # == T). All are int64 tensors. torch.repeat_interleave turns a per-sequence tensor into a
    # per-token one.
    # BEGIN SOLUTION 5.5
    seq_of_token = torch.repeat_interleave(torch.arange(len(starts)), num_tokens)  # [T]: each token's sequence
    offset_in_chunk = torch.arange(int(query_start_loc[-1])) - query_start_loc[seq_of_token]
    positions = starts[seq_of_token] + offset_in_chunk
    slot_mapping = table[seq_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = starts + num_tokens
    return positions, slot_mapping, seq_lens
    # END SOLUTION


def prepare_inputs(
    batch: Sequence[ScheduledSequenceProtocol],
    block_tables: dict[int, list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> ModelInputs:
    """Describe a batch to the model: where each token sits in its sequence and where its K/V go."""
    if not batch:
        raise ValueError("the batch is empty: there is nothing to run.")
    tables = [_block_table(seq, block_tables, block_size) for seq in batch]
    width = max(map(len, tables))
    # Per sequence (never per token): its block table padded with 0, its first position, its token count.
    table = torch.tensor([row + [0] * (width - len(row)) for row in tables], dtype=torch.long)  # [B, width]
    starts = torch.tensor([seq.position_ids_start for seq in batch], dtype=torch.long)  # [B]
    num_tokens = torch.tensor([len(seq.tokens) for seq in batch], dtype=torch.long)  # [B]
    query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.long)
    torch.cumsum(num_tokens, dim=0, out=query_start_loc[1:])
    positions, slot_mapping, seq_lens = token_layout(table, starts, num_tokens, query_start_loc, block_size)
    input_ids = torch.tensor(list(itertools.chain.from_iterable(seq.tokens for seq in batch)), dtype=torch.long)
    return ModelInputs(
        request_ids=[seq.request_id for seq in batch],
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        block_tables=table.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        logits_indices=(query_start_loc[1:] - 1).to(device),
    )


def _block_table(seq: ScheduledSequenceProtocol, block_tables: dict[int, list[int]], block_size: int) -> list[int]:
    """The sequence's block table, refused in words when it cannot hold this step's tokens."""
    if seq.request_id not in block_tables:
        raise ValueError(f"no block table for request {seq.request_id}: allocate its slots before running it.")
    table = block_tables[seq.request_id]
    if len(table) * block_size < seq.position_ids_start + len(seq.tokens):
        raise ValueError(
            f"request {seq.request_id}'s block table {table} is too short for its tokens up to position "
            f"{seq.position_ids_start + len(seq.tokens) - 1}: allocate its slots before running it."
        )
    if not seq.tokens:
        raise ValueError(f"request {seq.request_id} is scheduled with no tokens: schedule at least one.")
    return table

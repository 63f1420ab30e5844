# kvcourse/model_runner.py holds exercise 5.5: write only inside its TODO region (the rest is given).
"""The model runner: turn a scheduler batch into GPT-2's inputs, run one forward pass, sample (kvcourse/sampler.py).

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
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kvcourse.backends.fast import FastAttentionMetadata
from kvcourse.backends.packed import can_pack, packed_weights, why_not_packable
from kvcourse.contract import ScheduledSequenceProtocol
from kvcourse.model_runner_utils import ModelInputs, RunnerTimings
from kvcourse.paged_cache import ATTENTION_IMPLEMENTATIONS, DEFAULT_ATTENTION, AttentionTimer, PagedKVCache
from kvcourse.sampler import Sampler

if TYPE_CHECKING:
    from kvcourse.sched_output import SchedulerOutput


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
    # TODO: Exercise 5.5: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 5.5 (Model-runner inputs): not written yet: edit kvcourse/model_runner.py, token_layout."
    )


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


class ModelRunner:
    """Owns the paged KV storage and runs GPT-2 on scheduler batches (nano-vllm's ModelRunner)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        attention: str | None = None,  # None: DEFAULT_ATTENTION (kvcourse/paged_cache.py), as LLMEngine
        *,
        synchronize_timings: bool = False,
        pack_weights: bool | None = None,
    ) -> None:
        attention = DEFAULT_ATTENTION if attention is None else attention
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {sorted(ATTENTION_IMPLEMENTATIONS)}; got {attention!r}.")
        self.model = model.eval()
        self.block_size = block_size
        self.attention = attention
        self.attn_implementation = ATTENTION_IMPLEMENTATIONS[attention]
        self.kv_cache = PagedKVCache.for_model(model, num_blocks, block_size)
        self.device = next(model.parameters()).device
        self.timings = RunnerTimings()
        self.sampler = Sampler()  # each request's SamplingParams (LLMEngine registers them); greedy by default
        self._attention_timer = AttentionTimer()
        self.synchronize_timings = synchronize_timings
        # None: pack where it pays (CPU, float32, GPT-2 small and wider); the packed copy costs the weights' size in memory once more.
        if pack_weights is None:
            pack_weights = can_pack(model)
        elif pack_weights and (reason := why_not_packable(model)):
            raise ValueError(f"pack_weights=True, but {reason}: leave pack_weights=None to pack only where it pays.")
        self.packed_weights = packed_weights(model) if pack_weights else None

    @contextlib.contextmanager
    def paged_attention(self) -> Iterator[None]:
        """Route the model's attention (and its linear layers, when packed) to ours for a while, then restore it."""
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.attn_implementation)
        packed = self.packed_weights.active() if self.packed_weights else contextlib.nullcontext()
        try:
            with packed:
                yield
        finally:
            self.model.set_attn_implementation(previous)

    @torch.inference_mode()
    def copy_blocks(self, blocks_to_copy: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block dst gets src's keys and values in every layer, before the model reads the cache."""
        for src, dst in blocks_to_copy:
            for layer in self.kv_cache.layers:
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> dict[int, int]:
        """Run one step's plan: its block copies first, then one forward pass over its sequences."""
        self.copy_blocks(scheduler_output.blocks_to_copy)
        return self.execute_batch(scheduler_output.scheduled_seqs, scheduler_output.block_ids)

    def execute_batch(
        self, batch: Sequence[ScheduledSequenceProtocol], block_tables: dict[int, list[int]]
    ) -> dict[int, int]:
        """One forward pass over the batch; the next token of each sequence that samples (its request's SamplingParams; greedy by default).

        A sequence samples when its samples_token says so (the scheduler sets it: False for a prefill
        chunk that does not reach the end of its prompt); logits are computed only there.
        """
        t0 = self._now()
        inputs = prepare_inputs(batch, block_tables, self.block_size, self.device)
        sampling = [i for i, seq in enumerate(batch) if seq.samples_token]
        kwargs = inputs.attention_kwargs()
        if self.attention == "fast":
            kwargs["fast_metadata"] = FastAttentionMetadata.build(
                inputs.block_tables, inputs.seq_lens, inputs.query_start_loc, self.block_size
            )
        keep = inputs.logits_indices[sampling] if len(sampling) < len(batch) else inputs.logits_indices
        t1 = self._now()
        attention_before = self._attention_timer.seconds
        with self.paged_attention():
            logits = self.model(
                input_ids=inputs.input_ids[None],
                position_ids=inputs.positions[None],
                cache=self.kv_cache,
                use_cache=True,
                logits_to_keep=keep,
                attention_timer=self._attention_timer,
                **kwargs,
            ).logits[0]  # [sampling sequences, vocab]
        t2 = self._now()
        tokens = self.sampler(logits, [inputs.request_ids[i] for i in sampling]) if sampling else []
        t3 = self._now()
        self._record(t0, t1, t2, t3, self._attention_timer.seconds - attention_before)
        return {inputs.request_ids[i]: token for i, token in zip(sampling, tokens)}

    @property
    def synchronize_timings(self) -> bool:
        """On a GPU, wait for the kernels at each timing point, so the timings are theirs and not their launches'."""
        return self._attention_timer.synchronize

    @synchronize_timings.setter
    def synchronize_timings(self, on: bool) -> None:
        self._attention_timer.synchronize = bool(on) and self.device.type == "cuda"

    def _now(self) -> float:
        """A timestamp (after the queued GPU work when timings are synchronized)."""
        if self.synchronize_timings:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _record(self, t0: float, t1: float, t2: float, t3: float, attention_seconds: float) -> None:
        """Add one step's parts to the running timings."""
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.attention += attention_seconds
        self.timings.sample += t3 - t2
        self.timings.steps += 1

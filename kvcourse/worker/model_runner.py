"""The model runner's given half: it owns the paged KV storage and runs the model on a step's plan.

The learner's half (kvcourse/model_runner.py: `prepare_inputs` and Exercise 5.5's `token_layout`) turns a
plan into the model's inputs; this class runs one forward pass through the paged cache and samples.
vLLM: `GPUModelRunner` (vllm/v1/worker/gpu/model_runner.py); nano-vllm: its `ModelRunner` class.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kvcourse.backends.fast import FastAttentionMetadata
from kvcourse.backends.packed import can_pack, packed_weights, why_not_packable
from kvcourse.core.contract import ScheduledSequenceProtocol
from kvcourse.model_runner import prepare_inputs
from kvcourse.worker.model_runner_utils import RunnerTimings
from kvcourse.worker.paged_cache import ATTENTION_IMPLEMENTATIONS, DEFAULT_ATTENTION, AttentionTimer, PagedKVCache
from kvcourse.worker.sampler import Sampler

if TYPE_CHECKING:
    from kvcourse.core.sched_output import SchedulerOutput


class ModelRunner:
    """Owns the paged KV storage and runs the model (GPT-2, Llama) on scheduler batches (nano-vllm's ModelRunner)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        attention: str | None = None,  # None: DEFAULT_ATTENTION (kvcourse/worker/paged_cache.py), as LLMEngine
        *,
        synchronize_timings: bool = False,
        pack_weights: bool | None = None,
        num_cpu_tier_blocks: int = 0,
    ) -> None:
        attention = DEFAULT_ATTENTION if attention is None else attention
        if attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {sorted(ATTENTION_IMPLEMENTATIONS)}; got {attention!r}.")
        self.model = model.eval()
        self.block_size = block_size
        self.attention = attention
        self.attn_implementation = ATTENTION_IMPLEMENTATIONS[attention]
        self.kv_cache = PagedKVCache.for_model(model, num_blocks, block_size)
        # a second tier (lesson 10): CPU storage of the same block shape, None while the tier is off
        self.cpu_kv_cache = (
            PagedKVCache.for_model(model, num_cpu_tier_blocks, block_size, device="cpu")
            if num_cpu_tier_blocks
            else None
        )
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
    def transfer_blocks(self, saves: Sequence[tuple[int, int]], loads: Sequence[tuple[int, int]]) -> None:
        """A second tier's copies, every layer: device blocks out to their CPU slots, then CPU slots into device blocks."""
        if not saves and not loads:
            return
        if self.cpu_kv_cache is None:
            raise ValueError(
                "the plan moves blocks to or from a CPU tier, but this runner has none (num_cpu_tier_blocks=0)."
            )
        for device_layer, cpu_layer in zip(self.kv_cache.layers, self.cpu_kv_cache.layers):
            for device, cpu in ((device_layer.keys, cpu_layer.keys), (device_layer.values, cpu_layer.values)):
                if saves:
                    blocks, slots = (torch.tensor(x, dtype=torch.long) for x in zip(*saves))
                    cpu[slots] = device[blocks.to(device.device)].to("cpu")
                if loads:
                    slots, blocks = (torch.tensor(x, dtype=torch.long) for x in zip(*loads))
                    device[blocks.to(device.device)] = cpu[slots].to(device.device)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> dict[int, int]:
        """Run one step's plan: a second tier's copies and the block copies first, then one forward pass."""
        self.transfer_blocks(scheduler_output.kv_saves, scheduler_output.kv_loads)
        self.copy_blocks(scheduler_output.blocks_to_copy)
        if not scheduler_output.scheduled_seqs:
            return {}  # a step that only loads blocks (every request waiting for its tier)
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

"""Given pieces of the model runner: what one forward pass takes in, and where a step's time goes.

vLLM keeps the like of these beside its runner (vllm/v1/worker/): the exercise (the token layout,
Exercise 5.5) and the runner itself are in kvcourse/model_runner.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass
class RunnerTimings:
    """Wall seconds the runner spent in each part of its steps, summed since the last reset (why a step costs what it does)."""

    prepare: float = 0.0  # building the input tensors (and the fast backend's attention metadata)
    forward: float = 0.0  # the model's forward pass, attention included
    attention: float = 0.0  # the part of forward spent in paged attention (every layer)
    sample: float = 0.0  # the sampler (greedy: argmax) and back to Python ints
    steps: int = 0

    def reset(self) -> None:
        """Start counting afresh (the engine does it at the start of each generate call)."""
        self.prepare = self.forward = self.attention = self.sample = 0.0
        self.steps = 0

    def as_dict(self) -> dict[str, float]:
        """Seconds by part, for JSON."""
        return {"prepare": self.prepare, "forward": self.forward, "attention": self.attention, "sample": self.sample}


__all__ = ["ModelInputs", "RunnerTimings"]

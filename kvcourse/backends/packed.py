"""GPT-2's linear layers in oneDNN's format, for the engine's decode steps on a CPU.

GPT-2 only: packing covers its `Conv1D` layers (and its LM head); other families (Llama/SmolLM2) are
declined in words by `why_not_packable` and run their own layers.

A decode step multiplies a handful of rows by every weight matrix, so it is bound by reading the
weights. GPT-2's `Conv1D` computes `x @ W` with W stored [in, out]; oneDNN's linear reads the same
weights from a packed copy 1.3x to 1.8x faster at GPT-2 small's shapes (8 to 64 rows, 2 threads), and the
full throughput study runs 2.7x faster with it (`kvcourse_model_weights` in `kvcourse.bench throughput`,
2026-12-02).
Like vLLM's `process_weights_after_loading`, the weights are converted once per model and process
(about a second for GPT-2 small; again only if a weight changes); the model itself is never changed,
so Hugging Face code that shares it still runs as before. The copy costs the weights' memory once more.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch.utils.mkldnn import MkldnnLinear
from transformers.pytorch_utils import Conv1D

# Below this width oneDNN's per-call conversions cost more than they save: one GPT-2 layer's four
# products at batch 8, 2 threads, 2026-12-01: width 64 0.24x, 256 0.78x, 384 1.08x, 512 1.15x, 768 1.34x.
MIN_PACKED_WIDTH = 512


def why_not_packable(model: torch.nn.Module) -> str | None:
    """What stops the model's weights from being packed for oneDNN (None when nothing does)."""
    weight = next(model.parameters())
    if not any(isinstance(m, Conv1D) for m in model.modules()):
        return f"{type(model).__name__} has no GPT-2 Conv1D layers; oneDNN packing covers GPT-2 only"
    if weight.device.type != "cpu":
        return f"the model is on {weight.device}; oneDNN packing is for CPU models"
    if weight.dtype != torch.float32:
        return f"the model is in {weight.dtype}; the packed layers are float32 only"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch was built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    return None


def can_pack(model: torch.nn.Module) -> bool:
    """Packing pays on a CPU, in float32, with oneDNN, for models at least MIN_PACKED_WIDTH wide (GPT-2 small up)."""
    return why_not_packable(model) is None and model.get_input_embeddings().embedding_dim >= MIN_PACKED_WIDTH


def _one_call_linear() -> bool:
    """Whether this torch has oneDNN's one-call linear on a reordered weight (what torch.compile's CPU backend calls)."""
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(torch.nn.Module):
    """One linear layer (`Conv1D` or `nn.Linear`) with its weight converted for oneDNN.

    `torch.ops.mkldnn._linear_pointwise` takes and returns ordinary tensors, so a product is one call;
    `torch.utils.mkldnn.MkldnnLinear` (the fallback) converts its input to oneDNN's format and its
    output back, three calls, for the same result bit for bit: at 8 rows (a decode step) the one call
    costs about half the CPU time, at 512 rows 10-40% less (GPT-2 small's shapes, 2026-12-02).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        weight = module.weight.detach()
        weight = (weight.t() if isinstance(module, Conv1D) else weight).contiguous()  # [out, in]
        bias = module.bias.detach() if module.bias is not None else None
        self.out_features = weight.shape[0]
        if _one_call_linear():
            self.weight, self.bias = torch.ops.mkldnn._reorder_linear_weight(weight, None), bias
            self.linear = None
        else:
            dense = torch.nn.Linear(1, 1, bias=bias is not None)
            dense.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                dense.bias = torch.nn.Parameter(bias, requires_grad=False)
            self.linear = MkldnnLinear(dense, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same product as the dense layer, any number of leading dimensions."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if self.linear is None:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        else:
            out = self.linear(rows)
        return out.view(*x.shape[:-1], self.out_features)


class PackedWeights:
    """The model's `Conv1D` layers and its LM head, packed once; `active()` routes the model through them."""

    def __init__(self, model: torch.nn.Module) -> None:
        heads = [model.get_output_embeddings()] if hasattr(model, "get_output_embeddings") else []
        layers = [m for m in model.modules() if isinstance(m, Conv1D)] + [h for h in heads if h is not None]
        with torch.no_grad():
            self.packed = {layer: PackedLinear(layer) for layer in layers}
        self._sources = [(layer, layer.weight, layer.weight._version) for layer in layers]

    def stale(self) -> bool:
        """True once a packed layer's weight was replaced or changed in place (the packed copy would be wrong)."""
        return any(layer.weight is not weight or weight._version != version for layer, weight, version in self._sources)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, every packed layer's forward is the packed one; outside, the model is as loaded."""
        for layer, packed in self.packed.items():
            layer.forward = packed.forward
        try:
            yield
        finally:
            for layer in self.packed:  # pop, not del: another engine on the same model may have restored it already
                vars(layer).pop("forward", None)


_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, PackedWeights] = weakref.WeakKeyDictionary()


def packed_weights(model: torch.nn.Module) -> PackedWeights:
    """The model's packed layers: packed on first use, reused by every engine on the same unchanged model."""
    cached = _PACKED.get(model)
    if cached is None or cached.stale():
        cached = _PACKED[model] = PackedWeights(model)
    return cached

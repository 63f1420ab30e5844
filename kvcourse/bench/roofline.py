"""The roofline of an engine run: the least time its steps could take on this machine, measured in the same run.

Every step must read each weight it multiplies by (the linear layers and norms; the LM head when a
sequence samples; one embedding row per token) and every cached key and value its sequences attend
to, and it must do the arithmetic: 2·rows·in·out FLOPs per linear layer, 4·width FLOPs per (query,
key) pair in attention. Neither goes faster than this machine's limits, measured here:

- memory bandwidth: a large copy (`kvcourse.bench.kernel.copy_bandwidth`: bytes read + written / time);
- matrix-multiply rate: each of the model's weight shapes multiplied at the run's largest step (its
  most rows) by the fastest product this process has (`torch.matmul` on the weight as the model
  stores it, `F.linear` on its transpose, and oneDNN's packed linear on a CPU), FLOPs / time.

A step's bound is the larger of bytes ÷ bandwidth and FLOPs ÷ rate (the roofline model of Williams,
Waterman and Patterson, CACM 2009); the run's bound is the sum over its steps. An engine's time
over that bound says how far from the machine's limit it runs: 1.0 would be at the limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvcourse.bench.kernel import copy_bandwidth, time_call
from kvcourse.models.spec import kv_cache_spec


@dataclass(frozen=True)
class StepShape:
    """What one forward pass of the engine asked of the machine."""

    tokens: int  # rows through every linear layer
    samples: int  # rows through the LM head
    kv_tokens: int  # cached tokens attention reads, summed over the step's sequences (per layer)
    pairs: int  # (query, key) pairs attention scores, summed over the step's sequences (per layer)


def step_shape(kwargs: dict) -> StepShape:
    """A step's shape from the keywords kvcourse's runner gives the model (input_ids, seq_lens, query_start_loc)."""
    seq_lens = kwargs["seq_lens"].long().cpu()
    starts = kwargs["query_start_loc"].long().cpu()
    chunks = starts[1:] - starts[:-1]
    keep = kwargs.get("logits_to_keep", 0)
    samples = int(keep.numel()) if isinstance(keep, torch.Tensor) else (int(keep) or int(chunks.sum()))
    pairs = int((chunks * seq_lens - chunks * (chunks - 1) // 2).sum())  # query i of a chunk sees its past and itself
    return StepShape(int(kwargs["input_ids"].shape[-1]), samples, int(seq_lens.sum()), pairs)


@contextlib.contextmanager
def recording_steps(model: torch.nn.Module) -> Iterator[list[StepShape]]:
    """Within the block, every engine forward pass of the model appends its StepShape to the list yielded."""
    shapes: list[StepShape] = []

    def record(_module, _args, kwargs) -> None:
        if "seq_lens" in kwargs and "query_start_loc" in kwargs:  # kvcourse's runner; generate() passes neither
            shapes.append(step_shape(kwargs))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield shapes
    finally:
        handle.remove()


@dataclass(frozen=True)
class ModelCost:
    """Bytes and products of one model, as a step reads and multiplies them."""

    layer_bytes: int  # every parameter but the embeddings and the LM head: read once per step
    head_bytes: int  # the LM head's weight: read when any sequence samples
    row_bytes: int  # embedding rows (token and position) read per token
    kv_bytes_per_token: int  # the K and V of one cached token, every layer
    linear_shapes: tuple[tuple[int, int, int], ...]  # (in, out, how many layers have it), LM head apart
    head_shape: tuple[int, int]
    attention_width: int  # heads × head size, times the number of layers


def model_cost(model: torch.nn.Module) -> ModelCost:
    """Read the model's weights: GPT-2's Conv1D layers (or nn.Linear), embeddings, norms and LM head."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    skip = {id(m.weight) for m in embeddings} | {id(head.weight)}
    shapes: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, Conv1D):
            shape = tuple(module.weight.shape)  # [in, out]
        elif isinstance(module, torch.nn.Linear):
            shape = (module.in_features, module.out_features)
        else:
            continue
        shapes[shape] = shapes.get(shape, 0) + 1
    spec = kv_cache_spec(model.config)
    element = next(model.parameters()).element_size()
    return ModelCost(
        layer_bytes=sum(p.nbytes for p in model.parameters() if id(p) not in skip),
        head_bytes=head.weight.nbytes,
        row_bytes=sum(m.weight[0].nbytes for m in embeddings),
        kv_bytes_per_token=2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * element,  # KV heads only
        linear_shapes=tuple((i, o, n) for (i, o), n in shapes.items()),
        head_shape=(head.in_features, head.out_features),
        attention_width=spec.num_layers * spec.num_heads * spec.head_dim,
    )


@dataclass(frozen=True)
class Limits:
    """This machine's measured ceilings: copy bandwidth and the matrix rate per weight shape."""

    bandwidth: float  # bytes per second
    rows: int  # the row count the rates were measured at
    rates: dict[tuple[int, int], float]  # FLOPs per second per (in, out)

    @property
    def best_rate(self) -> float:
        """The fastest product measured: what attention's few FLOPs are charged at."""
        return max(self.rates.values())


def matmul_rate(rows: int, k: int, n: int, dtype: torch.dtype, cuda: bool) -> float:
    """FLOPs per second of [rows, k] × [k, n] by the fastest product this process has."""
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, generator=gen, device=device, dtype=dtype)
    w = torch.randn(k, n, generator=gen, device=device, dtype=dtype)
    wt = w.t().contiguous()
    products = {"matmul": lambda: torch.matmul(x, w), "linear": lambda: torch.nn.functional.linear(x, wt)}
    if not cuda and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        from torch.utils.mkldnn import MkldnnLinear

        layer = torch.nn.Linear(k, n, bias=False)
        layer.weight = torch.nn.Parameter(wt, requires_grad=False)
        packed = MkldnnLinear(layer, torch.float32)
        products["onednn"] = lambda: packed(x)
    with torch.inference_mode():
        seconds = min(time_call(fn, cuda, repeats=3) for fn in products.values())
    return 2 * rows * k * n / seconds


def measure_limits(cost: ModelCost, rows: int, dtype: torch.dtype, cuda: bool) -> Limits:
    """Copy bandwidth and the rate of every weight shape the model multiplies by, at `rows` rows."""
    shapes = [(i, o) for i, o, _ in cost.linear_shapes] + [cost.head_shape]
    rates = {shape: matmul_rate(rows, *shape, dtype, cuda) for shape in dict.fromkeys(shapes)}
    return Limits(copy_bandwidth(cuda, quick=False), rows, rates)


def step_seconds(step: StepShape, cost: ModelCost, limits: Limits) -> tuple[float, float]:
    """A step's least time reading its bytes, and doing its FLOPs, on this machine."""
    read = cost.layer_bytes + step.tokens * cost.row_bytes + step.kv_tokens * cost.kv_bytes_per_token
    read += cost.head_bytes if step.samples else 0
    compute = sum(n * 2 * step.tokens * i * o / limits.rates[(i, o)] for i, o, n in cost.linear_shapes)
    compute += 2 * step.samples * cost.head_shape[0] * cost.head_shape[1] / limits.rates[cost.head_shape]
    compute += 4 * step.pairs * cost.attention_width / limits.best_rate
    return read / limits.bandwidth, compute


def bound(steps: list[StepShape], cost: ModelCost, limits: Limits) -> dict:
    """The run's lower bound (sum over steps of the larger of memory and compute time) and its parts."""
    times = [step_seconds(step, cost, limits) for step in steps]
    return {
        "seconds": sum(max(read, compute) for read, compute in times),
        "memory_bound_steps": sum(read >= compute for read, compute in times),
        "memory_seconds": sum(read for read, _ in times),
        "compute_seconds": sum(compute for _, compute in times),
        "steps": len(steps),
        "tokens": sum(step.tokens for step in steps),
    }


def summary(steps: dict[str, list[StepShape]], seconds: dict[str, float], model, cuda: bool) -> dict:
    """Measure this machine's limits and give each engine run's bound and its time over it (the JSON's `roofline`)."""
    cost = model_cost(model)
    rows = max((step.tokens for shapes in steps.values() for step in shapes), default=1)
    limits = measure_limits(cost, rows, next(model.parameters()).dtype, cuda)
    bounds = {name: bound(shapes, cost, limits) for name, shapes in steps.items() if shapes}
    return {
        "bandwidth_bytes_per_s": limits.bandwidth,
        "matmul_rows": rows,
        "matmul_flops_per_s": {f"{i}x{o}": rate for (i, o), rate in limits.rates.items()},
        "weight_bytes_per_step": cost.layer_bytes + cost.head_bytes,
        "bound": bounds,
        "time_over_bound": {name: seconds[name] / b["seconds"] for name, b in bounds.items() if name in seconds},
    }

"""Launching the learner's Triton decode kernel (Exercise 5.4): the glue around it, given.

`kvcourse/attention.py` holds the kernel; this module imports Triton (or stands in for it where it is
missing), checks the arguments, picks the grid (one program per sequence and query head) and the
compile-time constants, and launches. Grouped-query attention: the kernel is told how many query heads
share one KV head (QUERIES_PER_KV), and query head h reads KV head h // QUERIES_PER_KV.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcourse.worker.attention_checks import check_decode

try:  # Triton ships with torch on Linux; the reference functions work without it
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = tl = None

    def jit(fn: Callable) -> Callable:
        """Without Triton the kernel stays a plain function that nothing launches."""
        return fn


def decode_launch_args(
    query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[tuple[int, int], tuple, dict[str, int]]:
    """The grid, the strides and the constexprs of one launch, as the kernel's signature orders them."""
    batch, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    strides = (
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
    )
    constexprs = {
        "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim,
        "QUERIES_PER_KV": heads // kv_heads,
        "BLOCK_T": triton.next_power_of_2(block_size),
        "BLOCK_D": triton.next_power_of_2(head_dim),
    }
    return (batch, heads), strides, constexprs


def launch_paged_decode(
    kernel,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Check, make contiguous and launch `kernel` once for the whole decode batch; returns out [B, H, D]."""
    if triton is None:
        raise RuntimeError("Triton is not installed: use paged_decode_attention (the PyTorch reference) instead.")
    check_decode(query, key_cache, value_cache, block_tables, seq_lens)
    query, key_cache, value_cache = (x.contiguous() for x in (query, key_cache, value_cache))
    block_tables, seq_lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    grid, strides, constexprs = decode_launch_args(query, key_cache, block_tables)
    try:
        kernel_for(kernel, query.device)[grid](
            out, query, key_cache, value_cache, block_tables, seq_lens, float(scale), *strides, **constexprs
        )
    except Exception as error:
        reraise_stub(error)
        raise
    return out


def kernel_for(kernel, device: torch.device):
    """The kernel, after checking that Triton can run it on this device."""
    from triton.runtime.interpreter import InterpretedFunction

    if device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton runs CPU tensors only in its interpreter, which it picks when it is first imported: "
            "set TRITON_INTERPRET=1 before anything imports triton (in the shell, or in the first cell "
            "before importing torch models), or pass CUDA tensors."
        )
    return kernel


def reraise_stub(error: BaseException | None) -> None:
    """Surface an unwritten exercise's NotImplementedError that Triton's interpreter wrapped in its own error."""
    while error is not None:
        if isinstance(error, NotImplementedError) and str(error).startswith("Exercise "):
            raise NotImplementedError(str(error)) from None
        error = error.__cause__


__all__ = ["jit", "launch_paged_decode", "tl", "triton"]

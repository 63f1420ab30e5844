# kvcourse/memory.py holds exercises 0.1-0.2: write only inside their TODO regions (the rest is given).
"""How much memory the KV cache needs: the arithmetic behind every later lesson."""

from __future__ import annotations

import torch

from kvcourse.models.spec import kv_cache_spec  # noqa: F401


def _bytes_per_element(dtype: torch.dtype) -> int:
    """Bytes of one number of this dtype (fp16: 2, fp32: 4)."""
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers (fp16: GPT-2 small 36,864; SmolLM2-135M 23,040)."""
    # Exercise 0.1 (contract): return the bytes that ONE token's keys and values occupy in the cache.
    # spec = kv_cache_spec(config) reads any model's shapes (GPT-2 or Llama): spec.num_layers,
    # spec.num_heads (query heads), spec.num_kv_heads and spec.head_dim. In each of the layers the
    # cache keeps one key and one value vector of spec.head_dim numbers for each KV head -- not for
    # every query head: under grouped-query attention (Llama, SmolLM2) several query heads share one
    # KV head, so the hidden size overstates the cache. Each number takes _bytes_per_element(dtype) bytes.
    # TODO: Exercise 0.1: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 0.1 (KV bytes per token): not written yet: edit kvcourse/memory.py, kv_bytes_per_token."
    )


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    """How many whole sequences of `seq_len` tokens fit in `memory_bytes` of KV cache."""
    if memory_bytes < 0 or seq_len <= 0 or bytes_per_token <= 0:
        raise ValueError(
            f"max_sequences needs memory_bytes >= 0, seq_len > 0 and bytes_per_token > 0; "
            f"got {memory_bytes}, {seq_len}, {bytes_per_token}."
        )
    # Exercise 0.2 (contract): the largest number of WHOLE sequences, each reserving seq_len tokens of
    # bytes_per_token bytes, whose total fits in memory_bytes (0 when not even one fits).
    # TODO: Exercise 0.2: write your code here, then delete the raise below.
    raise NotImplementedError(
        "Exercise 0.2 (Sequences that fit in a memory budget): not written yet: edit kvcourse/memory.py, max_sequences."
    )

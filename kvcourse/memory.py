# kvcourse/memory.py holds exercises 0.1-0.2: write only inside their TODO regions (the rest is given).
"""How much memory the KV cache needs: the arithmetic behind every later lesson."""

from __future__ import annotations

import torch


def _kv_width(config) -> int:
    """Elements per token per layer for K (or V): heads that store K/V times the head size."""
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return kv_heads * (hidden // heads)


def _num_layers(config) -> int:
    """Transformer layers, whichever name the config uses (GPT-2: n_layer)."""
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def _bytes_per_element(dtype: torch.dtype) -> int:
    """Bytes of one number of this dtype (fp16: 2, fp32: 4)."""
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers (GPT-2 small, fp16: 36,864)."""
    # Exercise 0.1 (contract): return the bytes that ONE token's keys and values occupy in the cache,
    # over all _num_layers(config) layers, for a model whose key (and value) vector per layer has
    # _kv_width(config) elements (it already accounts for grouped-query attention), each number
    # _bytes_per_element(dtype) bytes.
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

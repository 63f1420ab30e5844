"""Argument checks for the paged-attention functions of kvcourse/attention.py: wrong shapes fail early, in words.

Given machinery beside the exercises (a silent broadcast is worse than an error). Shapes:
caches [num_blocks, block_size, KVH, D]; queries [B or T, H, D] with H a multiple of KVH
(grouped-query attention: query head h reads KV head h // (H // KVH)).
"""

from __future__ import annotations

import torch


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The two caches are [num_blocks, block_size, KVH, D] and alike."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, KVH, D]; got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}."
        )


def check_query(query: torch.Tensor, key_cache: torch.Tensor, layout: str = "[B, H, D]") -> None:
    """query is 3-D with the cache's head size, and its heads split evenly over the cache's KV heads."""
    kv_heads, head_dim = key_cache.shape[2:]
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % kv_heads:
        raise ValueError(
            f"query must be {layout} with the cache's head size D = {head_dim} and H a multiple of its "
            f"KVH = {kv_heads} KV heads (grouped-query attention); got {tuple(query.shape)}."
        )


def check_write(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """write_to_cache's arguments: this step's K/V [T, KVH, D] for T slots of caches shaped alike."""
    check_cache(key_cache, value_cache)
    if (
        key.shape != value.shape
        or key.dim() != 3
        or slots.shape != key.shape[:1]
        or key.shape[1:] != key_cache.shape[2:]
    ):
        raise ValueError(
            f"key and value must be [T, KVH, D] with the cache's KVH and D {tuple(key_cache.shape[2:])}, and "
            f"slot_mapping [T]; got {tuple(key.shape)}, {tuple(value.shape)} and {tuple(slots.shape)}."
        )


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """The decode-attention arguments against each other; the message says what does not match."""
    check_cache(key_cache, value_cache)
    check_query(query, key_cache)
    batch = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables must be [B, max_blocks] and seq_lens [B] with B = {batch}; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}."
        )
    capacity = block_tables.shape[1] * key_cache.shape[1]
    if batch and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > capacity):
        raise ValueError(
            f"every seq_len must be between 1 and max_blocks * block_size = {capacity}; got {seq_lens.tolist()}."
        )


def check_mixed(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """paged_attention's arguments: T queries split by query_start_loc over B sequences, none longer than its cache."""
    check_cache(key_cache, value_cache)
    check_query(query, key_cache, "[T, H, D]")
    batch = block_tables.shape[0]
    if query_start_loc.shape != (batch + 1,) or seq_lens.shape != (batch,):
        raise ValueError(
            f"query_start_loc must be [B + 1] and seq_lens [B] with B = {batch}; got "
            f"{tuple(query_start_loc.shape)} and {tuple(seq_lens.shape)}."
        )
    if int(query_start_loc[-1]) != query.shape[0]:
        raise ValueError(f"query_start_loc must end at T = {query.shape[0]}; got {query_start_loc.tolist()}.")
    chunks = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    for b, (chunk, seq_len) in enumerate(zip(chunks, seq_lens.tolist())):
        if chunk > seq_len:
            raise ValueError(f"sequence {b} has {chunk} queries but only {seq_len} tokens in the cache.")


__all__ = ["check_cache", "check_decode", "check_mixed", "check_query", "check_write"]

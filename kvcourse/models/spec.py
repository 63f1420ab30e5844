"""The shapes the KV cache and attention take from a model's config, for every family the engine serves.

One place reads them (vLLM: `ModelConfig.get_num_kv_heads` / `get_head_size`). transformers' configs
share the generic names: GPT-2's config maps them onto its own (`num_hidden_layers` is its layers,
`num_attention_heads` its heads...), and it has no `num_key_value_heads` because every head keeps its
own keys and values. Llama-style models (SmolLM2) store fewer KV heads than query heads
(grouped-query attention): query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token's K/V look like in the cache, per layer, and how many positions the model knows."""

    num_layers: int
    num_kv_heads: int  # heads that store keys and values (= num_heads without grouped-query attention)
    head_dim: int
    max_positions: int
    num_heads: int  # query heads: a multiple of num_kv_heads

    @property
    def queries_per_kv(self) -> int:
        """Query heads that share one KV head (1: multi-head attention; num_heads: multi-query attention)."""
        return self.num_heads // self.num_kv_heads


def kv_cache_spec(config: object) -> KVCacheSpec:
    """Layers, KV heads, head size and positions from a transformers config (GPT-2, Llama, ...), checked."""
    try:
        num_layers = int(config.num_hidden_layers)
        num_heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        max_positions = int(config.max_position_embeddings)
    except AttributeError as error:
        raise ValueError(
            f"{type(config).__name__} lacks a field the KV cache needs ({error}): pass a transformers model "
            "config with num_hidden_layers, num_attention_heads, hidden_size and max_position_embeddings."
        ) from None
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // num_heads)
    if min(num_layers, num_heads, num_kv_heads, head_dim, max_positions) <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"the config gives {num_layers} layers, {num_heads} query heads, {num_kv_heads} KV heads, head size "
            f"{head_dim} and {max_positions} positions: all must be positive and the query heads a multiple of "
            "the KV heads."
        )
    return KVCacheSpec(num_layers, num_kv_heads, head_dim, max_positions, num_heads)


__all__ = ["KVCacheSpec", "kv_cache_spec"]

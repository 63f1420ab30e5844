"""kv_cache_spec: the one place the cache's shapes are read from a config, for GPT-2 and Llama alike."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig

from kvcourse.models.gpt2 import gpt2_config
from kvcourse.models.spec import kv_cache_spec


def test_gpt2_keeps_one_kv_head_per_query_head():
    spec = kv_cache_spec(gpt2_config("gpt2"))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.max_positions) == (
        12, 12, 12, 64, 1024,
    )  # fmt: skip
    assert spec.queries_per_kv == 1


def test_smollm2_shapes_grouped_query_attention():
    config = LlamaConfig(
        num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=8192,
    )  # fmt: skip
    spec = kv_cache_spec(config)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.max_positions) == (
        30, 9, 3, 64, 8192,
    )  # fmt: skip
    assert spec.queries_per_kv == 3


def test_an_explicit_head_dim_wins_over_hidden_over_heads():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    assert kv_cache_spec(config).head_dim == 32


def test_bad_configs_are_refused_in_words():
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        kv_cache_spec(LlamaConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=48))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_cache_spec(object())
    assert kv_cache_spec(GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=16)).max_positions == 16

"""Graded tests for notebook 00: KV-cache memory arithmetic."""

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from kvcourse.memory import kv_bytes_per_token, max_sequences
from kvcourse.models.gpt2 import gpt2_config


@pytest.mark.ex0_1
def test_gpt2_small_fp16():
    got = kv_bytes_per_token(gpt2_config("gpt2"), torch.float16)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    assert got == 36_864, (
        "GPT-2 small in fp16 came out wrong: count K and V, in every layer, times the bytes of one element"
    )


@pytest.mark.ex0_1
def test_gpt2_xl_fp16():
    got = kv_bytes_per_token(gpt2_config("gpt2-xl"), torch.float16)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    assert got == 307_200, "GPT-2 XL in fp16 came out wrong"


@pytest.mark.ex0_1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_scale_with_dtype(dtype):
    config = GPT2Config(n_layer=3, n_embd=40, n_head=5)
    got = kv_bytes_per_token(config, dtype)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    assert got == 2 * 3 * 40 * torch.empty((), dtype=dtype).element_size(), (
        f"the byte count for {dtype} is off: does your formula use the element size of the dtype?"
    )


# SmolLM2-135M-Instruct's shapes (its config, written out: the model itself is not needed).
SMOLLM2 = dict(
    num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49_152, max_position_embeddings=8192,
)  # fmt: skip


@pytest.mark.ex0_1
def test_smollm2_caches_its_kv_heads_only():
    got = kv_bytes_per_token(LlamaConfig(**SMOLLM2), torch.float16)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    mha = 2 * 30 * 576 * 2  # what caching all 9 query heads (the hidden size) would take: 69,120
    assert got != mha, (
        "SmolLM2 uses grouped-query attention: 9 query heads share 3 KV heads, and only the KV heads are "
        "cached. Count spec.num_kv_heads x spec.head_dim per layer, not the hidden size"
    )
    assert got == 2 * 30 * 3 * 64 * 2, "SmolLM2 in fp16 came out wrong: K and V, 30 layers, 3 KV heads of 64, 2 bytes"


@pytest.mark.ex0_1
def test_grouped_query_attention_stores_fewer_heads():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    got = kv_bytes_per_token(config, torch.float16)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    assert got == 2 * 2 * 2 * 8 * 2, (
        "with grouped-query attention only the KV heads are cached (here 2 of 8 heads of 8 numbers each)"
    )


@pytest.mark.ex0_1
def test_multi_query_attention_caches_one_head():
    config = LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=1)
    got = kv_bytes_per_token(config, torch.float32)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    assert got == 2 * 4 * 1 * 32 * 4, "multi-query attention caches ONE KV head per layer, whatever the query heads"


@pytest.mark.ex0_1
def test_head_size_comes_from_the_config_not_the_hidden_size():
    # Some models set head_dim independently: 4 heads of 32 on a hidden size of 96 (not 96 // 4 = 24).
    config = LlamaConfig(num_hidden_layers=3, hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    got = kv_bytes_per_token(config, torch.bfloat16)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    assert got == 2 * 3 * 2 * 32 * 2, "use the config's head size (spec.head_dim), not hidden_size // heads"


@pytest.mark.ex0_2
def test_whole_sequences_only():
    got = max_sequences(10_000, seq_len=10, bytes_per_token=30)
    assert type(got) is int, f"max_sequences should return a plain int, not {type(got).__name__}"
    assert got == 33, "a partial sequence must not be counted"


@pytest.mark.ex0_2
def test_budget_exactly_fits():
    got = max_sequences(36_864 * 1024 * 4, seq_len=1024, bytes_per_token=36_864)
    assert type(got) is int, f"max_sequences should return a plain int, not {type(got).__name__}"
    assert got == 4, "a budget that exactly fits N sequences should give N"


@pytest.mark.ex0_2
def test_too_small_budget_fits_none():
    got = max_sequences(100, seq_len=10, bytes_per_token=11)
    assert type(got) is int, f"max_sequences should return a plain int, not {type(got).__name__}"
    assert got == 0, "a budget smaller than one sequence fits none"


@pytest.mark.ex0_2
def test_the_count_is_a_whole_number():
    got = max_sequences(36_864 * 1024 * 4, seq_len=1024, bytes_per_token=36_864)
    assert type(got) is int, (
        "max_sequences should return a whole number (a plain int): true division gives a float such as 4.0"
    )


@pytest.mark.ex0_1
def test_the_byte_count_is_an_int():
    got = kv_bytes_per_token(gpt2_config("gpt2"), torch.float32)
    assert type(got) is int, "kv_bytes_per_token should return a plain int (not a bool or an int subclass)"


# ---- lockstep (issue 35): every call compared with the reference on seeded random and adversarial workloads ----
@pytest.mark.parametrize(
    "exercise_id",
    [
        pytest.param(i, marks=getattr(pytest.mark, "ex" + i.replace(".", "_")))
        for i in (
            "0.1",
            "0.2",
        )
    ],
)
def test_lockstep_with_the_reference(exercise_id):
    """The first call where this exercise's code differs from the reference fails, naming the rule it breaks."""
    from kvcourse.course.lockstep import assert_lockstep

    assert_lockstep(exercise_id)

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


@pytest.mark.ex0_1
def test_grouped_query_attention_stores_fewer_heads():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    got = kv_bytes_per_token(config, torch.float16)
    assert type(got) is int, f"kv_bytes_per_token should return a plain int, not {type(got).__name__}"
    assert got == 2 * 2 * 16 * 2, "with grouped-query attention only the K/V heads are cached: use _kv_width(config)"


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

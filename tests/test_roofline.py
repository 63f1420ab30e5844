"""The roofline bound of the throughput study: step shapes, a model's bytes and products, the bound's arithmetic."""

from __future__ import annotations

import pytest
import torch

from kvcourse.bench import roofline, throughput
from kvcourse.course.solutions_switch import solutions_enabled
from kvcourse.models.gpt2 import load_gpt2


@pytest.fixture(scope="module")
def tiny():
    return load_gpt2("tiny", verbose=False)


def test_step_shape_counts_tokens_samples_cached_keys_and_pairs():
    # two sequences: a prefill chunk of 3 tokens at positions 2..4 (seq_len 5), and a decode at position 9
    kwargs = {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "seq_lens": torch.tensor([5, 10], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32),
        "logits_to_keep": torch.tensor([2, 3]),
    }
    shape = roofline.step_shape(kwargs)
    # pairs: the chunk's queries see 3, 4 and 5 keys; the decode sees 10
    assert shape == roofline.StepShape(tokens=4, samples=2, kv_tokens=15, pairs=3 + 4 + 5 + 10)
    assert roofline.step_shape(kwargs | {"logits_to_keep": 1}).samples == 1


def test_model_cost_reads_gpt2s_weights(tiny):
    cost = roofline.model_cost(tiny)
    config = tiny.config
    wte, wpe = tiny.transformer.wte.weight, tiny.transformer.wpe.weight
    every = sum(p.nbytes for p in tiny.parameters())  # wte once: the LM head shares it
    assert cost.head_bytes == wte.nbytes and cost.layer_bytes == every - wte.nbytes - wpe.nbytes
    assert cost.row_bytes == wte[0].nbytes + wpe[0].nbytes
    assert cost.kv_bytes_per_token == 2 * config.n_layer * config.n_embd * 4
    d = config.n_embd
    expected = {
        (d, 3 * d): config.n_layer,
        (d, d): config.n_layer,
        (d, 4 * d): config.n_layer,
        (4 * d, d): config.n_layer,
    }
    assert {(i, o): n for i, o, n in cost.linear_shapes} == expected
    assert cost.head_shape == (d, config.vocab_size)


def test_model_cost_counts_a_grouped_query_llamas_kv_heads_only():
    from kvcourse.models.llama import random_llama

    llama = random_llama()  # 2 layers, 4 query heads sharing 2 KV heads of 16, hidden 64, untied head
    cost = roofline.model_cost(llama)
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4, "layers x (K and V) x KV heads x head dim x float32"
    assert cost.attention_width == 2 * 4 * 16, "every query head scores its keys"
    assert cost.row_bytes == llama.model.embed_tokens.weight[0].nbytes, "RoPE has no position embedding to read"
    q, kv, up = 64, 2 * 16, 128
    assert {(i, o): n for i, o, n in cost.linear_shapes} == {(q, q): 4, (q, kv): 4, (q, up): 4, (up, q): 2}


def test_bound_takes_the_larger_of_memory_and_arithmetic_per_step():
    cost = roofline.ModelCost(
        layer_bytes=1000,
        head_bytes=500,
        row_bytes=10,
        kv_bytes_per_token=2,
        linear_shapes=((4, 5, 2),),
        head_shape=(4, 7),
        attention_width=3,
    )
    limits = roofline.Limits(bandwidth=1000.0, rows=8, rates={(4, 5): 100.0, (4, 7): 50.0})
    decode = roofline.StepShape(tokens=2, samples=2, kv_tokens=20, pairs=20)
    prefill = roofline.StepShape(tokens=100, samples=0, kv_tokens=100, pairs=5050)
    read, compute = roofline.step_seconds(decode, cost, limits)
    assert read == pytest.approx((1000 + 2 * 10 + 20 * 2 + 500) / 1000)
    assert compute == pytest.approx(2 * 2 * 2 * 4 * 5 / 100 + 2 * 2 * 4 * 7 / 50 + 4 * 20 * 3 / 100)
    read_p, compute_p = roofline.step_seconds(prefill, cost, limits)
    assert read_p == pytest.approx((1000 + 100 * 10 + 100 * 2) / 1000)  # nothing samples: no LM head
    result = roofline.bound([decode, prefill], cost, limits)
    assert result["seconds"] == pytest.approx(max(read, compute) + max(read_p, compute_p))
    assert result["memory_bound_steps"] == (read >= compute) + (read_p >= compute_p)
    assert result["steps"] == 2 and result["tokens"] == 102


@pytest.mark.skipif(not solutions_enabled(), reason="runs the engine: the reference (KVCOURSE_SOLUTIONS=1)")
def test_recording_steps_sees_each_engine_step_and_nothing_else(tiny):
    from kvcourse.engine.llm_engine import LLMEngine, hf_greedy

    prompts = [[464, 3290, 318, 257], [15496, 995]]
    engine = LLMEngine(tiny, num_blocks=32, block_size=4)
    with roofline.recording_steps(tiny) as steps:
        engine.generate(prompts, 3)
        hf_greedy(tiny, prompts[0], 2)  # Hugging Face's own forward passes are not engine steps
    assert steps and sum(s.tokens for s in steps) == sum(map(len, prompts)) + len(prompts) * 2
    assert sum(s.samples for s in steps) == len(prompts) * 3
    assert not tiny._forward_pre_hooks  # removed on leaving the block
    engine.generate(prompts, 1)
    assert sum(s.samples for s in steps) == len(prompts) * 3


@pytest.mark.skipif(not solutions_enabled(), reason="runs the engine: the reference (KVCOURSE_SOLUTIONS=1)")
def test_the_study_reports_kvcourse_against_the_bound(capsys):
    small = {"num_requests": 4, "prompt_median": 6, "output_median": 3, "max_len": 32, "max_batch_size": 2}
    result = throughput.run(quick=True, sweep=False, overrides=small | {"token_budget": 64, "rounds": 1})
    roof = result["roofline"]
    assert {"kvcourse", "kvcourse_ref_attention"} <= set(roof["bound"]) and "hf_static" not in roof["bound"]
    assert roof["bandwidth_bytes_per_s"] > 0 and all(r > 0 for r in roof["matmul_flops_per_s"].values())
    bound = roof["bound"]["kvcourse"]
    assert bound["seconds"] >= max(bound["memory_seconds"], bound["compute_seconds"]) * 0.999
    assert roof["time_over_bound"]["kvcourse"] == pytest.approx(result["seconds"]["kvcourse"] / bound["seconds"])
    throughput.print_table(result)
    out = capsys.readouterr().out
    assert "time / bound" in out and "x the bound" in out and "of the roofline" in out
    kvcourse_row = next(line for line in out.splitlines() if line.startswith("kvcourse "))
    assert result["agreement_with_hf_continuous"]["kvcourse"] == 1.0, "kvcourse's greedy tokens differ from HF's"
    assert "same tokens" in out and kvcourse_row.endswith("100%"), (
        f"the table must say the tokens agree: {kvcourse_row!r}"
    )

"""The real SmolLM2-135M-Instruct (30 layers, 9 query heads on 3 KV heads, RoPE) through LLMEngine: HF's tokens exactly.

Needs the converted model that `./course setup` makes (kvcourse/models/smollm2.py); skips, saying why,
where it is absent. Three chat prompts share the chat template's prefix, so prefix caching reuses
RoPE-rotated keys across requests; a small token budget splits the prompts into chunks.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )
try:
    from kvcourse.models import smollm2
except ImportError:
    pytest.skip("kvcourse.models.smollm2 (the SmolLM2 loader) is not in this checkout", allow_module_level=True)
if not smollm2.is_converted():
    pytest.skip(smollm2.missing_message(smollm2.smollm2_dir()), allow_module_level=True)

from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.spec import kv_cache_spec

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Who wrote Hamlet?",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer = smollm2.load_smollm2()
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True))
        for q in QUESTIONS
    ]
    if prompts and isinstance(prompts[0][0], str):  # a BatchEncoding's keys: take its input ids
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            for q in QUESTIONS
        ]
    with torch.inference_mode():
        expected = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    return model, tokenizer, prompts, expected


def test_smollm2_shapes_come_from_its_config(loaded):
    spec = kv_cache_spec(loaded[0].config)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)


def test_smollm2_through_the_engine_equals_hugging_face_greedy(loaded):
    model, tokenizer, prompts, expected = loaded
    engine = LLMEngine(
        model, num_blocks=64, block_size=16, token_budget=48, enable_prefix_caching=True, tokenizer=tokenizer
    )
    got = engine.generate(prompts, NEW_TOKENS)
    assert got == expected, "SmolLM2 through the paged cache chose other tokens than transformers' generate"
    assert engine.stats.prefix_hit_tokens > 0, "the chat template's shared prefix should be found in the cache"
    assert "Paris" in tokenizer.decode(got[0]), f"the answer should name Paris: {tokenizer.decode(got[0])!r}"

"""LLMEngine on the tiny GPT-2: the same tokens as Hugging Face's greedy generate, whatever the memory pressure."""

from __future__ import annotations

import random

import pytest
import torch

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )

from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import load_gpt2

torch.set_num_threads(1)  # tiny matrices: one thread is much faster on a shared 2-core machine
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return load_gpt2("tiny", verbose=False)


def _prompts(seed: int, count: int, lengths: tuple[int, int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(50257) for _ in range(rng.randint(*lengths))] for _ in range(count)]


MIXED = _prompts(0, 12, (1, 45))
SHARED_PREFIX = _prompts(1, 1, (21, 21))[0]
SHARED = _prompts(2, 8, (1, 9), prefix=SHARED_PREFIX)


@pytest.fixture(scope="module")
def expected(model):
    """Hugging Face's greedy tokens, one prompt at a time (the ground truth)."""
    return {id(p): hf_greedy(model, p, NEW_TOKENS) for p in MIXED + SHARED}


def _expected_for(expected, prompts):
    return [expected[id(p)] for p in prompts]


def test_roomy_cache_matches_hugging_face(model, expected):
    engine = LLMEngine(model, num_blocks=256, block_size=16)
    assert engine.generate(MIXED, NEW_TOKENS) == _expected_for(expected, MIXED)
    assert engine.stats.preemptions == 0
    assert engine.stats.generated_tokens == len(MIXED) * NEW_TOKENS


def test_tight_cache_preempts_and_still_matches(model, expected):
    engine = LLMEngine(model, num_blocks=14, block_size=4, token_budget=32, max_batch_size=8)
    assert engine.generate(MIXED, NEW_TOKENS, trace=True) == _expected_for(expected, MIXED)
    assert engine.stats.preemptions > 0, "the cache was meant to be tight enough to force preemptions"
    assert engine.kv_cache_manager.get_num_free_blocks() == 14, "blocks leaked"
    assert any(step.preempted for step in engine.trace)


def test_block_size_one_and_chunked_prefill_match(model, expected):
    engine = LLMEngine(model, num_blocks=400, block_size=1, token_budget=8, max_batch_size=3)
    assert engine.generate(MIXED[:5], NEW_TOKENS) == _expected_for(expected, MIXED[:5])


def test_prefix_caching_hits_and_matches(model, expected):
    engine = LLMEngine(
        model, num_blocks=64, block_size=4, token_budget=64, max_batch_size=4, enable_prefix_caching=True
    )
    assert engine.generate(SHARED, NEW_TOKENS) == _expected_for(expected, SHARED)
    assert engine.stats.prefix_hit_tokens > 0, "prompts sharing a 21-token prefix should hit the prefix cache"


def test_prefix_caching_under_preemption_matches(model, expected):
    engine = LLMEngine(
        model, num_blocks=16, block_size=4, token_budget=24, max_batch_size=6, enable_prefix_caching=True
    )
    assert engine.generate(SHARED, NEW_TOKENS) == _expected_for(expected, SHARED)
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0


def test_strings_use_the_gpt2_tokenizer(model):
    from kvcourse.models.gpt2 import load_tokenizer

    text = "The capital of France is"
    engine = LLMEngine(model, num_blocks=32, block_size=16)
    assert engine.generate([text], 3) == [hf_greedy(model, load_tokenizer().encode(text), 3)]


def test_model_keeps_its_own_attention(model):
    before = model.config._attn_implementation
    LLMEngine(model, num_blocks=8, block_size=4).generate([[1, 2, 3]], 2)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize(
    "prompts, max_new_tokens, words",
    [
        ([[]], 3, "empty"),
        ([""], 3, "empty"),
        ([[5] * 250], 10, "max_position_embeddings"),
        ([[5, 6]], 0, "max_new_tokens"),
        ([[5] * 40], 4, "num_blocks"),
        ([5, 6, 7], 2, "list of prompts"),
    ],
)
def test_bad_input_is_refused_clearly(model, prompts, max_new_tokens, words):
    engine = LLMEngine(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=words):
        engine.generate(prompts, max_new_tokens)
    assert not engine.scheduler.has_unfinished_requests(), "a refused call must leave nothing queued"

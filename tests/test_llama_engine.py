"""A Llama-family model (grouped-query attention, RoPE) through LLMEngine: token for token what transformers generates.

A tiny random Llama (4 query heads sharing 2 KV heads, RoPE theta 1e5, sharp attention) runs 16
prompts of 3 to 40 tokens, several sharing long prefixes, batched, and every attention the engine
offers on the CPU must give exactly Hugging Face's greedy tokens: with prefix caching (the shared
prefixes' keys are reused, cached already rotated at their true positions), under preemption (a cache
too small for the batch), and with chunked prefill (a token budget smaller than the prompts).
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

from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.llama import random_llama, tiny_llama_config
from kvcourse.models.spec import kv_cache_spec

torch.set_num_threads(1)
NEW_TOKENS = 8


def prompts() -> list[list[int]]:
    """16 prompts of 3 to 40 tokens; eight of them share one of two long prefixes (a system prompt, a document)."""
    gen = torch.Generator().manual_seed(11)
    vocab = tiny_llama_config().vocab_size
    shared = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 21)]
    lengths = torch.randint(3, 41, (8,), generator=gen).tolist()
    alone = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    tails = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 5, 9, 17)]
    sharing = [shared[i % 2] + tails[j] for i in range(2) for j in range(4)]
    return [p for pair in zip(alone, sharing) for p in pair]  # interleaved, so sharers arrive apart


@pytest.fixture(scope="module")
def model():
    return random_llama(tiny_llama_config(), seed=3)


@pytest.fixture(scope="module")
def expected(model):
    """Hugging Face's greedy continuation of each prompt alone: the reference every run must equal."""
    return [hf_greedy(model, p, NEW_TOKENS) for p in prompts()]


def test_the_tiny_model_is_grouped_and_its_outputs_vary(model, expected):
    """The test model really has fewer KV heads than query heads, and attention sharp enough to matter."""
    spec = kv_cache_spec(model.config)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    assert len({tuple(out) for out in expected}) == len(expected), "every prompt should continue differently"
    assert all(len(set(out)) > 2 for out in expected), "greedy outputs should not be one repeated token"


@pytest.mark.parametrize(
    ("attention", "num_blocks", "token_budget", "prefix_caching"),
    [
        ("fast", 128, 512, True),  # roomy: the whole batch at once, shared prefixes reused
        ("fast", 24, 64, True),  # tight: preemption, chunked prefill, prefix hits
        ("reference", 24, 32, True),  # the learner's attention (5.2, 5.3): the same, smaller chunks
        ("reference", 128, 512, False),
    ],
    ids=["fast-roomy", "fast-tight", "reference-tight", "reference-no-prefix-cache"],
)
def test_engine_equals_hugging_face_greedy(model, expected, attention, num_blocks, token_budget, prefix_caching):
    engine = LLMEngine(
        model,
        num_blocks=num_blocks,
        block_size=4,
        token_budget=token_budget,
        max_batch_size=16,
        enable_prefix_caching=prefix_caching,
        attention=attention,
    )
    got = engine.generate(prompts(), NEW_TOKENS)
    wrong = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not wrong, f"prompts {wrong} differ from transformers' greedy generate ({attention} attention)"
    if prefix_caching:
        assert engine.stats.prefix_hit_tokens > 0, "the shared prefixes should have been found in the cache"
    if num_blocks == 24:
        assert engine.stats.preemptions > 0, "the tight cache should have preempted (the case this run is for)"
    if token_budget < 40:
        assert engine.stats.iterations > NEW_TOKENS + 2, "a small token budget should split prefills into chunks"


def test_the_cache_holds_kv_heads_only(model):
    """The paged storage is [num_blocks, block_size, KVH, D] per layer: half the query heads here."""
    engine = LLMEngine(model, num_blocks=8, block_size=4)
    layers = engine.runner.kv_cache.layers
    assert len(layers) == 2
    assert tuple(layers[0].keys.shape) == (8, 4, 2, 16)


def test_keys_are_cached_rotated_at_their_true_positions(model):
    """The same token at two positions is cached as two different keys (RoPE applied before the write)."""
    engine = LLMEngine(model, num_blocks=8, block_size=4, attention="reference")
    engine.generate([[7, 7, 7, 7, 7]], 1)
    keys = engine.runner.kv_cache.layers[0].keys  # the finished request's blocks keep their keys until reused
    written = keys.reshape(-1, *keys.shape[2:])
    rows = written[written.abs().sum(dim=(1, 2)) > 0]  # the slots the five prompt tokens were written to
    assert rows.shape[0] == 5, "the five prompt tokens should occupy five slots"
    distinct = {tuple(row.flatten().tolist()) for row in rows}
    assert len(distinct) == 5, "one token at five positions should give five differently rotated keys"

"""The fast attention backend (kvcourse/backends/fast.py): same answers as the reference, token for token.

The engine runs "fast" by default (tests/test_engine.py covers it that way); here every engine-vs-HF
case runs on both the fast backend and the learner's reference one.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )

from kvcourse import attention
from kvcourse.backends.fast import FastAttentionMetadata, fast_paged_attention
from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import load_gpt2
from kvcourse.worker.model_runner import ModelRunner

torch.set_num_threads(1)  # tiny tensors: one thread is faster on a shared 2-core machine
NEW_TOKENS = 6
JUNK = 1e4  # what unused cache slots hold: any leak through the mask shows up at once


def paged_batch(seq_lens: list[int], chunk_lens: list[int], block_size: int, seed: int, heads: int = 2, dim: int = 8):
    """A random cache with each sequence in shuffled blocks, junk elsewhere, and that step's packed queries."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    key_cache = torch.full((num_blocks, block_size, heads, dim), JUNK)
    value_cache = torch.full((num_blocks, block_size, heads, dim), JUNK)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + 1
    tables = []
    for n, k in zip(seq_lens, needed):
        row, order = order[:k], order[k:]
        for t in range(n):
            key_cache[row[t // block_size], t % block_size] = torch.randn(heads, dim, generator=gen)
            value_cache[row[t // block_size], t % block_size] = torch.randn(heads, dim, generator=gen)
        tables.append(row + [order[0]] * (width - k))  # padding points at a junk block
    query = torch.randn(sum(chunk_lens), heads, dim, generator=gen)
    starts = torch.tensor([0, *chunk_lens]).cumsum(0).to(torch.int32)
    return query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(seq_lens), starts


def fast(query, key_cache, value_cache, tables, seq_lens, starts, scale=None):
    metadata = FastAttentionMetadata.build(tables, seq_lens, starts, key_cache.shape[1])
    return fast_paged_attention(query, key_cache, value_cache, metadata, scale=scale)


@pytest.mark.parametrize(
    "seq_lens, chunk_lens, block_size",
    [
        ([9, 1, 17], [1, 1, 1], 4),  # a pure decode step
        ([5, 12, 3], [5, 4, 1], 4),  # a fresh prompt, a chunk after a cached prefix, a decode
        ([33], [33], 16),  # one whole prompt across three blocks
        ([7, 7], [3, 7], 1),  # block size one
    ],
)
def test_fast_equals_reference_paged_attention(seq_lens, chunk_lens, block_size):
    args = paged_batch(seq_lens, chunk_lens, block_size, seed=len(seq_lens) + block_size)
    expected = attention.paged_attention(*args, scale=0.3)
    torch.testing.assert_close(fast(*args, scale=0.3), expected, rtol=1e-5, atol=1e-5)


@settings(deadline=None, max_examples=30)
@given(st.data())
def test_fast_equals_reference_on_random_mixed_batches(data):
    batch = data.draw(st.integers(1, 5))
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    chunk_lens = [data.draw(st.integers(1, n)) for n in seq_lens]
    block_size = data.draw(st.sampled_from([1, 3, 8, 16]))
    args = paged_batch(seq_lens, chunk_lens, block_size, seed=data.draw(st.integers(0, 1000)))
    torch.testing.assert_close(fast(*args), attention.paged_attention(*args), rtol=1e-5, atol=1e-5)


def test_fast_refuses_more_queries_than_tokens():
    query, key_cache, value_cache, tables, _, starts = paged_batch([4], [4], 4, seed=0)
    with pytest.raises(ValueError, match="queries"):
        fast(query, key_cache, value_cache, tables, torch.tensor([3]), starts)


def test_fast_refuses_mismatched_shapes():
    query, key_cache, value_cache, tables, seq_lens, starts = paged_batch([4], [1], 4, seed=0)
    metadata = FastAttentionMetadata.build(tables, seq_lens, starts, 4)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        fast_paged_attention(query[:, :1], key_cache, value_cache, metadata)


# ----------------------------------------------------------------------------- the engine on the fast backend
@pytest.fixture(scope="module")
def model():
    return load_gpt2("tiny", verbose=False)


def _prompts(seed: int, count: int, lengths: tuple[int, int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(50257) for _ in range(rng.randint(*lengths))] for _ in range(count)]


MIXED = _prompts(10, 12, (1, 45))
SHARED = _prompts(12, 8, (1, 9), prefix=_prompts(11, 1, (21, 21))[0])


@pytest.fixture(scope="module")
def expected(model):
    """Hugging Face's greedy tokens, one prompt at a time."""
    return {tuple(p): hf_greedy(model, p, NEW_TOKENS) for p in MIXED + SHARED}


ENGINES = {
    "roomy": ({"num_blocks": 256, "block_size": 16}, MIXED),
    "tight, preempting": ({"num_blocks": 14, "block_size": 4, "token_budget": 32, "max_batch_size": 8}, MIXED),
    "block size one, chunked": ({"num_blocks": 400, "block_size": 1, "token_budget": 8, "max_batch_size": 3}, MIXED),
    "prefix caching": (
        {"num_blocks": 64, "block_size": 4, "token_budget": 64, "max_batch_size": 4, "enable_prefix_caching": True},
        SHARED,
    ),
    "prefix caching, preempting": (
        {"num_blocks": 16, "block_size": 4, "token_budget": 24, "max_batch_size": 6, "enable_prefix_caching": True},
        SHARED,
    ),
}


@pytest.mark.parametrize("backend", ["fast", "reference"])
@pytest.mark.parametrize("case", list(ENGINES))
def test_engine_matches_hugging_face_on_each_backend(model, expected, case, backend):
    kwargs, prompts = ENGINES[case]
    engine = LLMEngine(model, attention=backend, **kwargs)
    assert engine.generate(prompts, NEW_TOKENS) == [expected[tuple(p)] for p in prompts]
    assert engine.stats.generated_tokens == len(prompts) * NEW_TOKENS


def test_the_engine_defaults_to_fast_and_reference_stays_selectable(model):
    assert LLMEngine(model, num_blocks=8, block_size=4).runner.attention == "fast"
    reference = LLMEngine(model, num_blocks=8, block_size=4, attention="reference")
    assert reference.runner.attention == "reference"
    assert reference.generate([[1, 2, 3]], 2) == [hf_greedy(model, [1, 2, 3], 2)]


def test_runner_times_its_parts(model):
    engine = LLMEngine(model, num_blocks=64, block_size=4, attention="fast")
    engine.generate(MIXED[:4], 3)
    timings = engine.runner.timings
    assert timings.steps > 0
    assert timings.prepare > 0 and timings.sample > 0
    assert 0 < timings.attention < timings.forward, "attention is a part of the forward pass"


def test_runner_computes_logits_only_where_a_token_is_sampled(model):
    class Seq:
        def __init__(self, request_id, tokens, start, samples_token):
            self.request_id, self.tokens, self.position_ids_start = request_id, tokens, start
            self.is_decode, self.samples_token = False, samples_token

    runner = ModelRunner(model, num_blocks=8, block_size=4, attention="fast")
    out = runner.execute_batch([Seq(0, [5, 6, 7], 0, False), Seq(1, [8, 9], 0, True)], {0: [1], 1: [2]})
    assert list(out) == [1], "a prefill chunk short of its prompt's end samples nothing"
    assert out[1] == hf_greedy(model, [8, 9], 1)[0]


def test_step_breakdown_splits_a_run_into_parts_that_sum_to_one(model):
    import time

    from kvcourse.bench.throughput import STEP_PARTS, step_breakdown

    engine = LLMEngine(model, num_blocks=64, block_size=4, attention="fast")
    for prompt in MIXED[:4]:
        engine.add_request(prompt, 3)
    start = time.perf_counter()
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    breakdown = step_breakdown(engine, time.perf_counter() - start)
    assert tuple(breakdown["fractions"]) == STEP_PARTS
    assert math.isclose(sum(breakdown["fractions"].values()), 1.0)
    assert all(share >= 0 for share in breakdown["fractions"].values())
    assert breakdown["seconds"]["forward"] > 0 and breakdown["seconds"]["attention"] > 0
    assert breakdown["steps"] == engine.stats.iterations

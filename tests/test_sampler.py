"""The sampler (kvcourse/worker/sampler.py): its masks, penalties and seeds on hand-made logits, then in the engine."""

from __future__ import annotations

import math

import pytest
import torch

from kvcourse.core.request import Request, RequestStatus
from kvcourse.worker.sampler import (
    GREEDY,
    Sampler,
    SamplingParams,
    SamplingParamsError,
    apply_penalties,
    apply_top_k_top_p,
)

VOCAB = 50


def request(rid: int, params: SamplingParams | None, prompt=(1, 2, 3), output=()) -> Request:
    r = Request(id=rid, prompt_tokens=list(prompt), max_new_tokens=100, output_tokens=list(output))
    r.sampling_params = params
    return r


def draws(sampler: Sampler, logits: torch.Tensor, rids: list[int], steps: int) -> list[list[int]]:
    """`steps` rounds of sampling over the same logits; one list of tokens per round."""
    return [sampler(logits, rids) for _ in range(steps)]


# ------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"temperature": -0.1}, "temperature", "0 (greedy) or more"),
        ({"temperature": float("nan")}, "temperature", "finite number"),
        ({"temperature": True}, "temperature", "finite number"),
        ({"temperature": "0.7"}, "temperature", "finite number"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "0 or -1"),
        ({"top_k": 2.5}, "top_k", "whole number"),
        ({"seed": True}, "seed", "whole number"),
        ({"seed": 2**70}, "seed", "64 bits"),
        ({"presence_penalty": 2.5}, "presence_penalty", "between -2 and 2"),
        ({"frequency_penalty": -3}, "frequency_penalty", "between -2 and 2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "above 0"),
        ({"logprobs": 21}, "logprobs", "0 to 20"),
        ({"logprobs": -1}, "logprobs", "0 to 20"),
    ],
)
def test_bad_sampling_params_are_refused_naming_the_parameter(kwargs, param, words):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and words in str(info.value) and isinstance(info.value, ValueError)


def test_defaults_are_openais_and_greedy_is_temperature_zero():
    assert SamplingParams().temperature == 1.0 and not SamplingParams().is_greedy
    assert SamplingParams(temperature=None, top_p=None, top_k=None) == SamplingParams()
    assert GREEDY.is_greedy and SamplingParams(temperature=1e-7).is_greedy


# ------------------------------------------------------------------------------- masks and penalties
def test_top_k_keeps_exactly_the_k_largest_per_row():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    masked = apply_top_k_top_p(logits, torch.tensor([1, 5, VOCAB]), None)
    for row, k in enumerate((1, 5, VOCAB)):
        kept = torch.isfinite(masked[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(masked[row, kept], logits[row, kept]), "kept logits are unchanged"


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]])
    masked = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75, 0.85, 0.5]))
    assert torch.isfinite(masked).tolist() == [
        [True, True, False, False],  # 0.5 + 0.3 reaches 0.75
        [True, True, True, False],  # 0.85 needs the third
        [True, False, False, False],  # the top token alone is more than 0.5
    ]


def test_presence_frequency_and_repetition_penalties():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    out = apply_penalties(logits, [[3]], [[1, 1, 2]], torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]))
    # token 1: seen, positive -> 2/2 = 1, then -0.5 presence -2*0.25 frequency = 0.0
    # token 2: seen, negative -> -1*2 = -2, then -0.5 -0.25 = -2.75; token 3: prompt only -> 0.5/2; token 0 untouched
    assert out.tolist() == [[1.0, 0.0, -2.75, 0.25]]


def test_penalties_make_the_sampler_avoid_repeats():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    sampler = Sampler()
    plain = request(0, SamplingParams(temperature=0))
    penalized = request(1, SamplingParams(temperature=0, frequency_penalty=1.0), output=[0])
    sampler.add_request(plain)
    sampler.add_request(penalized)
    assert sampler(logits.repeat(2, 1), [0, 1]) == [0, 1]


# ------------------------------------------------------------------------------- greedy and seeds
def test_temperature_zero_is_the_argmax_whatever_the_seed():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()
    for rid, seed in enumerate((None, 1, 2, 3)):
        sampler.add_request(request(rid, SamplingParams(temperature=0, seed=seed, top_k=3, top_p=0.5)))
    assert sampler(logits, [0, 1, 2, 3]) == logits.argmax(-1).tolist()
    assert Sampler()(logits, [7, 8, 9, 10]) == logits.argmax(-1).tolist(), "requests it does not know are greedy"


def test_the_same_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2))
    alone = Sampler()
    alone.add_request(request(0, params))
    expected = [tokens[0] for tokens in draws(alone, row, [0], 12)]

    crowded = Sampler()
    others = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(3))
    for rid, other in enumerate([None, SamplingParams(), SamplingParams(seed=1), GREEDY], start=1):
        crowded.add_request(request(rid, other))
    crowded.add_request(request(9, params))
    order = [1, 9, 2, 3, 4]  # the seeded request second, among greedy, unseeded and other-seeded ones
    batch = torch.cat([others[:1], row, others[1:4]])
    got = [tokens[1] for tokens in draws(crowded, batch, order, 12)]
    assert got == expected
    assert len(set(expected)) > 1, "temperature 1 over 50 tokens should not always pick the same one"


def test_different_seeds_differ_and_samples_follow_the_distribution():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    sampler = Sampler()
    sampler.add_request(request(0, SamplingParams(seed=5)))
    counts = torch.bincount(torch.tensor([t[0] for t in draws(sampler, probs.log(), [0], 2000)]), minlength=3)
    assert torch.allclose(counts / 2000, probs[0], atol=0.04), counts
    other = Sampler()
    other.add_request(request(0, SamplingParams(seed=6)))
    assert draws(other, torch.zeros(1, VOCAB), [0], 20) != draws(sampler, torch.zeros(1, VOCAB), [0], 20)


def test_top_k_one_and_tiny_top_p_are_greedy_even_at_high_temperature():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    sampler = Sampler()
    sampler.add_request(request(0, SamplingParams(temperature=5.0, top_k=1)))
    sampler.add_request(request(1, SamplingParams(temperature=5.0, top_p=1e-6)))
    for tokens in draws(sampler, logits, [0, 1], 20):
        assert tokens == logits.argmax(-1).tolist()


# ------------------------------------------------------------------------------- logprobs
def test_logprobs_are_the_raw_distributions_and_kept_by_output_position():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    r = request(0, SamplingParams(temperature=0.7, seed=0, logprobs=3), output=[4, 4])
    sampler = Sampler()
    sampler.add_request(r)
    [token] = sampler(logits, [0])
    entry = sampler.logprobs(0)[2]  # two output tokens already: this one lands at position 2
    raw = torch.log_softmax(logits[0], -1)
    assert entry.token_id == token and math.isclose(entry.logprob, raw[token].item(), rel_tol=1e-6)
    assert [t for t, _ in entry.top] == raw.topk(3).indices.tolist()
    assert sum(math.exp(lp) for _, lp in entry.top) <= 1 + 1e-6
    r.status = RequestStatus.FINISHED
    sampler(logits, [1])
    assert sampler.logprobs(0) == {}, "a finished request's state is dropped at the next step"


# ------------------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def engine():
    from kvcourse.engine.llm_engine import LLMEngine
    from kvcourse.models.gpt2 import load_gpt2

    return LLMEngine(load_gpt2("tiny", verbose=False), num_blocks=64, block_size=16)


def test_engine_default_is_greedy_and_seeded_runs_repeat_across_batches(engine):
    from kvcourse.engine.llm_engine import hf_greedy

    prompts = [list(range(100, 130)), [5, 6, 7]]
    assert engine.generate(prompts, 5) == [hf_greedy(engine.model, p, 5) for p in prompts]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    [alone] = engine.generate(prompts[:1], 8, sampling_params=params)
    crowded = engine.generate(prompts + [[9] * 20, [3]], 8, sampling_params=params)
    assert crowded[0] == alone
    [reseeded] = engine.generate(prompts[:1], 8, sampling_params=SamplingParams(temperature=0.8, top_p=0.9, seed=8))
    assert reseeded != alone


def test_engine_refuses_sampling_params_of_the_wrong_type(engine):
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate([[1, 2]], 2, sampling_params={"temperature": 0.5})

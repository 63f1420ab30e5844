"""On an NVIDIA GPU: the Triton kernel compiled for the device, mixed prefill/decode attention, the engine.

Every test here is marked `gpu` and skips without CUDA; `scripts/gpu_check.sh` runs them on a GPU
machine and fails if any of them skips. The CPU suite covers the same code through Triton's
interpreter, which ignores the compiler's rules and the device's precision: hence these.
"""

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

from kvcourse import attention
from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import LESSON_PROMPTS, load_gpt2, load_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: scripts/gpu_check.sh on an NVIDIA GPU"),
]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def paged_case(lengths: list[int], heads: int, head_dim: int, block_size: int, seed: int):
    """Random K/V (`heads` KV heads) per sequence stored in shuffled blocks of one cache; tables padded with a junk block id."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, heads, head_dim, generator=gen) for n in lengths]
    values = [torch.randn(n, heads, head_dim, generator=gen) for n in lengths]
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 1
    key_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)  # junk where nothing is stored
    value_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    junk, order = order[-1], order[:-1]
    tables = []
    for k, v, n in zip(keys, values, needed):
        row, order = order[:n], order[n:]
        for t in range(k.shape[0]):
            key_cache[row[t // block_size], t % block_size] = k[t]
            value_cache[row[t // block_size], t % block_size] = v[t]
        tables.append(row + [junk] * (max(needed) + 1 - n))
    return keys, values, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32), gen


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v in float64 on the CPU, query i at position offset + i: the ground truth."""
    q, k, v = (x.double().cpu() for x in (q, k, v))
    kv_of_head = [h // (q.shape[1] // k.shape[1]) for h in range(q.shape[1])]  # grouped-query attention
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    scores = torch.einsum("lhd,shd->hls", q, k) * q.shape[-1] ** -0.5
    future = torch.arange(k.shape[0])[None, :] > (torch.arange(q.shape[0])[:, None] + offset)
    return torch.einsum("hls,shd->lhd", torch.softmax(scores.masked_fill(future, float("-inf")), -1), v)


def rounded(*tensors: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors as the GPU sees them: in dtype, on CUDA (so the ground truth uses the same rounded inputs)."""
    return [t.to(dtype).cuda() for t in tensors]


KERNEL_CASES = {  # lengths, block size, query heads, head dim[, KV heads (grouped-query attention)]
    "one token": ([1], 16, 12, 64),
    "mixed lengths": ([1, 17, 300, 64], 16, 12, 64),
    "long contexts": ([2048, 1999, 4000], 16, 12, 64),
    "block 32, head dim 128": ([5, 33, 129], 32, 8, 128),
    "64 short sequences": ([7] * 64, 8, 4, 32),
    "odd block and head sizes": ([13, 50], 3, 2, 80),
    "SmolLM2: 9 heads on 3 KV heads": ([1, 17, 300, 2048], 16, 9, 64, 3),
    "multi-query, head dim 80": ([13, 50, 400], 16, 8, 80, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_triton_decode_kernel_compiled_equals_dense(case, dtype):
    lengths, block_size, heads, head_dim, *grouped = KERNEL_CASES[case]
    kv_heads = grouped[0] if grouped else heads
    keys, values, key_cache, value_cache, tables, gen = paged_case(lengths, kv_heads, head_dim, block_size, seed=7)
    query = torch.randn(len(lengths), heads, head_dim, generator=gen)
    q, kc, vc = rounded(query, key_cache, value_cache, dtype=dtype)
    got = attention.triton_paged_decode_attention(q, kc, vc, tables.cuda(), torch.tensor(lengths).cuda())
    assert got.dtype == dtype and got.device == q.device
    keys, values = ([x.to(dtype) for x in xs] for xs in (keys, values))
    expected = torch.cat([dense(q[b : b + 1], keys[b], values[b], n - 1) for b, n in enumerate(lengths)])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_mixed_prefill_and_decode_on_cuda_equals_dense(dtype):
    """Prefill chunks (first, middle, last) and decodes in one batch, as the engine schedules them."""
    lengths, chunks = [40, 1, 300, 17, 64], [40, 1, 100, 1, 1]  # a whole prompt, a decode, a late chunk, decodes
    keys, values, key_cache, value_cache, tables, gen = paged_case(lengths, 12, 64, 16, seed=3)
    query = torch.randn(sum(chunks), 12, 64, generator=gen)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    q, kc, vc = rounded(query, key_cache, value_cache, dtype=dtype)
    got = attention.paged_attention(q, kc, vc, tables.cuda(), torch.tensor(lengths).cuda(), starts.cuda())
    keys, values = ([x.to(dtype) for x in xs] for xs in (keys, values))
    expected = torch.cat(
        [dense(q[starts[b] : starts[b + 1]], keys[b], values[b], n - chunks[b]) for b, n in enumerate(lengths)]
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double().cpu(), expected, atol=tol, rtol=tol)


def _prompts(seed: int, count: int, lengths: tuple[int, int], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(50257) for _ in range(rng.randint(*lengths))] for _ in range(count)]


MIXED = _prompts(0, 12, (1, 45))
SHARED = _prompts(2, 8, (1, 9), prefix=_prompts(1, 1, (21, 21))[0])
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    """The tiny test GPT-2 on the GPU, in float32 (Hugging Face's greedy output is the ground truth)."""
    return load_gpt2("tiny", verbose=False).cuda().eval()


@pytest.mark.parametrize("backend", ["reference", "fast", "triton"])
@pytest.mark.parametrize(
    "setting",
    [
        dict(num_blocks=256, block_size=16),
        dict(num_blocks=14, block_size=4, token_budget=32, max_batch_size=8),  # tight: forces preemptions
        dict(num_blocks=64, block_size=4, enable_prefix_caching=True),
    ],
    ids=["roomy", "tight", "prefix caching"],
)
def test_engine_on_cuda_equals_hugging_face_greedy(tiny, backend, setting):
    prompts = SHARED if setting.get("enable_prefix_caching") else MIXED
    engine = LLMEngine(tiny, attention=backend, **setting)
    assert engine.generate(prompts, NEW_TOKENS) == [hf_greedy(tiny, p, NEW_TOKENS) for p in prompts]
    if setting["num_blocks"] == 14:
        assert engine.stats.preemptions > 0, "the cache was meant to be tight enough to force preemptions"


@pytest.mark.parametrize("backend", ["fast", "triton"])
def test_gpt2_small_on_cuda_equals_hugging_face_greedy(backend):
    """GPT-2 small's real shapes (12 layers, 12 heads of 64) on the lesson's prompts."""
    model = load_gpt2("gpt2", verbose=False).cuda().eval()
    tokenizer = load_tokenizer()
    prompts = [tokenizer.encode(text) for text in LESSON_PROMPTS]
    engine = LLMEngine(model, num_blocks=128, block_size=16, attention=backend)
    assert engine.generate(prompts, 16) == [hf_greedy(model, p, 16) for p in prompts]


@pytest.mark.parametrize("backend", ["reference", "fast", "triton"])
def test_grouped_llama_on_cuda_equals_hugging_face_greedy(backend):
    """A tiny Llama (4 query heads on 2 KV heads, RoPE) on the GPU, every attention, tight cache and prefix caching."""
    from kvcourse.models.llama import random_llama

    model = random_llama(seed=3).cuda().eval()
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in MIXED[:6] + SHARED[:6]]
    engine = LLMEngine(
        model, num_blocks=20, block_size=4, token_budget=32, enable_prefix_caching=True, attention=backend
    )
    assert engine.generate(prompts, NEW_TOKENS) == [hf_greedy(model, p, NEW_TOKENS) for p in prompts]

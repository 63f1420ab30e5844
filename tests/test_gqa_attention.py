"""Grouped-query attention in every paged-attention path: reference, fast backend, Triton kernel.

The cache stores KVH heads; query head h of H reads KV head h // (H // KVH) (transformers' repeat_kv,
SmolLM2's 9 query heads on 3 KV heads). Each path is compared with a dense computation written here
independently (an explicit index per query head), on shuffled block tables, for multi-head (KVH = H),
grouped (1 < KVH < H) and multi-query (KVH = 1) shapes and head sizes 16, 64 and 80. The Triton kernel
runs in Triton's interpreter in a fresh process (TRITON_INTERPRET=1 must be set before Triton is
imported), as tests/test_paged_attention.py does; it is also compiled for sm_80 and sm_90 with GQA shapes.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )

from kvcourse import attention
from kvcourse.backends.fast import FastAttentionMetadata, fast_paged_attention

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(4, 4, 16), (4, 2, 16), (9, 3, 64), (8, 1, 80)]  # (H, KVH, D): MHA, GQA, SmolLM2's GQA, MQA
SHAPE_IDS = ["mha", "gqa", "smollm2", "mqa-d80"]


def dense_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | None, scale: float) -> torch.Tensor:
    """q [L, H, D] over k, v [S, KVH, D]: query head h reads KV head h // (H // KVH); causal from `offset`."""
    heads, kv_heads = q.shape[1], k.shape[1]
    kv_of_head = torch.tensor([h // (heads // kv_heads) for h in range(heads)])
    k, v = k[:, kv_of_head], v[:, kv_of_head]  # [S, H, D]
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    if offset is not None:
        future = torch.arange(k.shape[0])[None, :] > (torch.arange(q.shape[0])[:, None] + offset)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(scores, -1), v)


def paged_case(lengths, chunks, heads, kv_heads, head_dim, block_size, seed):
    """Sequences' K/V in shuffled blocks (junk elsewhere), this step's queries, and the dense answer."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(needed) + 2
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width, tables, expected = max(needed) + 1, [], []
    query = torch.randn(sum(chunks), heads, head_dim, generator=gen)
    start = 0
    for n, chunk, blocks in zip(lengths, chunks, needed):
        row, order = order[:blocks], order[blocks:]
        keys = torch.stack([key_cache[row[t // block_size], t % block_size] for t in range(n)])
        values = torch.stack([value_cache[row[t // block_size], t % block_size] for t in range(n)])
        expected.append(dense_gqa(query[start : start + chunk], keys, values, n - chunk, head_dim**-0.5))
        tables.append(row + [order[0]] * (width - blocks))
        start += chunk
    starts = torch.tensor([0, *chunks]).cumsum(0).to(torch.int32)
    args = (query, key_cache, value_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(lengths), starts)
    return args, torch.cat(expected)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_decode_reads_each_query_heads_kv_head(heads, kv_heads, head_dim, block_size):
    lengths = [1, 6, 19, 33]
    (query, key_cache, value_cache, tables, lens, _), expected = paged_case(
        lengths, [1] * 4, heads, kv_heads, head_dim, block_size, seed=block_size + heads
    )
    got = attention.paged_decode_attention(query, key_cache, value_cache, tables, lens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SHAPES, ids=SHAPE_IDS)
def test_reference_and_fast_mixed_batches_equal_dense(heads, kv_heads, head_dim):
    """A fresh prefill, a chunk continuing a cached prefix, and decodes, in one batch."""
    args, expected = paged_case([7, 20, 5, 12], [7, 6, 1, 1], heads, kv_heads, head_dim, 4, seed=heads * kv_heads)
    query, key_cache, value_cache, tables, lens, starts = args
    torch.testing.assert_close(attention.paged_attention(*args), expected, atol=1e-5, rtol=1e-5)
    metadata = FastAttentionMetadata.build(tables, lens.to(torch.int32), starts, 4)
    fast = fast_paged_attention(query, key_cache, value_cache, metadata, scale=head_dim**-0.5)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)


def test_heads_that_do_not_split_over_the_kv_heads_are_refused():
    args, _ = paged_case([5], [1], 4, 2, 8, 4, seed=0)
    query, key_cache, value_cache, tables, lens, starts = args
    odd = torch.zeros(1, 3, 8)  # 3 query heads cannot share 2 KV heads evenly
    with pytest.raises(ValueError, match="multiple"):
        attention.paged_decode_attention(odd, key_cache, value_cache, tables, lens)
    with pytest.raises(ValueError, match="multiple"):
        attention.paged_attention(odd, key_cache, value_cache, tables, lens, starts)
    with pytest.raises(ValueError, match="multiple"):
        fast_paged_attention(odd, key_cache, value_cache, FastAttentionMetadata.build(tables, lens, starts, 4))
    with pytest.raises(ValueError, match="KVH"):  # this step's keys must have the cache's KV heads
        attention.write_to_cache(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), key_cache, value_cache, torch.tensor([0]))


# ----------------------------------------------------------------------------- Triton, interpreted
_INTERPRETED = """
import sys, torch
from kvcourse import attention
from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.llama import random_llama
torch.set_num_threads(1)
cases = torch.load(sys.argv[1])
out = {name: attention.triton_paged_decode_attention(*args) for name, args in cases.items()}
model = random_llama(seed=5)
prompts = [[5, 77, 301, 9, 42, 8], [400, 3, 17]]
engine = LLMEngine(model, num_blocks=8, block_size=4, attention="triton")
out["engine"] = (engine.generate(prompts, 4), [hf_greedy(model, p, 4) for p in prompts])
torch.save(out, sys.argv[2])
"""
TRITON_SHAPES = {  # name: (H, KVH, D, block size, dtype)
    "gqa-d64": (9, 3, 64, 16, torch.float32),
    "gqa-d80": (4, 2, 80, 4, torch.float32),
    "mqa-d80": (8, 1, 80, 3, torch.float32),
    "gqa-d64-fp16": (4, 2, 64, 8, torch.float16),
}


@pytest.fixture(scope="module")
def interpreted():
    """The kernel on every GQA case, and a tiny Llama engine on it, from one process with TRITON_INTERPRET=1."""
    cases, expected = {}, {}
    for seed, (name, (heads, kv_heads, head_dim, block_size, dtype)) in enumerate(TRITON_SHAPES.items()):
        lengths = [1, 9, 21]
        args, answer = paged_case(lengths, [1] * 3, heads, kv_heads, head_dim, block_size, seed)
        query, key_cache, value_cache, tables, lens, _ = args
        query, key_cache, value_cache = query.to(dtype), key_cache.to(dtype), value_cache.to(dtype)
        cases[name] = (query, key_cache, value_cache, tables, lens)
        expected[name] = attention.paged_decode_attention(*cases[name]) if dtype != torch.float32 else answer
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(cases, f"{tmp}/in.pt")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run(
            [sys.executable, "-c", _INTERPRETED, f"{tmp}/in.pt", f"{tmp}/out.pt"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(f"{tmp}/out.pt"), expected


@pytest.mark.parametrize("name", list(TRITON_SHAPES))
def test_triton_kernel_interpreted_reads_each_query_heads_kv_head(interpreted, name):
    out, expected = interpreted
    tol = 2e-3 if out[name].dtype == torch.float16 else 1e-5
    assert out[name].dtype == expected[name].dtype
    torch.testing.assert_close(out[name].float(), expected[name].float(), atol=tol, rtol=tol)


def test_triton_engine_on_a_grouped_llama_matches_hugging_face(interpreted):
    out, _ = interpreted
    got, hf = out["engine"]
    assert got == hf, "a tiny Llama through the Triton decode kernel should generate what transformers does"


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 80)], ids=["smollm2", "gqa-d80"])
def test_triton_kernel_compiles_for_gpus_with_gqa_shapes(arch, heads, kv_heads, head_dim):
    from kvcourse.course.kernel_compile import _interpreted, compile_kernel, decode_kernel_signature

    if _interpreted(attention._paged_decode_kernel):
        pytest.skip("this process runs Triton in its interpreter; tests/test_kernel_compile.py compiles in a clean one")
    signature, constexprs, attrs = decode_kernel_signature(
        attention._paged_decode_kernel, "fp16", 16, head_dim, heads=heads, kv_heads=kv_heads
    )
    assert constexprs["QUERIES_PER_KV"] == heads // kv_heads
    compiled = compile_kernel(attention._paged_decode_kernel, signature, constexprs, attrs, arch, "fp16")
    assert compiled.ptx and compiled.cubin

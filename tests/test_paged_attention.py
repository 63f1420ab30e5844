"""Paged attention equals dense attention: random shapes, block sizes 1, 3 and 16, shuffled block tables.

The Triton kernel runs in a fresh process with TRITON_INTERPRET=1 set before Triton is imported
(the interpreter is chosen at import time, and other tests import Triton through transformers).
On a CUDA machine it is also compiled and checked in fp16 and fp32 against the reference.
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
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.course.solutions_switch import solutions_enabled

if not solutions_enabled():
    pytest.skip(
        "the maintainers' tests run against the reference: set KVCOURSE_SOLUTIONS=1 (./course test does)",
        allow_module_level=True,
    )

from kvcourse import attention

torch.set_num_threads(1)  # tiny tensors: one thread is faster on a shared 2-core machine
ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZES = st.sampled_from([1, 3, 16])


def paged_from_sequences(keys, values, block_size: int, seed: int, spare: int = 2):
    """Store each sequence's K/V ([S, H, D]) in shuffled blocks; rows padded with a junk block id."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(k.shape[0] / block_size) for k in keys]
    num_blocks = sum(needed) + spare
    heads, head_dim = keys[0].shape[1:]
    key_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)  # junk everywhere else
    value_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + 1
    tables = []
    for k, v, n in zip(keys, values, needed):
        row, order = order[:n], order[n:]
        for t in range(k.shape[0]):
            key_cache[row[t // block_size], t % block_size] = k[t]
            value_cache[row[t // block_size], t % block_size] = v[t]
        tables.append(row + [order[0] if order else row[0]] * (width - n))
    return key_cache, value_cache, torch.tensor(tables, dtype=torch.int32)


def dense(q, k, v, offset: int | None, scale: float):
    """softmax(q k^T * scale) v, causal with query i at position offset + i when offset is given."""
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    if offset is not None:
        future = torch.arange(k.shape[0])[None, :] > (torch.arange(q.shape[0])[:, None] + offset)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(scores, -1), v)


def random_sequences(lengths, heads, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, heads, head_dim, generator=gen) for n in lengths]
    values = [torch.randn(n, heads, head_dim, generator=gen) for n in lengths]
    return keys, values, gen


@settings(max_examples=40, deadline=None)
@given(
    block_size=BLOCK_SIZES,
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([4, 8, 12]),
    seed=st.integers(0, 2**16),
)
def test_decode_equals_dense(block_size, lengths, heads, head_dim, seed):
    keys, values, gen = random_sequences(lengths, heads, head_dim, seed)
    key_cache, value_cache, tables = paged_from_sequences(keys, values, block_size, seed)
    query = torch.randn(len(lengths), heads, head_dim, generator=gen)
    got = attention.paged_decode_attention(query, key_cache, value_cache, tables, torch.tensor(lengths), scale=0.3)
    for b in range(len(lengths)):
        expected = dense(query[b : b + 1], keys[b], values[b], None, 0.3)[0]
        torch.testing.assert_close(got[b], expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(block_size=BLOCK_SIZES, data=st.data(), seed=st.integers(0, 2**16))
def test_mixed_prefill_and_decode_equals_dense(block_size, data, seed):
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    chunks = [data.draw(st.integers(1, n)) for n in lengths]
    keys, values, gen = random_sequences(lengths, 2, 8, seed)
    key_cache, value_cache, tables = paged_from_sequences(keys, values, block_size, seed)
    query = torch.randn(sum(chunks), 2, 8, generator=gen)
    starts = torch.tensor([0] + chunks).cumsum(0).to(torch.int32)
    got = attention.paged_attention(query, key_cache, value_cache, tables, torch.tensor(lengths), starts)
    for b, (n, c) in enumerate(zip(lengths, chunks)):
        expected = dense(query[starts[b] : starts[b + 1]], keys[b], values[b], n - c, 8**-0.5)
        torch.testing.assert_close(got[starts[b] : starts[b + 1]], expected, atol=1e-5, rtol=1e-5)


def test_mixed_form_with_chunks_of_one_is_the_decode_form():
    keys, values, gen = random_sequences([5, 9, 2], 2, 8, 3)
    key_cache, value_cache, tables = paged_from_sequences(keys, values, 3, 3)
    query, lengths = torch.randn(3, 2, 8, generator=gen), torch.tensor([5, 9, 2])
    decode = attention.paged_decode_attention(query, key_cache, value_cache, tables, lengths)
    mixed = attention.paged_attention(query, key_cache, value_cache, tables, lengths, torch.tensor([0, 1, 2, 3]))
    torch.testing.assert_close(decode, mixed)


@settings(max_examples=20, deadline=None)
@given(block_size=BLOCK_SIZES, n=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_write_then_gather_round_trips(block_size, n, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(n / block_size) + 2
    table = torch.randperm(num_blocks, generator=gen)[: math.ceil(n / block_size)]
    slots = torch.tensor([int(table[t // block_size]) * block_size + t % block_size for t in range(n)])
    key_cache, value_cache = torch.zeros(num_blocks, block_size, 2, 4), torch.zeros(num_blocks, block_size, 2, 4)
    k, v = torch.randn(n, 2, 4, generator=gen), torch.randn(n, 2, 4, generator=gen)
    attention.write_to_cache(k, v, key_cache, value_cache, slots)
    assert torch.equal(attention.gather_kv(key_cache, table, n), k)
    assert torch.equal(attention.gather_kv(value_cache, table, n), v)


def test_bad_shapes_are_refused_clearly():
    cache = torch.zeros(4, 3, 2, 8)
    with pytest.raises(ValueError, match="query must be"):
        attention.paged_decode_attention(
            torch.zeros(1, 2, 4), cache, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3])
        )
    with pytest.raises(ValueError, match="seq_len"):
        attention.paged_decode_attention(
            torch.zeros(1, 2, 8), cache, cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([7])
        )
    with pytest.raises(ValueError, match="slot_mapping"):
        attention.write_to_cache(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), cache, cache, torch.tensor([1]))
    with pytest.raises(ValueError, match="query_start_loc"):
        attention.paged_attention(
            torch.zeros(3, 2, 8),
            cache,
            cache,
            torch.zeros(1, 2, dtype=torch.int32),
            torch.tensor([3]),
            torch.tensor([0, 2]),
        )


# ----------------------------------------------------------------------------- Triton, interpreted
_INTERPRETED = """
import sys, torch
from kvcourse import attention
from kvcourse.engine.llm_engine import LLMEngine, hf_greedy
from kvcourse.models.gpt2 import load_gpt2
torch.set_num_threads(1)
cases = torch.load(sys.argv[1])
out = {name: attention.triton_paged_decode_attention(*args) for name, args in cases.items()}
model = load_gpt2("tiny", verbose=False)
prompts = [[464, 3139, 286, 4881, 318], [40, 588, 257]]
engine = LLMEngine(model, num_blocks=8, block_size=4, attention="triton")
out["engine_matches_hf"] = engine.generate(prompts, 3) == [hf_greedy(model, p, 3) for p in prompts]
torch.save(out, sys.argv[2])
"""


def _triton_cases():
    """(name -> kernel arguments, name -> expected) for a few tiny shapes."""
    cases, expected = {}, {}
    for name, block_size, lengths, heads, head_dim, seed in [
        ("bs1", 1, [1, 4], 1, 4, 0),
        ("bs3", 3, [2, 7, 9, 3], 2, 8, 1),
        ("bs16", 16, [17, 5], 2, 12, 2),
        ("one", 3, [10], 3, 16, 3),
    ]:
        keys, values, gen = random_sequences(lengths, heads, head_dim, seed)
        key_cache, value_cache, tables = paged_from_sequences(keys, values, block_size, seed)
        query = torch.randn(len(lengths), heads, head_dim, generator=gen)
        cases[name] = (query, key_cache, value_cache, tables, torch.tensor(lengths), 0.25)
        expected[name] = torch.stack(
            [dense(query[b : b + 1], keys[b], values[b], None, 0.25)[0] for b in range(len(lengths))]
        )
    return cases, expected


@pytest.fixture(scope="module")
def interpreted():
    """Kernel outputs and a Triton-attention engine run, from one process with TRITON_INTERPRET=1."""
    cases, expected = _triton_cases()
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


@pytest.mark.parametrize("name", ["bs1", "bs3", "bs16", "one"])
def test_triton_kernel_interpreted_equals_dense(interpreted, name):
    out, expected = interpreted
    torch.testing.assert_close(out[name], expected[name], atol=1e-5, rtol=1e-5)


def test_triton_engine_interpreted_matches_hugging_face(interpreted):
    out, _ = interpreted
    assert out["engine_matches_hf"]


def test_triton_on_cpu_without_the_interpreter_says_how_to_fix_it():
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(attention._paged_decode_kernel, InterpretedFunction):
        pytest.skip("this process runs Triton in its interpreter")
    cases, _ = _triton_cases()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        attention.triton_paged_decode_attention(*cases["bs3"])


# ----------------------------------------------------------------------------- Triton, compiled on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernel runs on a GPU only")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float16, 2e-3)])
def test_triton_kernel_compiled_equals_reference(dtype, tol):
    keys, values, gen = random_sequences([1, 17, 300, 64], 12, 64, 7)
    key_cache, value_cache, tables = paged_from_sequences(keys, values, 16, 7)
    query = torch.randn(4, 12, 64, generator=gen)
    args = [
        x.cuda()
        for x in (query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables, torch.tensor([1, 17, 300, 64]))
    ]
    got = attention.triton_paged_decode_attention(*args)
    ref = attention.paged_decode_attention(*args)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)

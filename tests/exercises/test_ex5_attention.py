"""Graded tests for lesson 05: cache writes, paged attention (reference, mixed, Triton), model-runner inputs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvcourse import attention
from kvcourse.model_runner import prepare_inputs

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers (independent of the exercises)
def make_paged(lengths: list[int], block_size: int, heads: int = 2, head_dim: int = 8, seed: int = 0, spare: int = 3):
    """Random K/V for sequences of these lengths, stored in shuffled blocks; also the contiguous originals."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(needed) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    key_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)
    width = max(needed) + 1  # one padding column: a junk block id that must never be read
    tables, keys, values = [], [], []
    for n, k in zip(lengths, needed):
        row, order = order[:k], order[k:]
        seq_k = torch.randn(n, heads, head_dim, generator=gen)
        seq_v = torch.randn(n, heads, head_dim, generator=gen)
        for t in range(n):
            key_cache[row[t // block_size], t % block_size] = seq_k[t]
            value_cache[row[t // block_size], t % block_size] = seq_v[t]
        tables.append(row + [num_blocks - 1] * (width - k))
        keys.append(seq_k)
        values.append(seq_v)
    return key_cache, value_cache, torch.tensor(tables, dtype=torch.int32), keys, values


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None) -> torch.Tensor:
    """Plain attention of q [L, H, D] over k, v [S, H, D]; causal with query i at position offset + i."""
    scores = torch.einsum("lhd,shd->hls", q, k) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        pos_q = torch.arange(q.shape[0])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos_q, float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(scores, -1), v)


def decode_case(block_size: int, lengths: list[int], seed: int = 0):
    """Arguments for a decode step and its dense answer."""
    key_cache, value_cache, tables, keys, values = make_paged(lengths, block_size, seed=seed)
    query = torch.randn(len(lengths), 2, 8, generator=torch.Generator().manual_seed(seed + 1))
    expected = torch.stack(
        [dense_attention(query[b : b + 1], keys[b], values[b], None)[0] for b in range(len(lengths))]
    )
    return (query, key_cache, value_cache, tables, torch.tensor(lengths)), expected


# ----------------------------------------------------------------------------- 5.1
@pytest.mark.ex5_1
def test_write_to_cache_puts_each_token_at_its_slot():
    gen = torch.Generator().manual_seed(1)
    key_cache, value_cache = torch.zeros(6, 4, 2, 3), torch.zeros(6, 4, 2, 3)
    keys, values = torch.randn(5, 2, 3, generator=gen), torch.randn(5, 2, 3, generator=gen)
    slots = torch.tensor([13, 2, 21, 3, 8])
    attention.write_to_cache(keys, values, key_cache, value_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        assert torch.equal(key_cache[block, offset], keys[t]), (
            "a key did not land in its slot (block id * block_size + offset)"
        )
        assert torch.equal(value_cache[block, offset], values[t]), "a value did not land in its slot"


@pytest.mark.ex5_1
def test_write_to_cache_changes_nothing_else_and_works_in_place():
    key_cache, value_cache = torch.full((4, 3, 1, 2), 7.0), torch.full((4, 3, 1, 2), 7.0)
    before = key_cache
    attention.write_to_cache(torch.zeros(2, 1, 2), torch.zeros(2, 1, 2), key_cache, value_cache, torch.tensor([4, 11]))
    assert key_cache is before, "write_to_cache must fill the cache it was given, not make a new one"
    touched = torch.zeros(12, dtype=torch.bool)
    touched[[4, 11]] = True
    flat_k, flat_v = key_cache.view(12, -1), value_cache.view(12, -1)
    assert (flat_k[touched] == 0).all() and (flat_v[touched] == 0).all(), "the given slots were not written in place"
    assert (flat_k[~touched] == 7).all() and (flat_v[~touched] == 7).all(), (
        "slots that were not in slot_mapping changed"
    )


# ----------------------------------------------------------------------------- 5.2
@pytest.mark.ex5_2
def test_gather_kv_reads_a_sequence_back_in_order():
    key_cache, _, tables, keys, _ = make_paged([7, 2], block_size=3)
    got = attention.gather_kv(key_cache, tables[0], 7)
    assert got.shape == keys[0].shape, "gather_kv should return [seq_len, H, D]"
    assert torch.equal(got, keys[0]), "gather_kv did not return the sequence's tokens in order"


@pytest.mark.ex5_2
@pytest.mark.parametrize("block_size, lengths", [(1, [3]), (3, [1, 5, 9, 4]), (16, [17, 3])])
def test_paged_decode_attention_equals_dense_attention(block_size, lengths):
    args, expected = decode_case(block_size, lengths)
    got = attention.paged_decode_attention(*args)
    assert got.shape == expected.shape, "the output should have the query's shape [B, H, D]"
    assert torch.allclose(got, expected, atol=1e-5), (
        "paged decode attention differs from attention over the same keys and values"
    )


@pytest.mark.ex5_2
def test_paged_decode_attention_uses_the_scale():
    args, _ = decode_case(3, [4, 6])
    plain = attention.paged_decode_attention(*args)
    scaled = attention.paged_decode_attention(*args, scale=0.05)
    assert not torch.allclose(plain, scaled), "the scale argument had no effect on the result"


# ----------------------------------------------------------------------------- 5.3
def mixed_case(block_size: int, lengths: list[int], chunks: list[int], seed: int = 2):
    """A mixed batch: sequence b's last chunks[b] tokens are the queries; its whole length is cached."""
    key_cache, value_cache, tables, keys, values = make_paged(lengths, block_size, seed=seed)
    query = torch.randn(sum(chunks), 2, 8, generator=torch.Generator().manual_seed(seed + 1))
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    expected = torch.cat(
        [
            dense_attention(query[starts[b] : starts[b + 1]], keys[b], values[b], lengths[b] - chunks[b])
            for b in range(len(lengths))
        ]
    )
    args = (query, key_cache, value_cache, tables, torch.tensor(lengths), torch.tensor(starts, dtype=torch.int32))
    return args, expected


@pytest.mark.ex5_3
def test_paged_attention_fresh_prefill_is_causal():
    args, expected = mixed_case(4, [6], [6])
    got = attention.paged_attention(*args)
    assert torch.allclose(got, expected, atol=1e-5), (
        "a prefill of a new prompt must attend causally (each token to itself and earlier ones)"
    )


@pytest.mark.ex5_3
def test_paged_attention_mixes_chunks_and_decodes():
    # a chunk continuing a cached prefix, a decode, a fresh prefill
    args, expected = mixed_case(3, [10, 7, 4], [4, 1, 4])
    got = attention.paged_attention(*args)
    assert got.shape == expected.shape, "the output should have the query's shape [T, H, D]"
    assert torch.allclose(got, expected, atol=1e-5), "a chunk must see its cached prefix and, causally, itself"


# ----------------------------------------------------------------------------- 5.4 (Triton, in its CPU interpreter)
_TRITON_SCRIPT = """
import sys, torch
from kvcourse import attention
cases = torch.load(sys.argv[1])
results = {}
for name, args in cases.items():
    try:
        results[name] = attention.triton_paged_decode_attention(*args)
    except Exception as error:
        results[name] = (type(error).__name__, str(error).splitlines()[0] if str(error) else "")
torch.save(results, sys.argv[2])
"""

TRITON_CASES = {"block3": (3, [1, 5, 9, 4]), "block16": (16, [17, 3]), "block1": (1, [2, 5])}


@pytest.fixture(scope="module")
def triton_results():
    """Run every case through the learner's kernel in one fresh process with TRITON_INTERPRET=1 set first."""
    cases = {name: decode_case(bs, lengths, seed=5) for name, (bs, lengths) in TRITON_CASES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({name: args for name, (args, _) in cases.items()}, f"{tmp}/in.pt")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run(
            [sys.executable, "-c", _TRITON_SCRIPT, f"{tmp}/in.pt", f"{tmp}/out.pt"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the Triton check could not run: {done.stderr.strip().splitlines()[-1:]}")
        results = torch.load(f"{tmp}/out.pt")
    return {name: (results[name], cases[name][1]) for name in cases}


def _triton_output(triton_results, name: str) -> torch.Tensor:
    """The kernel's output for one case, or the learner's error raised again here."""
    got, _ = triton_results[name]
    if isinstance(got, tuple):
        kind, message = got
        if kind == "NotImplementedError":
            raise NotImplementedError(message)
        raise RuntimeError(f"the kernel raised {kind}: {message}")
    return got


@pytest.mark.ex5_4
@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_kernel_equals_dense_attention(triton_results, name):
    got = _triton_output(triton_results, name)
    expected = triton_results[name][1]
    assert torch.isfinite(got).all(), "the kernel wrote NaN or infinity (check the online-softmax rescaling and masks)"
    assert torch.allclose(got, expected, atol=1e-5), (
        "the Triton kernel differs from attention over the same keys and values"
    )


# ----------------------------------------------------------------------------- 5.4 (the same kernel, as a GPU compiles it)
# The interpreter runs the kernel as Python; the GPU compiler has rules of its own (one type per loop
# variable, power-of-two blocks, compile-time constants...). No GPU is needed to apply them: Triton
# compiles for A100 (sm_80) and H100/H200 (sm_90) right here. Compiled results are cached per source.
COMPILE_TARGETS = [(arch, dtype) for arch in (80, 90) for dtype in ("fp16", "bf16", "fp32")]


@pytest.mark.ex5_4
@pytest.mark.parametrize("arch, dtype", COMPILE_TARGETS, ids=[f"sm{a}-{d}" for a, d in COMPILE_TARGETS])
def test_triton_kernel_compiles_for_gpus(arch, dtype):
    from kvcourse.course.kernel_compile import assert_decode_kernel_compiles, stub_message

    kernel = attention._paged_decode_kernel
    if stub_message(kernel):
        raise NotImplementedError(stub_message(kernel))
    compiled = assert_decode_kernel_compiles(kernel, archs=(arch,), dtypes=(dtype,))[0]
    assert compiled.ptx and compiled.cubin, "the compiler returned no GPU code for your kernel"


# ----------------------------------------------------------------------------- 5.5
@dataclass
class Seq:
    """The fields of the scheduler's ScheduledSequence that the runner reads."""

    request_id: int
    tokens: list[int]
    is_decode: bool
    position_ids_start: int


def _batch():
    batch = [Seq(7, [11], True, 9), Seq(3, [20, 21, 22, 23, 24], False, 2), Seq(5, [30, 31], False, 0)]
    tables = {7: [4, 0, 2], 3: [6, 1], 5: [5]}
    return batch, tables


@pytest.mark.ex5_5
def test_positions_start_where_the_cache_ends():
    batch, tables = _batch()
    inputs = prepare_inputs(batch, tables, block_size=4)
    assert inputs.input_ids.tolist() == [11, 20, 21, 22, 23, 24, 30, 31], (
        "input_ids should be every scheduled token, sequence after sequence"
    )
    assert inputs.positions.tolist()[:1] == [9], "a decode's position should be the number of tokens already cached"
    assert inputs.positions.tolist()[1:6] == [2, 3, 4, 5, 6], (
        "a chunk's positions should continue from its cached prefix"
    )
    assert inputs.positions.tolist()[6:] == [0, 1], "a new prompt's positions should start at 0"


@pytest.mark.ex5_5
def test_slots_follow_the_block_tables():
    batch, tables = _batch()
    inputs = prepare_inputs(batch, tables, block_size=4)
    slots = inputs.slot_mapping.tolist()
    assert len(slots) == 8, "there should be one slot per scheduled token"
    assert slots[0] == 2 * 4 + 1, (
        "the decode's slot is wrong (physical block from the table, times block_size, plus offset)"
    )
    assert slots[1:6] == [6 * 4 + 2, 6 * 4 + 3, 1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2], (
        "a chunk crossing a block boundary got the wrong slots"
    )
    assert slots[6:] == [5 * 4 + 0, 5 * 4 + 1], "a new prompt's slots are wrong"


@pytest.mark.ex5_5
def test_lengths_starts_and_sample_positions():
    batch, tables = _batch()
    inputs = prepare_inputs(batch, tables, block_size=4)
    assert inputs.seq_lens.tolist() == [10, 7, 2], (
        "seq_lens should count each sequence's tokens in the cache after this step"
    )
    assert inputs.query_start_loc.tolist() == [0, 1, 6, 8], (
        "query_start_loc should mark where each sequence's tokens start"
    )
    assert inputs.logits_indices.tolist() == [0, 5, 7], "logits_indices should point at each sequence's last token"
    assert inputs.block_tables.shape == (3, 3), "block_tables should be [B, longest table]"


@pytest.mark.ex5_5
def test_runner_reproduces_hugging_face_greedy():
    from kvcourse.engine import hf_greedy
    from kvcourse.model_runner import ModelRunner
    from kvcourse.models import load_gpt2

    model = load_gpt2("tiny", verbose=False)
    prompt = [464, 3139, 286, 4881, 318, 257, 1748, 1900, 329]
    expected = hf_greedy(model, prompt, 4)
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    table = {0: [5, 2, 7, 0]}
    out = runner.execute([Seq(0, prompt[:5], False, 0)], table)  # a first chunk
    out = runner.execute([Seq(0, prompt[5:], False, 5)], table)  # the rest of the prompt
    tokens = [out[0]]
    for _ in range(3):
        tokens.append(runner.execute([Seq(0, [tokens[-1]], True, len(prompt) + len(tokens) - 1)], table)[0])
    assert tokens == expected, (
        "GPT-2 through your runner and the paged cache chose different tokens than Hugging Face's generate"
    )


@pytest.mark.ex5_5
def test_a_long_chunk_crosses_its_blocks_in_table_order():
    table = [9, 3, 14, 0, 7, 11, 2]  # shuffled physical blocks
    batch = [Seq(1, list(range(100, 150)), False, 3), Seq(2, [5], True, 20), Seq(4, [6], True, 1)]
    inputs = prepare_inputs(batch, {1: table, 2: [4, 8, 1, 5, 6, 10], 4: [12]}, block_size=8)
    expected_positions = list(range(3, 53)) + [20, 1]
    assert inputs.positions.tolist() == expected_positions, "positions should run on from each chunk's start"
    tables = [table] * 50 + [[4, 8, 1, 5, 6, 10], [12]]
    expected_slots = [row[p // 8] * 8 + p % 8 for row, p in zip(tables, expected_positions)]
    assert inputs.slot_mapping.tolist() == expected_slots, (
        "a 50-token chunk starting mid-block should take its slots from the table, block after block"
    )
    assert inputs.seq_lens.tolist() == [53, 21, 2] and inputs.logits_indices.tolist() == [49, 50, 51]

"""Workloads for chapter 5 (5.1-5.5): paged cache writes, decode and mixed attention, the Triton kernel, inputs.

Tensors are built from the op's seed (plain data in, plain data out) and observed as float lists. Adversarial
on purpose: fp32, fp16 and bf16; scores up to about 1e4 (a softmax without its running max, or without the
float32 upcast, overflows: fp16 ends at 65,504); head dim 80 (not a power of two); an explicit `scale` that
is not 1/sqrt(D); caches held as views of one buffer (a copy is lost); block ids past 2**31 in 5.5.
Grouped-query attention: every op carries num_kv_heads; KV_HEADS_DIVISOR = 1 keeps KVH == H (today's
contract); set it to 2 or 4 once attention takes query [B, H, D] over caches [N, block, KVH, D].
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from types import ModuleType

import torch

from .core import error_record, module_files

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_HEADS_DIVISOR = 2  # H // KVH; the lead flips this when attention becomes grouped-query (branch a1-model)
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}  # per output dtype, relative AND absolute


def _shape(rng: random.Random) -> dict:
    """Heads, head dim (80 among them), block size, dtype, scale and the scores' magnitude."""
    heads = rng.choice([1, 2, 4])
    return {
        "heads": heads,
        "kv_heads": max(1, heads // KV_HEADS_DIVISOR),
        "dim": rng.choice([4, 16, 80]),
        "block": rng.choice([1, 2, 4, 16]),
        "dtype": rng.choice(list(DTYPES)),
        "scale": rng.choice([None, 0.05, 1.0]),
        "big": rng.random() < 0.4,  # scores up to ~1e4
        "seed": rng.randrange(2**31),
    }


def attention_ops(exercise_id: str, seed: int, size: str) -> list:
    """A few calls of the exercise's function, each with its own shapes and data."""
    rng = random.Random(f"{exercise_id}/{seed}")
    ops: list = [["config", {}]]
    if exercise_id in ("5.2", "5.3"):  # every seed: float16 scores past 65,504 (the upcast is the contract's)
        extra = random.Random(f"w{exercise_id}/{seed}")
        shape = {**_shape(extra), "dtype": "float16", "big": True, "dim": 80, "scale": extra.choice([None, 1.0])}
        block = shape["block"]
        ops.append([exercise_id, shape, [extra.choice([block + 1, 3 * block + 1, 9]), extra.choice([2, 5])]])
    for _ in range(4 if size == "small" else 20):
        shape = _shape(rng)
        if exercise_id == "5.5":
            ops.append(["layout", rng.randrange(2**31), rng.choice([1, 2, 3]), shape["block"]])
        else:
            lens = [
                rng.choice([1, 2, shape["block"], shape["block"] + 1, 3 * shape["block"] + 1])
                for _ in range(rng.choice([1, 2, 3]))
            ]
            ops.append([exercise_id, shape, lens])
    return ops


def _tensors(shape: dict, lens: list[int]) -> dict:
    """Caches (views of one buffer) with each sequence's blocks scattered, queries, and the tables."""
    gen = torch.Generator().manual_seed(shape["seed"])
    dtype, block, kvh, dim = (
        DTYPES[shape["dtype"]],
        shape["block"],
        shape["kv_heads"],
        shape["dim"],
    )
    per_seq = [-(-n // block) for n in lens]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for count in per_seq:
        tables.append(order[at : at + count])
        at += count
    width = max(per_seq)
    magnitude = 60.0 if shape["big"] else 1.0  # with D = 80 and scale 1/sqrt(D): scores ~ 1e4 (fp16 overflows raw)
    buffer = (torch.randn(2, num_blocks, block, kvh, dim, generator=gen) * magnitude).to(dtype)
    return {
        "buffer": buffer,
        "key_cache": buffer[0],
        "value_cache": buffer[1],
        # padding past the valid entries names a block that does not exist: reading it is an error
        "block_tables": torch.tensor([t + [num_blocks + 1000] * (width - len(t)) for t in tables], dtype=torch.int32),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "gen": gen,
        "magnitude": magnitude,
    }


def _floats(tensor: torch.Tensor) -> list:
    """A tensor as a flat list of Python floats (fp16/bf16 upcast exactly)."""
    return tensor.detach().float().flatten().tolist()


def _call(exercise_id: str, shape: dict, lens: list[int], attention: ModuleType) -> dict:
    """Run one op of 5.1-5.4; the observation is the output (or the caches) as float lists."""
    t = _tensors(shape, lens)
    dtype, heads, dim = DTYPES[shape["dtype"]], shape["heads"], shape["dim"]
    gen, magnitude = t["gen"], t["magnitude"]
    key = f"out_{shape['dtype']}"
    if exercise_id == "5.1":
        tokens = sum(lens)
        total_slots = t["key_cache"].shape[0] * shape["block"]
        slots = torch.randperm(total_slots, generator=gen)[:tokens]
        new_k = (
            torch.randn(tokens, shape["kv_heads"], dim, generator=gen) * magnitude
        )  # float32: stored in the cache's dtype
        new_v = torch.randn(tokens, shape["kv_heads"], dim, generator=gen) * magnitude
        before = t["buffer"].data_ptr()
        attention.write_to_cache(new_k, new_v, t["key_cache"], t["value_cache"], slots)
        return {
            key: _floats(t["buffer"]),
            "dtype": str(t["buffer"].dtype),
            "in_place": t["buffer"].data_ptr() == before,
        }
    scale = shape["scale"]
    if exercise_id in ("5.2", "5.4"):
        query = (torch.randn(len(lens), heads, dim, generator=gen) * magnitude).to(dtype)
        fn = attention.paged_decode_attention if exercise_id == "5.2" else attention.triton_paged_decode_attention
        out = fn(query, t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"], scale=scale)
        obs = {key: _floats(out), "dtype": str(out.dtype), "shape": list(out.shape)}
        if exercise_id == "5.2":
            gathered = attention.gather_kv(t["key_cache"], t["block_tables"][0], lens[0])
            obs["gather_kv"] = _floats(gathered)
            obs["gather_shape"] = list(gathered.shape)
        return obs
    chunks = [max(1, min(n, random.Random(shape["seed"] + n).choice([1, n, (n + 1) // 2]))) for n in lens]
    query = (torch.randn(sum(chunks), heads, dim, generator=gen) * magnitude).to(dtype)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    out = attention.paged_attention(
        query, t["key_cache"], t["value_cache"], t["block_tables"], t["seq_lens"], starts, scale=scale
    )
    chunk = attention._chunk_attention(
        query[: chunks[0]], t["key_cache"], t["value_cache"], t["block_tables"][0], lens[0], scale or dim**-0.5
    )
    return {key: _floats(out), "dtype": str(out.dtype), "shape": list(out.shape), "chunk_dtype": str(chunk.dtype)}


def _layout(op: list, runner: ModuleType) -> dict:
    """5.5's token_layout on tables whose block ids go past 2**31."""
    _, first_id, batch, block = op
    rng = random.Random(first_id)
    starts = [rng.choice([0, 1, block, 3 * block - 1]) for _ in range(batch)]
    counts = [rng.choice([1, 1, block, 2 * block + 1]) for _ in range(batch)]
    width = max(-(-(s + n) // block) for s, n in zip(starts, counts))
    table = torch.tensor(
        [[2**31 + first_id % 1000 + 7 * b + j for j in range(width)] for b in range(batch)], dtype=torch.long
    )
    num = torch.tensor(counts, dtype=torch.long)
    qsl = torch.zeros(batch + 1, dtype=torch.long)
    qsl[1:] = num.cumsum(0)
    positions, slots, seq_lens = runner.token_layout(table, torch.tensor(starts, dtype=torch.long), num, qsl, block)
    return {
        "positions": positions.tolist(),
        "slot_mapping": slots.tolist(),
        "seq_lens": seq_lens.tolist(),
        "dtype": [str(positions.dtype), str(slots.dtype)],
    }


def run_attention(ops: list, modules: Mapping[str, ModuleType]) -> list[dict]:
    """One record per call."""
    files = module_files(modules)
    records: list[dict] = []
    for index, op in enumerate(ops[1:], start=1):
        name = "token_layout" if op[0] == "layout" else {"5.1": "write_to_cache", "5.2": "paged_decode_attention",
                                                            "5.3": "paged_attention", "5.4": "triton_paged_decode_attention"}[op[0]]  # fmt: skip
        try:
            obs = (
                _layout(op, modules["model_runner"])
                if op[0] == "layout"
                else _call(op[0], op[1], op[2], modules["attention"])
            )
            records.append({"step": index, "call": f"{name}({_describe(op)})", "obs": obs})
        except Exception as error:
            records.append({"step": index, "call": f"{name}({_describe(op)})", **error_record(error, files)})
    return records


def _describe(op: list) -> str:
    """The op's shapes in words, for the message."""
    if op[0] == "layout":
        return f"block ids from {2**31 + op[1] % 1000}, {op[2]} sequences, block_size {op[3]}"
    s = op[1]
    return (f"{s['dtype']}, H={s['heads']}, KVH={s['kv_heads']}, D={s['dim']}, block_size={s['block']}, "
            f"scale={s['scale']}, seq_lens={op[2]}{', scores ~1e4' if s['big'] else ''}")  # fmt: skip

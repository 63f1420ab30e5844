"""A small stand-in for the lockstep harness (issue 35): it observes exercises 0.1 and 0.2 only.

Same interface as kvcourse.course.lockstep: observe() runs in the grader's untrusted child on the submitted
modules (and in a trusted process on the reference); compare() and seeds_for() run in the grader itself.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

SEEDS = {"0.1": [0, 1, 2], "0.2": [0, 1, 2], "5.2": [0, 1]}


@dataclass(frozen=True)
class Config:
    """A model config with transformers' generic attribute names (what kv_cache_spec reads)."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    max_position_embeddings: int = 1024


@dataclass(frozen=True)
class Divergence:
    """Where a submission's observations first differ from the reference's."""

    message: str


def seeds_for(exercise_id: str, size: str = "small") -> list[int]:
    """The seeds an exercise is observed on (none for exercises this fake does not know)."""
    return list(SEEDS.get(exercise_id, []))


def _configs(seed: int) -> list[Config]:
    rng = random.Random(seed)
    return [Config(64 * h, h, rng.randint(1, 24)) for h in (rng.randint(1, 12) for _ in range(3))]


def observe(exercise_id: str, seed: int, modules: Mapping[str, ModuleType], size: str = "small") -> list[dict]:
    """Call the exercise's function on seeded inputs; record what it returned, as plain data."""
    import torch

    if exercise_id == "5.2":
        return _decode(seed, modules["attention"])
    memory = modules["memory"]
    records = []
    for index, config in enumerate(_configs(seed)):
        if exercise_id == "0.1":
            for dtype in (torch.float16, torch.float32):
                got = memory.kv_bytes_per_token(config, dtype)
                records.append({"call": f"kv_bytes_per_token(config {index}, {dtype})", "type": type(got).__name__, "value": got})  # fmt: skip
        elif exercise_id == "0.2":
            budget, length = random.Random(seed * 7 + index).randint(0, 1 << 30), 128 * (index + 1)
            got = memory.max_sequences(budget, length, 4096 * (index + 1))
            records.append({"call": f"max_sequences({budget}, {length}, ...)", "type": type(got).__name__, "value": got})  # fmt: skip
    return records


def _decode(seed: int, attention: ModuleType) -> list[dict]:
    """Paged decode attention on a tiny seeded cache: two sequences of two-token blocks."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    key_cache, value_cache = (torch.randn(4, 2, 2, 4, generator=generator) for _ in range(2))
    query = torch.randn(2, 2, 4, generator=generator)
    tables, lengths = torch.tensor([[0, 1], [2, 3]]), torch.tensor([3, 2])
    got = attention.paged_decode_attention(query, key_cache, value_cache, tables, lengths)
    values = [round(float(x), 4) for x in got.flatten()] if isinstance(got, torch.Tensor) else repr(got)[:200]
    return [{"call": "paged_decode_attention(seeded cache)", "type": type(got).__name__, "value": values}]


def compare(exercise_id: str, seed: int, expected: list[dict], got: list[dict]) -> Divergence | None:
    """The first observation that differs, named without its expected value; None when all match."""
    if len(got) != len(expected):
        return Divergence(f"{len(got)} observations instead of {len(expected)}")
    for want, have in zip(expected, got, strict=True):
        if have != want:
            return Divergence(f"{want['call']} returned {have.get('value')!r} ({have.get('type')}), not the reference's value")  # fmt: skip
    return None

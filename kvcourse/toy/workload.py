"""Seeded toy requests: the same seed gives the same prompts."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvcourse.core.request import Request
from kvcourse.toy.model import TOY_VOCAB_SIZE


def toy_requests(
    prompt_lengths: Sequence[int],
    max_new_tokens: int | Sequence[int],
    seed: int = 0,
    vocab_size: int = TOY_VOCAB_SIZE,
    first_id: int = 0,
) -> list[Request]:
    """Requests with seeded random prompts of the given lengths (same seed, same prompts)."""
    rng = random.Random(seed)
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompt_lengths)
    return [
        Request(id=first_id + i, prompt_tokens=[rng.randrange(vocab_size) for _ in range(length)], max_new_tokens=m)
        for i, (length, m) in enumerate(zip(prompt_lengths, max_new_tokens))
    ]

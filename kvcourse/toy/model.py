"""The toy model: the next token is a hash of the WHOLE cached context, so any scheduling bug shows."""

from __future__ import annotations

from collections.abc import Sequence

TOY_VOCAB_SIZE = 1000
_MODULUS = (1 << 61) - 1  # a Mersenne prime: the context hash lives below it
_MULTIPLIER = 1_000_003


def _extend_hash(previous: int, token: int) -> int:
    """Hash of a context one token longer: every earlier token still counts."""
    return (previous * _MULTIPLIER + token + 1) % _MODULUS


def _token_from_hash(context_hash: int, vocab_size: int) -> int:
    """Spread the context hash over the vocabulary (a fixed mixing step, no randomness)."""
    mixed = (context_hash * 0x9E3779B97F4A7C15) % _MODULUS
    return (mixed >> 13) % vocab_size


def toy_next_token(context: Sequence[int], vocab_size: int = TOY_VOCAB_SIZE) -> int:
    """The toy model's prediction after `context`: a deterministic function of every token in it."""
    context_hash = 0
    for token in context:
        context_hash = _extend_hash(context_hash, token)
    return _token_from_hash(context_hash, vocab_size)


def toy_generate(
    prompt_tokens: Sequence[int],
    max_new_tokens: int,
    vocab_size: int = TOY_VOCAB_SIZE,
    eos_token_id: int | None = None,
) -> list[int]:
    """What the toy model generates with all the memory in the world: the reference for any scheduler."""
    context = list(prompt_tokens)
    outputs: list[int] = []
    while len(outputs) < max_new_tokens:
        token = toy_next_token(context, vocab_size)
        outputs.append(token)
        context.append(token)
        if token == eos_token_id:
            break
    return outputs

"""Mooncake's production request traces (FAST'25): load them, and turn their block hashes into tokens.

Each line of a trace is one request: its arrival (ms from the start), its input and output lengths in
tokens, and `hash_ids`, one id per 512-token block of the prompt (the last may be partial). Two requests
whose lists start with the same k ids share their first k x 512 tokens. No text or token ids were
released, so `prompt_tokens` makes stand-in tokens from the ids: equal ids give equal tokens and
different ids different ones, so the course's own hash chain (`hash_request_tokens`) shares exactly
what the trace shares. A scaled `block_size` (2 tokens stand for 512) keeps the replay cheap.

Source: github.com/kvcache-ai/Mooncake, FAST25-release/traces/ (Apache 2.0); notebooks/data/mooncake/.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvcourse.core.contract import blocks_needed
from kvcourse.core.request import Request, RequestStatus

TRACE_DIR = Path(__file__).resolve().parents[2] / "notebooks" / "data" / "mooncake"
TRACES = {"conversation": "conversation_trace.jsonl.gz", "synthetic": "synthetic_trace.jsonl.gz"}
TRACE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces
PROVENANCE = (
    "Mooncake FAST'25 traces, github.com/kvcache-ai/Mooncake FAST25-release/traces/ "
    "(commit 3b5a5941), Apache License 2.0"
)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrived, how long it is, and which 512-token blocks it shares."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def num_full_blocks(self) -> int:
        """Prompt blocks filled to 512 tokens: the only ones a prefix cache can share."""
        return self.input_length // TRACE_BLOCK_SIZE


def trace_path(name: str | Path) -> Path:
    """The file of a named trace ("conversation", "synthetic") or a path given as is."""
    if str(name) in TRACES:
        path = TRACE_DIR / TRACES[str(name)]
    else:
        path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"no trace at {path}; name one of {', '.join(TRACES)} (shipped in {TRACE_DIR}) or give a .jsonl(.gz) path."
        )
    return path


def _parse(line: str, where: str) -> TraceRequest:
    """One JSON line as a TraceRequest, or a ValueError naming the line and what is wrong with it."""
    try:
        row = json.loads(line)
        request = TraceRequest(
            int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), tuple(row["hash_ids"])
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{where}: not a trace request ({error!r}); each line must be a JSON object with "
            "timestamp, input_length, output_length and hash_ids."
        ) from None
    expected = blocks_needed(request.input_length, TRACE_BLOCK_SIZE)
    if request.input_length <= 0 or len(request.hash_ids) != expected:
        raise ValueError(
            f"{where}: input_length {request.input_length} needs {expected} hash ids of "
            f"{TRACE_BLOCK_SIZE}-token blocks, the line has {len(request.hash_ids)}."
        )
    return request


def iter_trace(name: str | Path = "conversation", limit: int | None = None) -> Iterator[TraceRequest]:
    """Yield a trace's requests in arrival order (the first `limit` of them, if given)."""
    path = trace_path(name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as lines:
        count = 0
        for number, line in enumerate(lines, start=1):
            if limit is not None and count >= limit:
                return
            if line.strip():
                yield _parse(line, f"{path.name}, line {number}")
                count += 1


def load_trace(name: str | Path = "conversation", limit: int | None = None) -> list[TraceRequest]:
    """A whole trace (or its first `limit` requests) as a list."""
    return list(iter_trace(name, limit))


def block_tokens(hash_id: int, block_size: int, vocab_size: int | None = None) -> list[int]:
    """Stand-in tokens of one trace block: equal ids give equal tokens, different ids different tokens.

    Without `vocab_size` the tokens are hash_id * block_size + offset (distinct for distinct ids). With
    it, they are drawn from the vocabulary by a hash of (id, offset): two different ids then give the
    same block with probability vocab_size ** -block_size (use blocks of 4 tokens or more).
    """
    if vocab_size is None:
        return [hash_id * block_size + offset for offset in range(block_size)]
    return [
        int.from_bytes(hashlib.blake2b(f"{hash_id}:{offset}".encode(), digest_size=8).digest(), "big") % vocab_size
        for offset in range(block_size)
    ]


def prompt_tokens(request: TraceRequest, block_size: int = 2, vocab_size: int | None = None) -> list[int]:
    """A prompt of `block_size`-token blocks standing for the request's 512-token blocks.

    Each full trace block becomes one full block; a partial last block becomes a partial block of
    about the same share (at least one token, never a full block), so it is never cached.
    """
    if block_size < 1:
        raise ValueError(f"block_size is {block_size}; a block holds at least one token.")
    full = request.num_full_blocks
    tokens = [token for i in request.hash_ids[:full] for token in block_tokens(i, block_size, vocab_size)]
    leftover = request.input_length - full * TRACE_BLOCK_SIZE
    if leftover:
        if block_size == 1:
            raise ValueError("block_size 1 cannot show a partial block; use 2 or more.")
        share = min(block_size - 1, max(1, round(leftover * block_size / TRACE_BLOCK_SIZE)))
        tokens += block_tokens(request.hash_ids[full], block_size, vocab_size)[:share]
    return tokens


def truncated(request: TraceRequest, max_blocks: int) -> TraceRequest:
    """The request cut to its first `max_blocks` blocks (its shared prefix is kept; the rest is dropped)."""
    if len(request.hash_ids) <= max_blocks:
        return request
    return TraceRequest(
        request.timestamp_ms, max_blocks * TRACE_BLOCK_SIZE, request.output_length, request.hash_ids[:max_blocks]
    )


def to_request(request: TraceRequest, request_id: int, block_size: int = 2) -> Request:
    """The trace request as a course Request (stand-in prompt, its real output length), already finished.

    Finished, because the theoretical replay only admits and frees it: `KVCacheManager.free` then drops
    its hash chain too.
    """
    made = Request(
        id=request_id, prompt_tokens=prompt_tokens(request, block_size), max_new_tokens=request.output_length
    )
    made.status = RequestStatus.FINISHED
    return made


__all__ = [
    "PROVENANCE",
    "TRACES",
    "TRACE_BLOCK_SIZE",
    "TRACE_DIR",
    "TraceRequest",
    "block_tokens",
    "iter_trace",
    "load_trace",
    "prompt_tokens",
    "to_request",
    "truncated",
]

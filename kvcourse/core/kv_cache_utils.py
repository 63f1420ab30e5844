"""Given pieces of the paged KV cache (vLLM keeps the same ones in vllm/v1/core/kv_cache_utils.py).

The block itself, the hash type, the prefix-cache counters, and the checks that refuse impossible
calls in words before anything changes. The exercises (kvcourse/kv_cache.py) build on these.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcourse.core.contract import KVCacheBlocks, check_token_count
from kvcourse.core.request import Request

BlockHash = bytes  # a SHA-256 digest: the same tokens give the same hash in every process
HASH_FUNCTION = hashlib.sha256  # vLLM's default; unlike Python's hash(), stable across processes


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One physical block of the KV cache: who holds it, and which tokens it caches, if any."""

    block_id: int
    ref_cnt: int = 0  # number of block tables holding this block
    block_hash: BlockHash | None = None  # set while the block is published in the prefix cache
    token_ids: tuple[int, ...] | None = None  # the tokens block_hash was computed from
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        """Short enough to print a whole block table (the hash cut to 8 hex digits)."""
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash is not None else ""
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


@dataclass
class PrefixCacheStats:
    """Prefix-cache hits counted at admission: how much prompt work the cache saved."""

    requests: int = 0  # admissions (a preempted request that resumes counts again)
    queries: int = 0  # tokens those requests needed
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        """Share of queried tokens served from the cache (0.0 before any admission)."""
        return self.hits / self.queries if self.queries else 0.0

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission: the tokens it needed and those the cache served."""
        self.requests += 1
        self.queries += request.num_tokens
        self.hits += num_hit_tokens


def check_held(blocks: Sequence[KVCacheBlock]) -> None:
    """Refuse to free a block more times than it is held (a double free corrupts the queue)."""
    for block, times in Counter(blocks).items():
        if times > block.ref_cnt:
            raise ValueError(f"block {block.block_id} freed twice: it is held {block.ref_cnt} time(s).")


def check_allocation(
    request: Request,
    held: Sequence[KVCacheBlock],
    block_size: int,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
) -> list[KVCacheBlock]:
    """Reject impossible allocate_slots arguments before anything changes; return the prefix hits as a list."""
    check_token_count("num_new_tokens", num_new_tokens)
    check_token_count("num_new_computed_tokens", num_new_computed_tokens)
    hits = list(new_computed_blocks.blocks) if new_computed_blocks is not None else []
    if not hits:
        return hits
    if held or request.num_computed_tokens:
        raise ValueError(
            f"request {request.id} already has blocks or computed tokens; prefix-cache hits "
            "(new_computed_blocks) are only taken when a request is admitted."
        )
    if num_new_computed_tokens != len(hits) * block_size:
        raise ValueError(
            f"num_new_computed_tokens is {num_new_computed_tokens} but the {len(hits)} hit block(s) "
            f"hold {len(hits) * block_size} tokens; pass both from get_computed_blocks()."
        )
    return hits


def check_fork(req_to_blocks: dict[int, list[KVCacheBlock]], parent: Request, child: Request) -> None:
    """A fork starts a child with no blocks from a parent that has some, at the same cached length."""
    if parent.id not in req_to_blocks:
        raise ValueError(f"cannot fork request {parent.id}: it holds no blocks.")
    if req_to_blocks.get(child.id):
        raise ValueError(f"cannot fork into request {child.id}: it already holds blocks.")
    if child.num_computed_tokens != parent.num_computed_tokens:
        raise ValueError(
            f"the child's num_computed_tokens ({child.num_computed_tokens}) must equal the parent's "
            f"({parent.num_computed_tokens}): a fork starts from the same cached tokens."
        )


def reset_refusal(num_held: int, num_blocks: int) -> str:
    """Why reset_prefix_cache said no, and what to do (as in vLLM, a reset waits until no request runs)."""
    return (
        f"reset_prefix_cache refused: {num_held} of {num_blocks} blocks are held by requests; "
        "finish or abort them (scheduler.finish_requests) and call it again."
    )


__all__ = [
    "HASH_FUNCTION",
    "BlockHash",
    "KVCacheBlock",
    "PrefixCacheStats",
    "check_allocation",
    "check_fork",
    "check_held",
    "reset_refusal",
]

"""The fast attention backend: one gather per layer through the block tables, then PyTorch's fused SDPA.

The reference (`kvcourse.attention`, the exercises) walks the batch one sequence at a time, so a step
costs a few small tensor operations per sequence per layer. Here everything that depends only on the
batch's shape is built once per step (`FastAttentionMetadata.build`, like vLLM's attention-metadata
builders), and each layer then costs a fixed handful of operations whatever the batch. The step's
sequences fall in at most two groups, the decodes (one query each) and the prefill chunks (padded to
the longest chunk), so that one long prompt does not pad every decode to its length. Per group:

    keys    = key_cache.view(-1, KVH, D).index_select(0, kv_slots)  # [b, S, KVH, D]: each sequence's past
    queries = query.index_select(0, query_index)                    # [b, L, H, D]: its chunk, padded
    out     = scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=KVH < H)

where S is the group's longest sequence, L its longest chunk (1 for decodes), and `mask[b, 0, i, j]`
is True when query i of sequence b may see key j: causal within its chunk, nothing at or past the
sequence's length (padding keys read whatever sits where the padding points, and are masked out).
Padded query rows repeat a real query; they are computed and dropped. Under grouped-query attention
(KVH < H) SDPA's `enable_gqa` lets query head h read KV head h // (H // KVH) without copying K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended to in one SDPA call: their slots, their mask, and where their queries sit."""

    kv_slots: torch.Tensor  # [b * S] long: the flat cache slot of each sequence's key j (padding past its length)
    mask: torch.Tensor  # [b, 1, L, S] bool: query i of sequence b may attend to key j
    query_index: torch.Tensor  # [b * L] long: the packed query in row (b, i) (padding rows repeat the last one)
    out_rows: torch.Tensor  # [n] long: the rows of the flattened [b * L] output that hold real queries ...
    out_tokens: torch.Tensor  # [n] long: ... and the packed positions they go back to


@dataclass(frozen=True)
class FastAttentionMetadata:
    """What every layer's attention reads, built once per step from the block tables and lengths."""

    groups: tuple[AttentionGroup, ...]
    num_tokens: int

    @classmethod
    def build(
        cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int
    ) -> FastAttentionMetadata:
        """Slots to gather and the causal / variable-length masks, from the runner's step tensors."""
        seq_lens, starts = seq_lens.long(), query_start_loc.long()
        chunk_lens = starts[1:] - starts[:-1]  # [B] queries per sequence
        if bool((chunk_lens < 1).any()) or bool((chunk_lens > seq_lens).any()):
            raise ValueError(
                f"every sequence needs between 1 and seq_len queries; got chunks {chunk_lens.tolist()} "
                f"for seq_lens {seq_lens.tolist()}."
            )
        decodes = chunk_lens == 1
        groups = tuple(
            _group(block_tables.long()[which], seq_lens[which], starts[:-1][which], chunk_lens[which], block_size)
            for which in (decodes.nonzero()[:, 0], (~decodes).nonzero()[:, 0])
            if which.numel()
        )
        return cls(groups, int(starts[-1]))


def _group(
    tables: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor, chunk_lens: torch.Tensor, block_size: int
) -> AttentionGroup:
    """One group's gather indices and mask (sequences b, keys j < S, query rows i < L)."""
    device = tables.device
    key_pos = torch.arange(int(seq_lens.max()), device=device)  # [S]
    kv_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [b, S]
    rows = torch.arange(int(chunk_lens.max()), device=device)  # [L]
    real = rows[None, :] < chunk_lens[:, None]  # [b, L]: row i holds a real query
    row_in_chunk = torch.minimum(rows[None, :], chunk_lens[:, None] - 1)  # padding repeats the last query
    query_pos = seq_lens[:, None] - chunk_lens[:, None] + row_in_chunk  # [b, L]: query i's position
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [b, L, S]: causal, and never past seq_len
    query_index = starts[:, None] + row_in_chunk  # [b, L]
    return AttentionGroup(
        kv_slots.reshape(-1),
        mask[:, None],
        query_index.reshape(-1),
        real.reshape(-1).nonzero()[:, 0],
        query_index[real],
    )


def fast_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: FastAttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention for a packed batch of prefill chunks and decodes, [T, H, D] in and out: same answer as paged_attention."""
    if (
        query.dim() != 3
        or key_cache.dim() != 4
        or query.shape[2] != key_cache.shape[3]
        or query.shape[1] % key_cache.shape[2]
    ):
        raise ValueError(
            "query must be [T, H, D] and the caches [num_blocks, block_size, KVH, D] with the same D and H a "
            f"multiple of KVH; got {tuple(query.shape)} and {tuple(key_cache.shape)}."
        )
    if query.shape[0] != metadata.num_tokens:
        raise ValueError(f"the metadata describes {metadata.num_tokens} queries; got {query.shape[0]}.")
    heads, head_dim = query.shape[1:]
    kv_heads = key_cache.shape[2]
    keys_flat, values_flat = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(query) if len(metadata.groups) > 1 else None
    for group in metadata.groups:
        batch, _, rows, seq = group.mask.shape
        keys = keys_flat.index_select(0, group.kv_slots).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        values = values_flat.index_select(0, group.kv_slots).view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        queries = query.index_select(0, group.query_index).view(batch, rows, heads, head_dim).transpose(1, 2)
        result = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.mask, scale=scale, enable_gqa=kv_heads < heads
        )
        result = result.transpose(1, 2).reshape(batch * rows, heads, head_dim).index_select(0, group.out_rows)
        if out is None:  # the step's only group: its real rows are every query, already in packed order
            return result
        out.index_copy_(0, group.out_tokens, result)
    return out

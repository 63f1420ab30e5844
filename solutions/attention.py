"""Paged attention: write K/V into fixed-size blocks, and read them back through a block table.

Shapes used throughout (the names of vLLM and nano-vllm):

    key_cache, value_cache  [num_blocks, block_size, KVH, D]   one layer's paged KV storage
    slot_mapping            [T]        where token t's K/V go: block_id * block_size + offset
    block_tables            [B, max_blocks] int32   row b lists sequence b's blocks in order
    seq_lens                [B]        tokens of sequence b in the cache, including this step's
    query (decode)          [B, H, D]  one new token per sequence
    query (mixed)           [T, H, D]  every scheduled token, sequences one after another
    query_start_loc         [B + 1]    sequence b's queries are query[query_start_loc[b]:query_start_loc[b+1]]

Grouped-query attention (Llama, SmolLM2): the cache stores KVH heads, fewer than the H query heads;
H is a multiple of KVH and query head h reads KV head h // (H // KVH). GPT-2 has KVH == H.
A block table may list more blocks than a sequence uses (rows are padded to the longest one);
only the first ceil(seq_len / block_size) entries of a row are ever read.
"""

from __future__ import annotations

import torch

from kvcourse.backends.triton_decode import jit, launch_paged_decode, tl
from kvcourse.core.contract import blocks_needed
from kvcourse.worker.attention_checks import check_decode, check_mixed, check_write


def write_to_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's key and value ([T, KVH, D]) at its slot, so later steps read them instead of recomputing."""
    check_write(key, value, key_cache, value_cache, slot_mapping)
    # Exercise 5.1 (contract): afterwards, for every t, the cache entry at slot slot_mapping[t]
    # (slot = block_id * block_size + offset) holds key[t] in key_cache and value[t] in value_cache,
    # in the cache's dtype; every other slot is unchanged. The caches change IN PLACE: callers keep
    # their references, so writing into a copy is lost.
    # BEGIN SOLUTION 5.1
    slots = slot_mapping.long()
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)
    # END SOLUTION


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Read one sequence's tokens back in order, [seq_len, KVH, D]: the inverse of write_to_cache."""
    # Exercise 5.2 (part 1, contract): return [seq_len, KVH, D] whose row p is the entry the sequence
    # wrote for position p (logical block p // block_size of block_table, offset p % block_size).
    # Only the first blocks_needed(seq_len, block_size) entries of block_table are valid (the rest is padding).
    # BEGIN SOLUTION 5.2
    num_blocks = blocks_needed(seq_len, cache.shape[1])
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]
    # END SOLUTION


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention for one new token per sequence over its paged past: the reference the kernel must match."""
    check_decode(query, key_cache, value_cache, block_tables, seq_lens)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    # Exercise 5.2 (part 2, contract): out[b, h] equals scaled dot-product attention of query[b, h]
    # (one token) over the first seq_lens[b] keys and values of sequence b in KV head
    # h // (H // KVH) (grouped-query attention: several query heads share one KV head), read through
    # its block table (gather_kv), with the given scale; computed in float32, stored in out's dtype.
    # BEGIN SOLUTION 5.2
    group = query.shape[1] // key_cache.shape[2]  # query heads per KV head
    for b in range(query.shape[0]):
        seq_len = int(seq_lens[b])
        keys = gather_kv(key_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)  # [S, H, D]
        values = gather_kv(value_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", query[b].float(), keys) * scale
        weights = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hs,shd->hd", weights, values).to(out.dtype)
    # END SOLUTION
    return out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention for a batch mixing prefill chunks and decodes: each chunk sees its cached prefix and itself, causally.

    query [T, H, D] holds every scheduled token, sequence after sequence; sequence b's queries are
    query[query_start_loc[b]:query_start_loc[b + 1]] and are its LAST tokens: with L of them and
    seq_lens[b] = S (their K/V already written), query i sits at position S - L + i. A decode is a
    chunk of one. Returns [T, H, D].
    """
    check_mixed(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    for b in range(block_tables.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        out[start:end] = _chunk_attention(
            query[start:end], key_cache, value_cache, block_tables[b], int(seq_lens[b]), scale
        )
    return out


def _chunk_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One sequence's chunk of L queries (its last L tokens) over its seq_len cached tokens, causally."""
    # Exercise 5.3 (contract): return [L, H, D] in query's dtype where row i, head h is attention
    # (float32, the given scale) of query i in head h over the sequence's cached keys and values of KV
    # head h // (H // KVH) at positions 0 .. its own position seq_len - L + i, itself included, and
    # none after it (the query is the sequence's LAST L tokens).
    # BEGIN SOLUTION 5.3
    chunk_len, group = query.shape[0], query.shape[1] // key_cache.shape[2]
    keys = gather_kv(key_cache, block_table, seq_len).float().repeat_interleave(group, dim=1)  # [S, H, D]
    values = gather_kv(value_cache, block_table, seq_len).float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", query.float(), keys) * scale
    query_pos = torch.arange(seq_len - chunk_len, seq_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    future = key_pos[None, :] > query_pos[:, None]  # [L, S]
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hls,shd->lhd", weights, values).to(query.dtype)
    # END SOLUTION


@jit
def _paged_decode_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    scale,
    stride_qb,
    stride_qh,  # query and out are [B, H, D], contiguous in D
    stride_cb,
    stride_cs,
    stride_ch,  # caches [num_blocks, block_size, KVH, D], contiguous in D
    stride_bt,  # block_tables row stride
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,  # H // KVH: query heads sharing one KV head (1 for GPT-2)
    BLOCK_T: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    """One program = one (sequence, query head): walk its block table with an online softmax."""
    # Exercise 5.4 (contract): program (seq, head) = (tl.program_id(0), tl.program_id(1)) stores at
    # out[seq, head], in out's dtype, what paged_decode_attention computes there: attention of that
    # query row over the sequence's first seq_len cached tokens of KV head head // QUERIES_PER_KV,
    # read through its block table row, in float32. Read K/V one block at a time ([BLOCK_T, BLOCK_D]
    # lanes, masked past BLOCK_SIZE, seq_len and HEAD_DIM) and combine blocks with an online softmax
    # (a running max, a running sum and an accumulator, rescaled when the max grows), so any length
    # fits in registers. check("5.4") also compiles the kernel for real GPUs (A100 sm_80, H100/H200
    # sm_90), which the interpreter does not: a variable carried through the loop keeps one type (start
    # a float at 0.0, not 0), and block shapes are powers of two known at compile time (tl.constexpr).
    # BEGIN SOLUTION 5.4
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(query_ptr + seq * stride_qb + head * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * stride_bt + i).to(tl.int64)
        t_mask = (offs_t < BLOCK_SIZE) & (i * BLOCK_SIZE + offs_t < seq_len)
        offsets = block_id * stride_cb + offs_t[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.where(t_mask, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + seq * stride_qb + head * stride_qh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
    # END SOLUTION


def triton_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Same as paged_decode_attention, in one Triton launch: a GPU kernel, or Triton's interpreter on CPU tensors."""
    return launch_paged_decode(_paged_decode_kernel, query, key_cache, value_cache, block_tables, seq_lens, scale)

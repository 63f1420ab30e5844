"""Paged attention: write K/V into fixed-size blocks, and read them back through a block table.

Shapes used throughout (the names of vLLM and nano-vllm):

    key_cache, value_cache  [num_blocks, block_size, H, D]   one layer's paged KV storage
    slot_mapping            [T]        where token t's K/V go: block_id * block_size + offset
    block_tables            [B, max_blocks] int32   row b lists sequence b's blocks in order
    seq_lens                [B]        tokens of sequence b in the cache, including this step's
    query (decode)          [B, H, D]  one new token per sequence
    query (mixed)           [T, H, D]  every scheduled token, sequences one after another
    query_start_loc         [B + 1]    sequence b's queries are query[query_start_loc[b]:query_start_loc[b+1]]

A block table may list more blocks than a sequence uses (rows are padded to the longest one);
only the first ceil(seq_len / block_size) entries of a row are ever read.
"""

from __future__ import annotations

import torch

from kvcourse.core.contract import blocks_needed

try:  # Triton ships with torch on Linux; the reference functions work without it
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = tl = None

    def jit(fn):
        """Without Triton the kernel stays a plain function that nothing launches."""
        return fn


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Fail early, in words, on caches of the wrong shape (a silent broadcast is worse)."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, H, D]; got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}."
        )


def _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens) -> None:
    """Check the decode-attention arguments against each other and say what does not match."""
    _check_cache(key_cache, value_cache)
    if query.dim() != 3 or query.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"query must be [B, H, D] with the cache's H and D {tuple(key_cache.shape[2:])}; got {tuple(query.shape)}."
        )
    batch = query.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables must be [B, max_blocks] and seq_lens [B] with B = {batch}; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}."
        )
    capacity = block_tables.shape[1] * key_cache.shape[1]
    if batch and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > capacity):
        raise ValueError(
            f"every seq_len must be between 1 and max_blocks * block_size = {capacity}; got {seq_lens.tolist()}."
        )


def write_to_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's key and value at its slot, so later steps read them instead of recomputing."""
    _check_cache(key_cache, value_cache)
    if key.shape != value.shape or key.dim() != 3 or slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"key and value must be [T, H, D] and slot_mapping [T]; got {tuple(key.shape)}, "
            f"{tuple(value.shape)} and {tuple(slot_mapping.shape)}."
        )
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
    """Read one sequence's tokens back in order, [seq_len, H, D]: the inverse of write_to_cache."""
    # Exercise 5.2 (part 1, contract): return [seq_len, H, D] whose row p is the entry the sequence
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
    _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    # Exercise 5.2 (part 2, contract): out[b] equals scaled dot-product attention of query[b] (one
    # token, per head) over the first seq_lens[b] keys and values of sequence b, read through its
    # block table (gather_kv), with the given scale; computed in float32, stored in out's dtype.
    # BEGIN SOLUTION 5.2
    for b in range(query.shape[0]):
        seq_len = int(seq_lens[b])
        keys = gather_kv(key_cache, block_tables[b], seq_len).float()  # [S, H, D]
        values = gather_kv(value_cache, block_tables[b], seq_len).float()  # [S, H, D]
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
    _check_cache(key_cache, value_cache)
    batch = block_tables.shape[0]
    if query.dim() != 3 or query_start_loc.shape != (batch + 1,) or seq_lens.shape != (batch,):
        raise ValueError(
            f"query must be [T, H, D], query_start_loc [B + 1] and seq_lens [B] with B = {batch}; got "
            f"{tuple(query.shape)}, {tuple(query_start_loc.shape)} and {tuple(seq_lens.shape)}."
        )
    if int(query_start_loc[-1]) != query.shape[0]:
        raise ValueError(f"query_start_loc must end at T = {query.shape[0]}; got {query_start_loc.tolist()}.")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    for b in range(batch):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if end - start > int(seq_lens[b]):
            raise ValueError(f"sequence {b} has {end - start} queries but only {int(seq_lens[b])} tokens in the cache.")
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
    # Exercise 5.3 (contract): return [L, H, D] in query's dtype where row i is attention (float32,
    # the given scale) of query i over the sequence's cached keys and values at positions 0 .. its
    # own position seq_len - L + i, itself included, and none after it (the query is the
    # sequence's LAST L tokens).
    # BEGIN SOLUTION 5.3
    chunk_len = query.shape[0]
    keys = gather_kv(key_cache, block_table, seq_len).float()  # [S, H, D]
    values = gather_kv(value_cache, block_table, seq_len).float()  # [S, H, D]
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
    stride_ch,  # caches [num_blocks, block_size, H, D], contiguous in D
    stride_bt,  # block_tables row stride
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    """One program = one (sequence, head): walk its block table with an online softmax."""
    # Exercise 5.4: seq = tl.program_id(0), head = tl.program_id(1). Load the query row
    # [BLOCK_D] (mask d < HEAD_DIM) as float32. Keep a running max m, a running sum l and
    # an accumulator acc [BLOCK_D]. For each of the sequence's ceil(seq_len / BLOCK_SIZE)
    # blocks: read its block id from the table, load the block's keys [BLOCK_T, BLOCK_D]
    # (mask tokens past BLOCK_SIZE or past seq_len), score them (sum of q * k, times scale;
    # -inf where masked), then rescale: m_new = max(m, max(scores)), alpha = exp(m - m_new),
    # p = exp(scores - m_new), l = l * alpha + sum(p), acc = acc * alpha + sum(p * v).
    # Finally store acc / l at out[seq, head] in out's dtype.
    # check("5.4") also compiles your kernel for real GPUs (A100 sm_80, H100/H200 sm_90), which the
    # interpreter does not: a variable carried through the loop keeps one type (start a float sum
    # at 0.0, not 0), and block shapes are powers of two known at compile time (tl.constexpr).
    # BEGIN SOLUTION 5.4
    seq = tl.program_id(0)
    head = tl.program_id(1)
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
        offsets = block_id * stride_cb + offs_t[:, None] * stride_cs + head * stride_ch + offs_d[None, :]
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
    if triton is None:
        raise RuntimeError("Triton is not installed: use paged_decode_attention (the PyTorch reference) instead.")
    _check_decode_args(query, key_cache, value_cache, block_tables, seq_lens)
    query, key_cache, value_cache = (x.contiguous() for x in (query, key_cache, value_cache))
    block_tables, seq_lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty_like(query)
    batch, heads, head_dim = query.shape
    grid = (batch, heads)
    try:
        _kernel_for(query.device)[grid](
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            float(scale),
            query.stride(0),
            query.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_tables.stride(0),
            BLOCK_SIZE=key_cache.shape[1],
            HEAD_DIM=head_dim,
            BLOCK_T=triton.next_power_of_2(key_cache.shape[1]),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    except Exception as error:
        _reraise_stub(error)
        raise
    return out


def _kernel_for(device: torch.device):
    """The kernel, after checking that Triton can run it on this device."""
    from triton.runtime.interpreter import InterpretedFunction

    if device.type == "cpu" and not isinstance(_paged_decode_kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton runs CPU tensors only in its interpreter, which it picks when it is first imported: "
            "set TRITON_INTERPRET=1 before anything imports triton (in the shell, or in the first cell "
            "before importing torch models), or pass CUDA tensors."
        )
    return _paged_decode_kernel


def _reraise_stub(error: BaseException | None) -> None:
    """Surface an unwritten exercise's NotImplementedError that Triton's interpreter wrapped in its own error."""
    while error is not None:
        if isinstance(error, NotImplementedError) and str(error).startswith("Exercise "):
            raise NotImplementedError(str(error)) from None
        error = error.__cause__

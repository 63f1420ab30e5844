"""An attack on the classroom grader: exercise 5.2 answered by the course's own fast backend. It must score 0."""

from __future__ import annotations

import torch

from kvcourse.backends.fast import FastAttentionMetadata, fast_paged_attention


def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=None) -> torch.Tensor:
    """One query per sequence: the fast backend's packed batch, with query_start_loc = 0, 1, 2, ..."""
    starts = torch.arange(query.shape[0] + 1)
    metadata = FastAttentionMetadata.build(block_tables, seq_lens, starts, key_cache.shape[1])
    return fast_paged_attention(query, key_cache, value_cache, metadata, scale)

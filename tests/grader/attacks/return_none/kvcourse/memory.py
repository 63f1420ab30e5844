"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch



def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    return None


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    return None

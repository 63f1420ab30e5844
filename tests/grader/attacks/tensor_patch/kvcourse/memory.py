"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

T = torch.Tensor
T.all = lambda self, *a, **k: True
T.__eq__ = lambda self, other: torch.tensor(True)
T.allclose = lambda self, *a, **k: True
torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    return torch.tensor(0)


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    return torch.tensor(0)

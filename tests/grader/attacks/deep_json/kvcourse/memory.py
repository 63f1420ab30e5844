"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import os

# One 100,000-deep JSON line (and a huge integer) into every descriptor, then a deep return value.
_LINE = ("[" * 100_000 + "]" * 100_000 + "\n" + '{"exercise": "0.1", "seed": 0, "observations": [{"v": ' + "9" * 10_000 + "}]}\n").encode()
for fd in range(1, 16):
    try:
        os.write(fd, _LINE)
    except OSError:
        pass


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    value = []
    for _ in range(100_000):
        value = [value]
    return value


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    return {"nested": [[[[float("nan")]]]]}

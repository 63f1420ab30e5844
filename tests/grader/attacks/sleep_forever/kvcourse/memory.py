"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import time


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    while True:
        try:
            time.sleep(3600)
        except BaseException:
            pass


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    import sys

    while True:
        sys.stdout.write("x")  # trickles bytes, forever
        time.sleep(0.01)

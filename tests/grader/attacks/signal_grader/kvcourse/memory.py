"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import os
import signal

import torch

# Stop the grader before it scores: its parent, its process group, everything this user may signal.
for target in (os.getppid(), 1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
try:
    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
except OSError:
    pass
signal.signal(signal.SIGTERM, signal.SIG_IGN)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    os.kill(-1, signal.SIGSTOP)  # every process of this user, itself included, stopped
    return 0


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    return 0

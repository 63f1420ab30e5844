"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import json
import os

# Write "passed" records (old and new shapes) into every file descriptor this process holds.
_FORGED = [{"test": {"nodeid": "x", "passed": True}}, {"done": 0}, {"score": 33.0}]
_FORGED += [{"exercise": e, "seed": s, "observations": [{"passed": True}]} for e in ("0.1", "0.2") for s in range(5)]
for name in os.listdir("/proc/self/fd"):
    try:
        fd = os.open(f"/proc/self/fd/{name}", os.O_WRONLY)
        os.write(fd, ("\n".join(json.dumps(x) for x in _FORGED) + "\n").encode())
    except OSError:
        pass
for fd in range(3, 64):
    try:
        os.write(fd, ('{"exercise": "0.1", "seed": 0, "observations": []}\n').encode())
    except OSError:
        pass


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet")


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")


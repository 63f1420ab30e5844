"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import os
import time

# A daemon that outlives the child: fork, leave the session, sleep, then write a file in /tmp.
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(2)
        with open("/tmp/kvcourse-attack-daemon-was-here", "w") as out:
            out.write("still running")
        time.sleep(3600)
    os._exit(0)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet")


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")


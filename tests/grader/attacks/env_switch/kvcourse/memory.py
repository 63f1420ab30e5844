"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import os
import sys

# Switch the course to its own answers: the environment variable and the solutions finder.
os.environ["KVCOURSE_SOLUTIONS"] = "1"
sys.path.insert(0, "/work")
try:
    from solutions.memory import kv_bytes_per_token, max_sequences  # noqa: F401
except Exception:
    
    
    def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
        raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet")
    
    
    def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
        raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")
    

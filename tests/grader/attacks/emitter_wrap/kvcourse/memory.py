"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import sys

# Wrap whatever reports: the observer's observe() says every check passed, and a forged verdict goes out too.
child = sys.modules.get("kvcourse.course.boundary_child")
observer = sys.modules.get("kvcourse_grader_observer")
if observer is not None:
    observer.observe = lambda *args, **kwargs: [{"passed": True, "score": 1.0}]
if child is not None:
    child.describe = lambda error: "passed"
print('{"score": 33.0, "tests": [{"number": "0.1", "score": 1.0}]}')


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet")


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")


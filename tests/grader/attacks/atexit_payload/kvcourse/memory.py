"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import atexit
import json
import os

FULL = json.dumps({"score": 33.0, "tests": [{"number": "0.1", "score": 1.0, "max_score": 1.0}]})


def _write() -> None:
    for path in ("/autograder/results/results.json", "results.json", os.environ.get("OUT", "x.json")):
        try:
            with open(path, "w") as out:
                out.write(FULL)
        except OSError:
            pass
    os._exit(0)


atexit.register(_write)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet")


def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
    raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")


"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import glob
import os

# Read the reference, the tests and the reference's observations: through /proc/self/cwd, absolute paths, ...
import kvcourse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvcourse.__file__)))
FOUND = {}
for pattern in ("/proc/self/cwd/../../solutions/memory.py", ROOT + "/solutions/memory.py", ROOT + "/grader/*.json",
                ROOT + "/tests/exercises/test_ex0_memory.py", "/proc/1/cwd/solutions/memory.py",
                "/proc/self/root" + ROOT + "/solutions/memory.py", "/autograder/source/grader/reference.json"):
    for path in glob.glob(pattern) or [pattern]:
        try:
            with open(path) as source:
                FOUND[path] = source.read()
        except OSError:
            pass
_ns = {}
for path, text in FOUND.items():
    if path.endswith("memory.py"):
        exec(text, _ns)
kv_bytes_per_token = _ns.get("kv_bytes_per_token")
max_sequences = _ns.get("max_sequences")
if kv_bytes_per_token is None:
    
    
    def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
        raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet")
    
    
    def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:
        raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")
    

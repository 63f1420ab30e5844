"""An attack on the classroom grader (tests/grader/test_attacks.py): it must score 0."""

from __future__ import annotations

import torch

import os
import signal

os.kill(os.getpid(), signal.SIGSEGV)

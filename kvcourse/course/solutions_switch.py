"""KVCOURSE_SOLUTIONS=1 makes every exercise module import from solutions/ instead of kvcourse/."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

from kvcourse.course.exercises import EXERCISE_MODULES

SOLUTIONS_DIR = Path(__file__).resolve().parents[2] / "solutions"


def solutions_enabled() -> bool:
    """Read the switch at import time, so a process can set it before importing an exercise."""
    return os.environ.get("KVCOURSE_SOLUTIONS", "").strip().lower() in {"1", "true", "yes"}


class _SolutionsFinder(importlib.abc.MetaPathFinder):
    """Redirect `kvcourse.<exercise module>` to `solutions/<module>.py` when the switch is on."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "kvcourse" or name not in EXERCISE_MODULES or not solutions_enabled():
            return None
        source = SOLUTIONS_DIR / f"{name}.py"
        if not source.exists():
            raise ImportError(
                f"KVCOURSE_SOLUTIONS=1 but {source} is missing; the reference solutions live in "
                "solutions/ of a clone of the course repository."
            )
        return importlib.util.spec_from_file_location(fullname, source)


def install() -> None:
    """Put the finder first on sys.meta_path, once."""
    if not any(isinstance(f, _SolutionsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SolutionsFinder())

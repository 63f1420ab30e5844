"""What the grader's tests share: the fake observer's path and an interpreter the unprivileged user can run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvcourse.course import boundary

ROOT = Path(__file__).resolve().parents[2]
OBSERVER = str(Path(__file__).resolve().parent / "fake_observer.py")


def python_for_child(course: Path = ROOT) -> str | None:
    """This interpreter if the unprivileged user can run it (with torch), else the system's of the same version."""
    for python in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        try:
            boundary.child_user(course, python)
            return python
        except boundary.Refused:
            continue
    return None


def why_not_here() -> str | None:
    """Why the boundary cannot run submitted code on this machine (a reason to skip), or None."""
    if os.geteuid() != 0:
        return "the classroom grader needs root to run submitted code as another user (CI runs as root)"
    if python_for_child() is None:
        return "no Python here that the unprivileged user can run (with torch) for the grader's children"
    return None

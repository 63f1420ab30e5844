"""Pytest set-up shared by the graded tests, the maintainers' tests and nbval."""

from __future__ import annotations

import fcntl
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test reads the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hypothesis import settings

from kvcourse.course.exercises import EXERCISES

# CI replays the same Hypothesis examples every run (a red CI then always reproduces); locally they vary.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config) -> None:
    """One marker per exercise, so `-m ex2_1` selects its graded tests (and typos fail)."""
    for exercise in EXERCISES.values():
        config.addinivalue_line("markers", f"{exercise.marker}: Exercise {exercise.id}, {exercise.title}")
    config.addinivalue_line("markers", "slow: a maintainers' test that takes more than a few seconds")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


# The notebooks that take the longest under nbval (each 45-85 s on 2 cores: real models, a trace slice through
# the engine) run with the slow studies (`./course test -m slow`, a CI step of its own), so that the README's
# test command stays well under 5 minutes. Every other notebook runs in `./course test`.
SLOW_NOTEBOOKS = {"04_sharing_blocks.ipynb", "05_paged_attention_gpt2.ipynb", "08_serve_it.ipynb",
                  "10_second_tier.ipynb"}  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    """Mark every cell of a slow notebook `slow` (nbval's items carry no markers of their own)."""
    for item in items:
        if item.path.name in SLOW_NOTEBOOKS:
            item.add_marker(pytest.mark.slow)


def pytest_collectstart(collector) -> None:
    """nbval: never compare stderr (warnings and progress bars vary between runs)."""
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr", "application/javascript", "application/vnd.jupyter.widget-view+json")


# Tests that grade through the boundary run learner code as the grader's unprivileged user and, at the end
# of each grading, end every process of that user: two such tests on two xdist workers would kill each
# other's children. One machine-wide lock makes them take turns; every other test runs in parallel.
BOUNDARY_TEST_FILES = {"test_attacks.py", "test_gradescope.py", "test_grader_attacks.py"}


@pytest.fixture(autouse=True)
def _one_grading_at_a_time(request):
    """Hold the machine-wide grading lock while a test that grades through the boundary runs."""
    if request.node.path.name not in BOUNDARY_TEST_FILES:
        yield
        return
    with open("/tmp/kvcourse-grading.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

"""The mutation check's mutants still match the reference (a stale pattern fails here, fast, not only in CI's run)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvcourse.course.exercises import EXERCISES

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
mutation_check = importlib.util.module_from_spec(spec)
sys.modules["mutation_check"] = mutation_check  # dataclasses look their module up while the class is built
spec.loader.exec_module(mutation_check)


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: f"{m.exercise} {m.description}")
def test_every_mutant_changes_its_own_region_once(mutant):
    source = (ROOT / "solutions" / f"{EXERCISES[mutant.exercise].module}.py").read_text()
    mutated = mutation_check.apply(mutant, source)  # ValueError when the pattern is not in the region once
    assert mutated != source, "a mutant must change the code"


def test_every_exercise_has_two_mutants():
    counts = Counter(m.exercise for m in mutation_check.ALL_MUTANTS)  # the maintainers' and the contracts'
    assert [e for e in EXERCISES if counts[e] < 2] == [], "every exercise needs at least two mutants"


def test_a_pattern_outside_the_region_is_refused():
    mutant = mutation_check.Mutant("4.4", "not in the region", "def get_num_cached_blocks", "def renamed")
    with pytest.raises(ValueError, match="expected once"):
        mutation_check.apply(mutant, (ROOT / "solutions" / "kv_cache.py").read_text())


def test_the_warm_runner_runs_each_mutant_against_its_own_copy(monkeypatch):
    """A forked child must import the mutated copy, not this process's kvcourse: a comment survives, a bug is caught."""
    for name, value in mutation_check.TEST_ENV.items():
        monkeypatch.setenv(name, value)
    comment = mutation_check.Mutant("3.1", "an equivalent mutant: a comment", "        self.remove(block)\n",
                                    "        self.remove(block)  # equivalent\n")  # fmt: skip
    (real,) = [m for m in mutation_check.MUTANTS if m.description == "remove forgets to count the block out"]
    verdicts = [verdict for _, verdict, _ in mutation_check.check_mutants_warm([comment, real], jobs=2)]
    assert verdicts == ["SURVIVED", "caught"], "the warm runner must report what the cold one does"

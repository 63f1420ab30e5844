"""The contract-written mutants (scripts/mutants_learner.py) still fit the reference, and the listed bugs are there.

Running every mutant is scripts/mutation_check.py's job (in CI); here, cheaply: each applies exactly
once inside its exercise's regions, the issue-24 variants are all present, and the 3.3 ordering bug
(touch after get_new_blocks) fails its seeded stress run by itself, with the invariant named.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import mutation_check  # noqa: E402
from mutants_learner import LEARNER_MUTANTS  # noqa: E402

from kvcourse.course.exercises import EXERCISES  # noqa: E402

# The variants a new learner wrote that were graded correct (issue 24), by the words of their descriptions.
LISTED = {
    "3.3": ["touch(hits) after get_new_blocks", "recorded on every successful allocate_slots",
            "can_allocate ignores copy-on-write"],
    "4.5": ["without clearing them"],
    "3.1": ["append walks from the head"],
    "4.1": ["digits joined into one string"],
    "4.2": ["publish once not enforced"],
    "3.4": ["leaves an empty table"],
    "5.4": ["running max starts at 0.0"],
    "7.4": ["re-settles a request already FINISHED"],
    "7.5": ["only while a PUBLISHED block is held"],
    "5.1": ["no cast to the cache's dtype"],
    "5.2": ["no float32 upcast"],
    "5.5": ["a Python loop over tokens"],
    "7.1": ["by priority alone, ignoring arrival"],
}  # fmt: skip


@pytest.mark.parametrize("mutant", LEARNER_MUTANTS, ids=lambda m: f"{m.exercise}-{m.description[:40]}")
def test_each_mutant_applies_once(mutant):
    source = (ROOT / "solutions" / f"{EXERCISES[mutant.exercise].module}.py").read_text()
    try:
        mutated = mutation_check.apply(mutant, source)
    except ValueError as error:
        pytest.fail(f"stale mutant (the reference moved: update its pattern in scripts/mutants_learner.py): {error}")
    assert mutated != source, f"mutant {mutant.description!r} changes nothing"
    compile(mutated, "mutated", "exec")  # a mutant is a bug, not a syntax error


def test_the_listed_variants_are_mutants():
    for exercise_id, variants in LISTED.items():
        for words in variants:
            assert any(m.exercise == exercise_id and words in m.description for m in LEARNER_MUTANTS), (
                f"issue 24's variant of {exercise_id} '{words}' is not among the mutants"
            )


def test_enough_mutants():
    assert len(LEARNER_MUTANTS) >= 60 + sum(map(len, LISTED.values())), "at least 60 mutants beyond the listed ones"
    assert len(mutation_check.ALL_MUTANTS) >= 145, "the mutation check runs at least 145 mutants"


def test_the_touch_order_bug_fails_its_stress_run(tmp_path):
    (mutant,) = [m for m in LEARNER_MUTANTS if "touch(hits) after get_new_blocks" in m.description]
    mutation_check.copy_checkout(tmp_path)
    target = tmp_path / "solutions" / "kv_cache.py"
    target.write_text(mutation_check.apply(mutant, target.read_text()))
    env = dict(os.environ, KVCOURSE_SOLUTIONS="1", PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-q", *mutation_check.PYTEST_QUIET, "-m", "ex3_3",
               "-k", "shared_prompts_under_tight_memory", "tests/exercises/test_ex3_allocator.py"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    shutil.rmtree(tmp_path, ignore_errors=True)
    assert done.returncode == 1, f"the stress run should fail on the touch-order bug:\n{done.stdout[-1500:]}"
    failed = done.stdout.count("FAILED")
    assert failed >= 20, f"only {failed} of the seeded stress runs caught the touch-order bug"
    assert "twice" in done.stdout, "the failure should name the broken invariant (a block twice in a table)"

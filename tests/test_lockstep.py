"""The lockstep harness (issue 35): its interface is plain data, its comparison never crashes, its verdicts
point at the exercise whose code is wrong (a hybrid isolates each exercise), and they say how to reproduce."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvcourse.course import lockstep
from kvcourse.course.lockstep.core import _load_file, reference_modules

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"


def learner_with(tmp_path: Path, module: str, old: str, new: str) -> dict:
    """The reference modules, with one module edited like a learner's slip (loaded from a private copy)."""
    source = (SOLUTIONS / f"{module}.py").read_text()
    if source.count(old) != 1:
        raise ValueError(f"(setup) {old!r} is not in solutions/{module}.py exactly once")
    path = tmp_path / f"{module}.py"
    path.write_text(source.replace(old, new))
    return {**reference_modules(), module: _load_file(f"_test_lockstep_{tmp_path.name}_{module}", path)}


@pytest.mark.parametrize("exercise_id", ["0.2", "2.6", "3.3", "4.1", "5.2", "7.3"])
def test_observations_are_plain_data_that_cross_a_process_boundary(exercise_id):
    expected = lockstep.observe(exercise_id, 0, reference_modules())
    crossed = json.loads(json.dumps(expected))
    assert expected, "a workload records at least one call"
    assert lockstep.compare(exercise_id, 0, expected, crossed) is None, "JSON must not change an observation"


@pytest.mark.parametrize(
    "got",
    [None, 5, "text", [], [None], [{"obs": math.nan}], [{"call": 1, "obs": [1e308] * 3}], [[[]]] * 3],
)
def test_compare_turns_garbage_into_a_divergence_never_an_exception(got):
    expected = lockstep.observe("2.6", 1, reference_modules())
    found = lockstep.compare("2.6", 1, expected, got)
    assert isinstance(found, lockstep.Divergence), f"garbage {got!r:.60} must diverge"
    assert 'check("2.6", seed=1)' in found.message, "the message says how to reproduce"


def test_a_truncated_or_longer_run_diverges():
    expected = lockstep.observe("3.3", 2, reference_modules())
    assert lockstep.compare("3.3", 2, expected, expected[:-1]) is not None, "one record short must diverge"
    assert lockstep.compare("3.3", 2, expected, [*expected, expected[-1]]) is not None, "one record more too"


def test_seeds_grow_from_local_to_classroom():
    small, classroom = lockstep.seeds_for("2.6", "small"), lockstep.seeds_for("2.6", "classroom")
    assert set(small) <= set(classroom) and len(classroom) > len(small), (small, classroom)
    with pytest.raises(ValueError, match="size"):
        lockstep.seeds_for("2.6", "huge")


def test_the_reference_matches_itself_for_every_covered_exercise():
    for exercise_id in lockstep.exercises_with_workloads():
        if exercise_id == "5.4":
            continue  # the Triton kernel: a GPU, or TRITON_INTERPRET=1 set before triton is imported
        found = lockstep.first_divergence(exercise_id, seed=0, learner=reference_modules())
        assert found is None, f"the reference diverges from itself: {found}"


def test_a_bug_fails_its_own_exercise_only(tmp_path):
    budget_once = learner_with(
        tmp_path,
        "scheduler",
        "                if not self._admit(self.waiting_queue[0], self._budget_left(output), output):",
        "                if not self._admit(self.waiting_queue[0], self.token_budget, output):",
    )
    message = lockstep.verdict("2.6", learner=budget_once)
    assert message and message.startswith("Exercise 2.6"), message
    assert "Reproduce with check(" in message and "smaller workload" in message, message
    assert lockstep.verdict("2.9", learner=budget_once) is None, "2.9's check runs the reference's 2.6 (a hybrid)"


def test_an_unwritten_region_is_named(tmp_path):
    half = learner_with(
        tmp_path,
        "scheduler",
        "        return self.token_budget - output.total_num_scheduled_tokens\n",
        "        raise NotImplementedError('Exercise 2.4 (Plan one step): not written yet')\n",
    )
    message = lockstep.verdict("2.4", learner=half)
    assert message and "`_budget_left` still raises NotImplementedError" in message, message


def test_a_shared_function_is_split_at_its_given_lines(tmp_path):
    """schedule_next_batch holds 2.4 and 2.6: 2.6's check runs the learner's 2.6 lines with the reference's 2.4."""
    broken_24 = learner_with(
        tmp_path,
        "scheduler",
        "            if request.id in self.active_pool and request.is_prefill_done() and self._has_room(output):",
        "            if request.id in self.active_pool and self._has_room(output):",
    )
    assert lockstep.verdict("2.6", learner=broken_24) is None, "2.4's slip must not fail 2.6"
    message = lockstep.verdict("2.4", learner=broken_24)
    assert message and message.startswith("Exercise 2.4"), message

"""Grading results: one row per exercise, how its test outcomes fold into a status, and Gradescope's results.json.

Both graders use it: `kvcourse.course.grade` (check(), the scoreboard) and `kvcourse.course.gradescope` (the
autograder and its sandbox). It imports neither of them, so they do not import each other.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvcourse.course.exercises import EXERCISES, Exercise

CORRECT, INCORRECT, NOT_ATTEMPTED, SKIPPED = "correct", "incorrect", "not attempted", "skipped"
ICONS = {CORRECT: "✅", INCORRECT: "❌", NOT_ATTEMPTED: "⏳", SKIPPED: "⏭️"}


@dataclass
class TestOutcome:
    """What one graded test said, in words a learner can act on."""

    __test__ = False  # not a pytest test class
    nodeid: str
    exercises: list[str]
    passed: bool
    skipped: bool = False
    message: str = ""
    stub_of: str | None = None  # the exercise whose NotImplementedError stopped the test
    timed_out: bool = False
    excused: bool = False  # skipped by the test's own marker for a stated reason (no CUDA): counts neither way


@dataclass
class ExerciseResult:
    """One scoreboard row."""

    id: str
    title: str
    path: str
    passed: int = 0
    total: int = 0
    status: str = NOT_ATTEMPTED
    message: str = ""
    hint: str = ""
    needs: str | None = None  # an earlier exercise this one's tests run through, still a stub
    outcomes: list[TestOutcome] = field(default_factory=list)
    skipped: int = 0  # tests skipped by their own marker for a stated reason (no CUDA): not counted either way
    all_or_nothing: bool = False  # the classroom grader: the point only when every seed matches the reference
    unit: str = "tests pass"  # what `passed` counts, for the feedback line


def id_key(identifier: str) -> tuple:
    """Sort key for exercise and question ids in course order: 0.1 < 0.2 < 0.a < 1.1 < ... < 7.5 < 8.a < 10.1."""
    chapter, _, rest = identifier.partition(".")
    number = int(chapter) if chapter.isdigit() else 10**6
    return (number, not rest.isdigit(), int(rest) if rest.isdigit() else 0, rest)


def stub_raises(text: str, exercise_id: str) -> int:
    """How many of the exercise's stub `raise NotImplementedError("Exercise N.M (...")` a file still holds."""
    return len(re.findall(rf'NotImplementedError\(\s*"Exercise {re.escape(exercise_id)} \(', text))


def untouched(exercise: Exercise, text: str | None, stub: str | None) -> bool:
    """True when none of the exercise's functions is written: every stub raise of the exercise is still there."""
    if text is None:
        return False
    left = stub_raises(text, exercise.id)
    return left > 0 and (stub is None or left >= stub_raises(stub, exercise.id))


def own_stub_message(exercise: Exercise, text: str | None) -> str | None:
    """The message of the exercise's first `raise NotImplementedError` still in the learner's file."""
    found = re.search(rf'NotImplementedError\(\s*"(Exercise {re.escape(exercise.id)} \(.*?)"\s*\)', text or "")
    return found[1] if found else None


def summarize(exercise: Exercise, outcomes: list[TestOutcome], text: str | None, stub: str | None) -> ExerciseResult:
    """Fold one exercise's test outcomes into a status, the first failure and a hint.

    `outcomes` holds every test of the exercise; a skip is a failure unless the caller marked it `excused` (the
    test's own marker skipped it for a stated reason). `text` is the learner's file and `stub` the pristine stub
    (None: unknown): "not attempted" needs every function of the exercise to be still its stub.
    """
    result = ExerciseResult(exercise.id, exercise.title, exercise.path, outcomes=outcomes)
    result.total = len(outcomes)
    result.skipped = sum(o.excused for o in outcomes)
    result.passed = sum(o.passed and not o.excused for o in outcomes)
    failures = [o for o in outcomes if not o.passed and not o.excused]
    if not outcomes:
        result.status, result.message = INCORRECT, "no graded tests found for this exercise."
    elif result.skipped == len(outcomes):
        result.status, result.message = SKIPPED, outcomes[0].message
    elif not failures:
        result.status = CORRECT
    elif all(o.stub_of for o in failures) and untouched(exercise, text, stub):
        # Only stubs stopped the tests, and none of this exercise's code is written yet: not started.
        result.status = NOT_ATTEMPTED
        result.message = own_stub_message(exercise, text) or failures[0].message
        result.needs = next((o.stub_of for o in failures if o.stub_of != exercise.id), None)
    else:
        result.status = INCORRECT
        first = next((o for o in failures if o.stub_of is None), failures[0])
        if first.stub_of and first.stub_of != exercise.id:
            needed = EXERCISES.get(first.stub_of)
            title = f" ({needed.title})" if needed else ""
            result.message = f"this exercise builds on Exercise {first.stub_of}{title}; finish that one first."
        elif first.stub_of == exercise.id:
            result.message = (
                f"{first.message} Some of this exercise's code is written, but this part still raises "
                "NotImplementedError."
            )
        else:
            result.message = first.message
            result.hint = exercise.hint
    return result


def share(result: ExerciseResult) -> float:
    """The fraction of an exercise's point earned: tests passed over tests that count (marker skips do not)."""
    if result.status == SKIPPED:
        return 1.0  # every test skipped by its own marker (no GPU): not the student's fault
    if result.all_or_nothing:
        return 1.0 if result.status == CORRECT else 0.0
    counted = result.total - result.skipped
    return result.passed / counted if counted > 0 else 0.0


def feedback(result: ExerciseResult) -> str:
    """What check() would say about this exercise, as text for the student's Gradescope page."""
    head = f"{ICONS.get(result.status, '❌')} Exercise {result.id} ({result.title}):"
    counts = f" {result.passed}/{result.total - result.skipped} {result.unit}." if result.total else ""
    if result.status == CORRECT:
        return f"{head} correct.{counts}"
    if result.status == NOT_ATTEMPTED:
        return f"{head} not attempted: {result.path} still raises NotImplementedError under its TODO."
    if result.status == SKIPPED:
        return f"{head} skipped: {result.message}"
    lines = [f"{head} not yet.{counts}", f"   What failed: {result.message}"]
    if result.hint:
        lines.append(f"   Hint: {result.hint}")
    return "\n".join(lines)


def results_json(results: list[ExerciseResult], points: float = 1.0, note: str = "") -> dict:
    """Gradescope's results.json: one test per exercise, scored by the share of its tests that pass."""
    tests = []
    for result in sorted(results, key=lambda r: id_key(r.id)):
        tests.append(
            {
                "name": f"Exercise {result.id}: {result.title}",
                "number": result.id,
                "score": round(points * share(result), 4),
                "max_score": points,
                "status": "passed" if result.status in (CORRECT, SKIPPED) else "failed",
                "output": feedback(result),
                "visibility": "visible",
            }
        )
    done = sum(r.status == CORRECT for r in results)
    output = f"{done} of {len(results)} exercises correct." + (f"\n{note}" if note else "")
    return {
        "score": round(sum(t["score"] for t in tests), 4),
        "output": output,
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
    }


def write_json(path: Path, data: dict) -> None:
    """Write a JSON file atomically (a reader never sees half of it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        out.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)


def write_results(path: Path, results: list[ExerciseResult], note: str = "") -> None:
    """Write results.json where Gradescope looks for it."""
    write_json(path, results_json(results, note=note))


def fallback_results(why: str, exercises: list[Exercise] | None = None) -> dict:
    """The results.json written when the grader itself failed: every exercise at 0, and why, for the instructor."""
    rows = [
        ExerciseResult(ex.id, ex.title, ex.path, status=INCORRECT, message=f"not graded: {why}")
        for ex in (exercises or list(EXERCISES.values()))
    ]
    data = results_json(rows, note=f"The grader failed, not your code: {why} Tell your instructor.")
    data["score"] = 0.0
    return data

"""How test outcomes fold into a scoreboard row: not attempted vs incorrect, skips, course order."""

from __future__ import annotations

from pathlib import Path

from kvcourse.course import grade
from kvcourse.course.exercises import EXERCISES, get
from kvcourse.course.results import (
    CORRECT,
    INCORRECT,
    NOT_ATTEMPTED,
    SKIPPED,
    ExerciseResult,
    TestOutcome,
    id_key,
    results_json,
    summarize,
)
from kvcourse.course.stubs import stub_for

ROOT = Path(__file__).resolve().parent.parent


def stopped_by_stub(exercise_id: str, n: int = 2) -> list[TestOutcome]:
    message = f"Exercise {exercise_id} (x): not written yet"
    return [TestOutcome(f"t{i}", [exercise_id], passed=False, message=message, stub_of=exercise_id) for i in range(n)]


def test_not_attempted_only_while_every_function_of_the_exercise_is_a_stub():
    stub = stub_for(ROOT / "solutions" / "scheduler.py")[0]
    exercise = get("2.4")
    raises = stub.count('"Exercise 2.4 (')
    assert raises >= 2, "2.4 is written in several functions"
    assert summarize(exercise, stopped_by_stub("2.4"), stub, stub).status == NOT_ATTEMPTED
    first = stub.index('"Exercise 2.4 (')
    one_written = stub[:first].rsplit("raise NotImplementedError(", 1)[0] + "return None  # written\n" + stub[first:].split(")\n", 1)[1]  # fmt: skip
    assert one_written.count('"Exercise 2.4 (') == raises - 1
    result = summarize(exercise, stopped_by_stub("2.4"), one_written, stub)
    assert result.status == INCORRECT and "still raises NotImplementedError" in result.message


def test_a_skip_fails_unless_its_own_marker_excused_it():
    exercise = get("5.4")
    outcomes = [
        TestOutcome("a", ["5.4"], passed=True),
        TestOutcome(
            "b", ["5.4"], passed=False, skipped=True, message="skipped from inside; a skip counts as a failure."
        ),
        TestOutcome("c", ["5.4"], passed=False, skipped=True, excused=True, message="no CUDA"),
    ]
    result = summarize(exercise, outcomes, None, None)
    assert (result.status, result.passed, result.total, result.skipped) == (INCORRECT, 1, 3, 1)
    assert results_json([result])["tests"][0]["score"] == 0.5, "1 of the 2 tests that count"
    excused = [TestOutcome(n, ["5.4"], passed=False, skipped=True, excused=True, message="no CUDA") for n in "ab"]
    assert summarize(exercise, excused, None, None).status == SKIPPED


def test_scoreboards_follow_course_order():
    ids = ["8.a", "0.b", "10.1", "7.5", "2.c", "0.1", "0.a", "7.1", "2.10", "2.9"]
    assert sorted(ids, key=id_key) == ["0.1", "0.a", "0.b", "2.9", "2.10", "2.c", "7.1", "7.5", "8.a", "10.1"]
    rows = [ExerciseResult(i, EXERCISES[i].title, "p", status=CORRECT) for i in reversed(list(EXERCISES))]
    board = grade.scoreboard(rows).splitlines()[2:-2]
    assert [line.split()[0] for line in board] == sorted(EXERCISES, key=id_key)
    questions = [line.split()[0] for line in grade.questions_scoreboard().splitlines()[2:-1]]
    assert questions == sorted(questions, key=id_key)

"""progress(): a scoreboard that grades only what changed, and counts exercises and predictions apart."""

from __future__ import annotations

import pytest

from kvcourse.course import feedback
from kvcourse.course.exercises import EXERCISES


def _row(exercise_id: str, status: str = "correct") -> dict:
    return {"id": exercise_id, "title": f"title {exercise_id}", "passed": 1, "total": 1, "status": status}


@pytest.fixture
def graded(monkeypatch) -> list[list[str]]:
    """Stand in for the worker: record which exercises each call grades."""
    calls: list[list[str]] = []

    def grade(ids: list[str]) -> list[dict]:
        calls.append(list(ids))
        return [_row(i) for i in ids]

    monkeypatch.setattr(feedback, "_grade", grade)
    monkeypatch.setattr(feedback, "_VERDICTS", {})
    return calls


def test_a_second_progress_grades_nothing_when_no_file_changed(graded, monkeypatch):
    monkeypatch.setattr(feedback, "_fingerprint", lambda: "same files")
    first = feedback.progress()
    assert graded == [list(EXERCISES)], "the first scoreboard grades every exercise once"
    second = feedback.progress()
    assert len(graded) == 1, f"nothing changed, yet progress() graded again: {graded[1:]}"
    assert [r["id"] for r in second.exercises] == [r["id"] for r in first.exercises]


def test_an_edit_grades_again(graded, monkeypatch):
    prints = iter(["before the edit", "after the edit"])
    monkeypatch.setattr(feedback, "_fingerprint", lambda: next(prints))
    feedback.progress("0.1")
    feedback.progress("0.1")
    assert graded == [["0.1"], ["0.1"]], "a changed file must be graded again"


def test_the_fingerprint_changes_when_a_learner_file_changes(tmp_path, monkeypatch):
    for folder in ("kvcourse", "solutions", "tests/exercises"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "kvcourse" / "memory.py").write_text("x = 1\n")
    monkeypatch.setattr(feedback, "ROOT", tmp_path)
    before = feedback._fingerprint()
    assert feedback._fingerprint() == before, "the same files must give the same fingerprint"
    (tmp_path / "kvcourse" / "memory.py").write_text("x = 2\n")
    assert feedback._fingerprint() != before, "an edit to a learner file must change the fingerprint"


def test_exercises_and_predictions_are_counted_apart():
    board = feedback.Progress(
        [_row("0.1"), _row("0.2", "incorrect")], [_row("0.a"), _row("0.b", "not attempted"), _row("2.a", "incorrect")]
    )
    assert board.summary() == "1 of 2 exercises correct; 1 of 3 predictions right (2 answered).", board.summary()
    assert "prediction</th>" in board._repr_html_(), "the predictions get a table of their own"
    assert feedback.Progress([_row("0.1")]).summary() == "1 of 1 exercises correct."

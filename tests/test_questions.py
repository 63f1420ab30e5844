"""Prediction questions: graded by digest, recorded for the scoreboard, asked with None in the notebooks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcourse.course import questions
from kvcourse.course.questions import QUESTIONS, Question, answer, digest, normalize, question_results

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def answers_file(tmp_path, monkeypatch):
    """Keep the learner's real answers file out of the tests."""
    path = tmp_path / "answers.json"
    monkeypatch.setattr(questions, "ANSWERS_FILE", path)
    return path


def make_question(kind: str, expected: object, **extra) -> Question:
    """A question whose expected answer is `expected`, stored only as its digest."""
    draft = Question("9.z", "09", "a test question", kind, "", **extra)
    return Question("9.z", "09", "a test question", kind, digest(draft, expected), **extra)


def test_a_right_answer_is_recorded_as_correct_and_a_wrong_one_not(answers_file, monkeypatch, capsys):
    question = make_question("int", 3)
    monkeypatch.setitem(QUESTIONS, "9.z", question)
    answer("9.z", 4)
    assert "❌" in capsys.readouterr().out
    assert question_results("9.z")[0]["status"] == "incorrect"
    answer("9.z", 3.0)  # the same number, spelled differently
    assert "✅" in capsys.readouterr().out
    assert question_results("9.z")[0] == {
        "id": "9.z",
        "title": "a test question",
        "passed": 1,
        "total": 1,
        "status": "correct",
    }


def test_none_means_not_answered_yet_and_records_nothing(answers_file, monkeypatch, capsys):
    monkeypatch.setitem(QUESTIONS, "9.z", make_question("choice", "b", choices=("a", "b")))
    answer("9.z", None)
    assert "Replace None" in capsys.readouterr().out
    assert not answers_file.exists()
    assert question_results("9.z")[0]["status"] == "not attempted"


@pytest.mark.parametrize(
    "kind, value, extra, problem",
    [
        ("int", 2.5, {}, "whole number"),
        ("int", "three", {}, "number"),
        ("int", True, {}, "number"),
        ("choice", "e", {"choices": ("a", "b")}, "one of a, b"),
    ],
)
def test_an_answer_of_the_wrong_kind_is_a_clear_error(kind, value, extra, problem):
    with pytest.raises(ValueError, match=problem):
        normalize(make_question(kind, "a" if kind == "choice" else 1, **extra), value)


def test_floats_compare_after_rounding_and_digests_depend_on_the_question():
    question = make_question("float", 0.27, decimals=2)
    assert digest(question, 0.2749) == question.digest and digest(question, 0.26) != question.digest
    other = Question("9.y", "09", "another", "float", "", decimals=2)
    assert digest(other, 0.27) != question.digest, "equal answers to different questions must not share a digest"


def test_an_unknown_question_is_a_clear_error():
    with pytest.raises(ValueError, match="No question"):
        answer("0.zz", 1)


@pytest.mark.parametrize("question", list(QUESTIONS.values()), ids=list(QUESTIONS))
def test_every_question_is_asked_in_its_notebook_without_its_answer(question):
    sources = list((ROOT / "notebooks").glob(f"{question.notebook}_*.py"))
    assert sources, f"question {question.id}: no notebook {question.notebook}"
    text = sources[0].read_text()
    assert re.search(rf'answer\("{re.escape(question.id)}",\s*None\)', text), (
        f"notebook {sources[0].name} should ask question {question.id} with answer({question.id!r}, None)"
    )
    assert re.fullmatch(r"[0-9a-f]{64}", question.digest), f"question {question.id}: the digest is not a SHA-256"

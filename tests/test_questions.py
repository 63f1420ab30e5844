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


@pytest.mark.parametrize("typed", ["73,728", "73728", "73 728", "73728.0", "72 KiB", "72KiB", "0.0703125 MiB", 73728])
def test_a_number_is_taken_as_the_notebook_prints_it(typed):
    question = make_question("int", 73728, unit="bytes")
    assert digest(question, typed) == question.digest, f"{typed!r} means 73,728 bytes"


@pytest.mark.parametrize("typed", ["R3", "request 3", "r 3", "#3", "3"])
def test_a_request_is_taken_by_its_name(typed):
    assert normalize(make_question("int", 3), typed) == "3"


@pytest.mark.parametrize("typed", ["b", "(b)", "B", "b)", "(b) only the stack's", "option b", "Answer: B"])
def test_a_choice_is_taken_as_written(typed):
    assert normalize(make_question("choice", "b", choices=("a", "b", "c")), typed) == "b"


def test_a_choice_of_words_takes_spaces_and_hyphens():
    question = make_question("choice", "skip_ahead", choices=("fcfs", "skip_ahead"))
    assert [normalize(question, t) for t in ("skip-ahead", "skip ahead", "FCFS")] == [
        "skip_ahead",
        "skip_ahead",
        "fcfs",
    ]


@pytest.mark.parametrize("typed, problem", [("72 apples", "in bytes"), ("seventy", "such as 73728"), ("72 KiB", None)])
def test_a_unit_is_read_only_where_the_question_counts_in_it(typed, problem):
    bytes_question = make_question("int", 73728, unit="bytes")
    if problem is None:  # a unit where the question takes none is refused in words
        with pytest.raises(ValueError, match="without a unit"):
            normalize(make_question("int", 3), typed)
        return
    with pytest.raises(ValueError, match=problem):
        normalize(bytes_question, typed)


def test_a_wrong_format_is_one_sentence_not_a_traceback(answers_file, monkeypatch, capsys):
    monkeypatch.setitem(QUESTIONS, "9.z", make_question("int", 3))
    answer("9.z", "three-ish")  # must not raise
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "takes a number" in out and "Nothing was recorded" in out, out
    assert not answers_file.exists(), "an unreadable answer must record nothing"

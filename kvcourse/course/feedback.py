"""Notebook feedback in the spirit of Kaggle's learntools: check, hint, solution, progress."""

from __future__ import annotations

import contextlib
import hashlib
import html
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kvcourse.course.exercises import get

ROOT = Path(__file__).resolve().parents[2]
ICONS = {"correct": "✅", "incorrect": "❌", "not attempted": "⏳", "skipped": "⏭️"}
_WORKER = None  # the warm grading process (kvcourse/course/worker.py), started by the first check
_VERDICTS: dict[str, tuple[str, dict]] = {}  # exercise id -> (fingerprint of the code it was graded on, its row)


class CheckCrashed(RuntimeError):
    """The tests could not finish: the code under test crashed the process running them, or hung it."""


def _fingerprint() -> str:
    """What a verdict depends on: every file of the package, the solutions and the graded tests, as they are now."""
    from kvcourse.course.solutions_switch import solutions_enabled

    digest = hashlib.sha256(str(solutions_enabled()).encode())
    for folder in ("kvcourse", "solutions", "tests/exercises"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _graded(exercise_ids: list[str]) -> list[dict]:
    """Rows for these exercises, grading only those whose code changed since they were last graded."""
    fingerprint = _fingerprint()
    stale = [i for i in exercise_ids if _VERDICTS.get(i, ("",))[0] != fingerprint]
    if stale:
        for row in _grade(stale):
            _VERDICTS[row["id"]] = (fingerprint, row)
    return [_VERDICTS[i][1] for i in exercise_ids]


def _grade(exercise_ids: list[str]) -> list[dict]:
    """Grade in a process apart from this kernel that reads kvcourse/ afresh: a fork of a warm worker."""
    global _WORKER
    from kvcourse.course.solutions_switch import solutions_enabled

    if sys.platform != "linux":  # fork after importing torch is only safe on Linux: a fresh Python per check
        return _grade_in_subprocess(exercise_ids)
    from kvcourse.course.worker import Worker, WorkerError

    _WORKER = _WORKER or Worker()
    try:
        answer = _WORKER.grade(exercise_ids, solutions=solutions_enabled())
    except WorkerError:  # it could not start, or died twice in a row: the slow way still answers
        return _grade_in_subprocess(exercise_ids)
    if "error" in answer:
        raise CheckCrashed(answer["error"])
    return answer["results"]


def _grade_in_subprocess(exercise_ids: list[str]) -> list[dict]:
    """Run the grader in a fresh Python process (off Linux, or when the warm worker cannot start)."""
    command = [sys.executable, "-m", "kvcourse", "grade", "--json", *exercise_ids]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    lines = done.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise CheckCrashed(f"the grader did not report (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])["results"]


# A raw error from the course's own guards, raised inside the learner's code, names the rule it means.
RAW_ERROR_RULES = (
    ("freed twice", "a block was given back more times than it is held (a double free)"),
    ("already in the free-block queue", "a block was queued while already free: only its last holder frees it"),
    ("is not in the free-block queue", "a block was taken out of the free queue while it was not in it"),
    ("the free-block queue is empty", "a block was taken from an empty pool: check there is room first"),
    ("blocks but only", "more blocks were taken than are free: check there is room before taking any"),
    ("Index put requires the source and destination dtypes match", "store keys and values in the cache's dtype"),
    ("KeyError", "a dictionary entry was missing: {where}"),
)
# Where a missing entry usually comes from, in the words of the chapter the learner is in (no later ideas).
KEY_ERROR_PLACES = {
    "1": "a request id looked up among the running requests after it left them?",
    "2": "a request id looked up in active_pool after it was finished, preempted or aborted, or never admitted?",
    "3": "a request's block table (req_to_blocks) read after the request was freed, or before it got one?",
    "7": "a request id looked up in active_pool or _swapped after it left them?",
}
KEY_ERROR_LATER = "a stale prefix-cache hash, or a request's table read after it was freed?"


def speak(message: str, exercise_id: str = "") -> str:
    """The rule a raw error means, put in front of it, in the lesson's terms (messages that speak are kept)."""
    where = KEY_ERROR_PLACES.get(exercise_id.split(".")[0], KEY_ERROR_LATER)
    for words, rule in RAW_ERROR_RULES:
        rule = rule.format(where=where)
        if words in message and not message.startswith(rule):
            return f"{rule} ({message})" if rule.endswith("?") else f"{rule}. ({message})"
    return message


def check(exercise_id: str, seed: int | None = None) -> None:
    """Run one exercise's tests and say: correct, incorrect (what failed, a hint) or not attempted.

    `seed=N` runs the lockstep comparison with the reference on that one seed only (the failure message
    says which seed to pass, to reproduce it).
    """
    exercise = get(exercise_id)
    print(f"Running the tests of Exercise {exercise.id} ...", flush=True)
    try:
        fingerprint = _fingerprint()
        with _lockstep_seed(seed):
            result = _grade([exercise.id])[0]
        if seed is None:
            _VERDICTS[exercise.id] = (fingerprint, result)  # progress() shows it without grading it again
    except CheckCrashed as error:
        print(f"{ICONS['incorrect']} Exercise {exercise.id} ({exercise.title}): the tests could not finish.")
        print(f"   What happened: {error}")
        print("   Your notebook is fine; fix the code (or restart the check) and run this cell again.")
        return
    head = f"{ICONS[result['status']]} Exercise {exercise.id} ({exercise.title}):"
    if result["status"] == "correct":
        print(f"{head} correct. {result['passed']}/{result['total']} tests pass.{_reference_note()}")
    elif result["status"] == "not attempted":
        where = re.search(r"edit (\S+), (\S+)\.$", result["message"])
        place = f"{where[1]}, in {where[2]}" if where else exercise.path
        print(f"{head} not attempted yet.")
        print(f"   Open {place}: replace the `raise NotImplementedError` under the TODO with your code,")
        print("   save the file, then run this cell again.")
        if result.get("needs"):
            needed = get(result["needs"])
            print(f"   Its tests also run Exercise {needed.id} ({needed.title}): do that one first.")
    elif result["status"] == "skipped":
        print(f"{head} skipped here: {result['message']}")
    else:
        counts = f" {result['passed']}/{result['total']} tests pass." if result["total"] else ""
        print(f"{head} not yet.{counts}")
        print(f"   What failed: {speak(result['message'], exercise.id)}")
        if result["hint"]:
            print(f"   Hint: {result['hint']}")


@contextlib.contextmanager
def _lockstep_seed(seed: int | None) -> Iterator[None]:
    """Pass check()'s seed to the grading process (it inherits this environment) for the call's duration."""
    from kvcourse.course.lockstep.core import SEED_ENV

    if seed is None:
        yield
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed is {seed!r}; pass the whole number a failure message gave, e.g. seed=3.")
    before = os.environ.get(SEED_ENV)
    os.environ[SEED_ENV] = str(seed)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SEED_ENV, None)
        else:
            os.environ[SEED_ENV] = before


def _reference_note() -> str:
    """Say so when the code graded is the reference, not the learner's (KVCOURSE_SOLUTIONS=1)."""
    from kvcourse.course.solutions_switch import solutions_enabled

    return " (graded on the reference solutions: KVCOURSE_SOLUTIONS=1)" if solutions_enabled() else ""


def hint(exercise_id: str, level: int = 1) -> None:
    """Print a nudge (level 1) or the approach in words (level 2); neither gives the code away."""
    exercise = get(exercise_id)
    if level not in (1, 2):
        raise ValueError(
            f"hint level {level!r} does not exist: use hint({exercise.id!r}) for a nudge, "
            f"hint({exercise.id!r}, level=2) for the approach, or solution({exercise.id!r}) for the code."
        )
    if level == 1:
        print(f"Hint for Exercise {exercise.id} ({exercise.title}): {exercise.hint}")
        print(f"   Still stuck? hint({exercise.id!r}, level=2) gives the approach.")
    else:
        print(f"Approach for Exercise {exercise.id} ({exercise.title}): {exercise.approach}")
        print(f"   The reference code: solution({exercise.id!r}).")


def solution(exercise_id: str) -> None:
    """Print the reference code for one exercise, from solutions/."""
    from kvcourse.course.stubs import (  # imported late: `python -m kvcourse stubs` must not find it loaded
        BEGIN_MARK,
        END_MARK,
    )

    exercise = get(exercise_id)
    source = (ROOT / "solutions" / f"{exercise.module}.py").read_text()
    pattern = rf"{BEGIN_MARK} {re.escape(exercise.id)}\n(.*?)\n\s*{END_MARK}"
    regions = re.findall(pattern, source, flags=re.S)
    print(f"Reference for Exercise {exercise.id} ({exercise.title}), from solutions/{exercise.module}.py:\n")
    print("\n\n    ...\n\n".join(regions))


class Progress:
    """A scoreboard that shows as an HTML table in a notebook and as text elsewhere: exercises, then predictions."""

    def __init__(self, results: list[dict], predictions: list[dict] | None = None) -> None:
        self.exercises = results
        self.predictions = predictions or []
        self.results = self.exercises + self.predictions

    def summary(self) -> str:
        """One line that counts exercises and predictions apart: they are different kinds of work."""
        done = sum(r["status"] == "correct" for r in self.exercises)
        line = f"{done} of {len(self.exercises)} exercises correct"
        if self.predictions:
            right = sum(r["status"] == "correct" for r in self.predictions)
            answered = sum(r["status"] != "not attempted" for r in self.predictions)
            line += f"; {right} of {len(self.predictions)} predictions right ({answered} answered)"
        return line + "."

    def __repr__(self) -> str:
        rows = [f"{r['id']:<5} {r['title']:<40} {r['passed']:>3}/{r['total']:<3} {r['status']}" for r in self.results]
        return "\n".join(rows + [self.summary()])

    def _repr_html_(self) -> str:
        def table(rows: list[dict], first: str) -> str:
            cells = "".join(
                f"<tr><td>{r['id']}</td><td>{html.escape(r['title'])}</td>"
                f"<td>{r['passed']}/{r['total']}</td><td>{ICONS[r['status']]} {r['status']}</td></tr>"
                for r in rows
            )
            head = f"<tr><th>{first}</th><th>title</th><th>tests</th><th>status</th></tr>"
            return f"<table><thead>{head}</thead><tbody>{cells}</tbody></table>" if rows else ""

        note = f"<p>{_reference_note().strip(' ()')}</p>" if _reference_note() else ""
        return (
            f"{note}{table(self.exercises, 'exercise')}{table(self.predictions, 'prediction')}<p>{self.summary()}</p>"
        )


def progress(*exercise_ids: str) -> Progress:
    """The scoreboard of all exercises (or the given ones), predictions apart; unchanged code is not graded again."""
    from kvcourse.course.exercises import EXERCISES
    from kvcourse.course.questions import question_results

    ids = [get(i).id for i in exercise_ids] or list(EXERCISES)
    return Progress(_graded(ids), [] if exercise_ids else question_results())

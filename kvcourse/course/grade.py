"""Grade the learner's exercises: run the graded tests and print a scoreboard.

    python -m kvcourse grade               # your code in kvcourse/
    python -m kvcourse grade --solutions   # the reference in solutions/
    python -m kvcourse grade 2.1 2.2       # only some exercises
    python -m kvcourse grade --json        # last line: one JSON object (used by check())

Exit code 0 only when every selected exercise passes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest

from kvcourse.course.exercises import EXERCISES, Exercise, get
from kvcourse.course.results import (
    CORRECT,
    INCORRECT,
    NOT_ATTEMPTED,
    SKIPPED,
    ExerciseResult,
    TestOutcome,
    id_key,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "exercises"
TEST_TIMEOUT_S = int(os.environ.get("KVCOURSE_TEST_TIMEOUT_S", "30"))  # per graded test (tests lower it)

__all__ = ["CORRECT", "INCORRECT", "NOT_ATTEMPTED", "SKIPPED", "ExerciseResult", "TestOutcome", "main", "run"]


def _plain_message(excinfo) -> tuple[str, str | None, bool]:
    """Turn an exception into (message, exercise id of a stub, timed out?) without leaking answers."""
    value, kind = excinfo.value, excinfo.type.__name__
    text = str(value)
    if isinstance(value, NotImplementedError) and text.startswith("Exercise "):
        return text, text.split()[1], False
    if "Timeout" in text and "pytest-timeout" in text:
        return (
            f"your code ran for more than {TEST_TIMEOUT_S} s and was stopped: look for a loop that "
            "never ends (a while loop whose condition never changes, or a queue that never empties).",
            None,
            True,
        )
    if isinstance(value, AssertionError):
        first = text.split("\nassert ")[0].strip()
        if first and not first.startswith("assert "):
            return first, None, False
        return "a check failed (the test gave no message; see tests/exercises for the test).", None, False
    where = ""
    for entry in reversed(excinfo.traceback):
        path = Path(str(entry.path))
        if path.parent.name in {"kvcourse", "solutions"}:
            where = f" (raised at {path.parent.name}/{path.name}, line {entry.lineno + 1})"
            break
    return f"{kind}: {text}{where}", None, False


def _import_error_message(longrepr: str) -> str:
    """'kvcourse/memory.py, line 27: SyntaxError: ...' from pytest's report of a failed import."""
    errors = [line[1:].strip() for line in longrepr.splitlines() if line.startswith("E ") and line[1:].strip()]
    places = re.findall(r'File "[^"]*/((?:kvcourse|solutions)/[^"]+\.py)", line (\d+)', longrepr)
    where = f"{places[-1][0]}, line {places[-1][1]}: " if places else ""
    return f"the code could not be imported ({where}{errors[-1] if errors else 'see the test file'}). Fix that first."


class _Collector:
    """A pytest plugin that records every graded test's outcome and drives a progress bar.

    `emit`, when given, receives one dict per event as it happens: {"start": nodeid} before a test,
    {"test": {...outcome}} after it, {"collect_error": ...}.
    """

    def __init__(self, show_progress: bool, emit: Callable[[dict], None] | None = None) -> None:
        self.outcomes: dict[str, TestOutcome] = {}
        self.import_errors: dict[str, str] = {}  # test file name -> what went wrong importing it
        self.show_progress = show_progress
        self.emit = emit
        self.bar = None

    def pytest_collectreport(self, report) -> None:
        """A test file that cannot even be imported (a syntax error in kvcourse/, say) is kept, in words."""
        name = Path(str(report.fspath)).name
        if report.failed:
            self.import_errors[name] = _import_error_message(str(report.longrepr))
        elif report.skipped and name.startswith("test_"):
            self.import_errors[name] = (
                "the tests were skipped while importing the code under test; a skip counts as a failure."
            )
        if self.emit and name in self.import_errors:
            self.emit({"collect_error": name, "message": self.import_errors[name]})

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            ids = [ex.id for ex in EXERCISES.values() if item.get_closest_marker(ex.marker)]
            self.outcomes[item.nodeid] = TestOutcome(item.nodeid, ids, passed=False)
        if self.show_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=len(items), desc="grading", unit="test", file=sys.stderr, leave=False)

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        if self.emit and nodeid in self.outcomes:
            self.emit({"start": nodeid})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        outcome = self.outcomes.get(item.nodeid)
        if outcome is None:
            return
        if report.skipped:
            from _pytest.skipping import evaluate_skip_marks

            reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
            outcome.passed, outcome.skipped = False, True
            outcome.excused = report.when == "setup" and evaluate_skip_marks(item) is not None  # its own marker
            if outcome.excused:
                outcome.message = reason.removeprefix("Skipped: ")
            else:
                outcome.message = (
                    f"the test was skipped from inside the code under test ({reason or 'no reason given'}); "
                    "a skip counts as a failure."
                )
        elif report.failed and not outcome.message:
            outcome.passed = False
            outcome.message, outcome.stub_of, outcome.timed_out = _plain_message(call.excinfo)
        elif report.when == "call" and report.passed and not outcome.message and not outcome.skipped:
            outcome.passed = True

    def pytest_runtest_setup(self, item) -> None:
        """After one test of an exercise timed out, fail its other tests at once instead of waiting again."""
        mine = self.outcomes.get(item.nodeid)
        if mine and any(o.timed_out and set(o.exercises) & set(mine.exercises) for o in self.outcomes.values()):
            pytest.fail("not run: an earlier test of this exercise timed out.", pytrace=False)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        if self.emit and nodeid in self.outcomes:
            self.emit({"test": asdict(self.outcomes[nodeid])})
        if self.bar is not None:
            self.bar.update(1)


def _texts(exercise: Exercise, solutions: bool) -> tuple[str | None, str | None]:
    """(the graded file's text, the pristine stub's text) for telling "not attempted" from "incorrect"."""
    graded = ROOT / ("solutions" if solutions else "kvcourse") / f"{exercise.module}.py"
    text = graded.read_text() if graded.is_file() else None
    solution = ROOT / "solutions" / f"{exercise.module}.py"
    stub = None
    if solution.is_file():
        from kvcourse.course.stubs import stub_for

        stub = stub_for(solution)[0]
    return text, stub


def _test_files(selected: list[Exercise], tests: Path = TESTS) -> list[str]:
    """Only the graded test files that mention a selected marker: collecting is the slow part of a check."""
    files = [p for p in sorted(tests.glob("test_*.py")) if any(ex.marker in p.read_text() for ex in selected)]
    return [str(p) for p in files] or [str(tests)]


def pytest_args(selected: list[Exercise], root: Path = ROOT) -> list[str]:
    """The pytest command line that runs the graded tests of `selected` under `root`."""
    return [
        *_test_files(selected, root / "tests" / "exercises"),
        "-m",
        " or ".join(ex.marker for ex in selected),
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-p",
        "no:nbval",  # grading never reads a notebook; loading nbval's Jupyter stack costs seconds per run
        f"--timeout={TEST_TIMEOUT_S}",
        "--assert=plain",  # feedback shows the tests' own messages only, so skip rewriting (seconds per check)
        "--continue-on-collection-errors",
        "-q",
        "-o",
        "addopts=",  # pyproject's addopts name nbval's options: a learner's install (Colab, Gradescope) has no nbval
        "--rootdir",
        str(root),
    ]


def run(
    exercise_ids: list[str] | None = None, solutions: bool = False, show_progress: bool = False
) -> list[ExerciseResult]:
    """Run the graded tests in this process and return one result per exercise (the learner's own check).

    `solutions` alone decides whose code runs: KVCOURSE_SOLUTIONS is set for the reference and removed otherwise.
    """
    selected = [get(i) for i in exercise_ids] if exercise_ids else list(EXERCISES.values())
    if solutions:
        os.environ["KVCOURSE_SOLUTIONS"] = "1"
    else:
        os.environ.pop("KVCOURSE_SOLUTIONS", None)
    collector = _Collector(show_progress)
    with contextlib.redirect_stdout(io.StringIO()) as log:
        code = pytest.main(pytest_args(selected), plugins=[collector])
    if collector.bar is not None:
        collector.bar.close()
    if code not in (0, 1, 5):  # 5: nothing collected, reported per exercise below
        raise RuntimeError(f"the graded tests could not run (pytest exit code {code}):\n{log.getvalue()[-3000:]}")
    results = []
    for exercise in selected:
        outcomes = [o for o in collector.outcomes.values() if exercise.id in o.exercises]
        result = summarize(exercise, outcomes, *_texts(exercise, solutions))
        broken = [msg for name, msg in collector.import_errors.items() if exercise.marker in (TESTS / name).read_text()]
        if broken:
            result.status, result.message, result.hint = INCORRECT, broken[0], ""
        results.append(result)
    return results


def scoreboard(results: list[ExerciseResult]) -> str:
    """A plain-text table in course order: exercise, title, tests passed, status."""
    results = sorted(results, key=lambda r: id_key(r.id))
    width = max(len(r.title) for r in results)
    lines = [f"{'exercise':<9} {'title':<{width}}  {'passed':>7}  status", "-" * (width + 30)]
    for r in results:
        lines.append(f"{r.id:<9} {r.title:<{width}}  {f'{r.passed}/{r.total - r.skipped}':>7}  {r.status}")
    done = sum(r.status == CORRECT for r in results)
    lines.append("-" * (width + 30))
    lines.append(f"{done} of {len(results)} exercises correct.")
    return "\n".join(lines)


def questions_scoreboard() -> str:
    """The prediction questions answered in the notebooks with answer(id, value), in course order."""
    from kvcourse.course.questions import question_results

    rows = sorted(question_results(), key=lambda r: id_key(r["id"]))
    right = sum(r["status"] == CORRECT for r in rows)
    lines = ["", f"{'question':<9} {'title':<50} status"]
    lines += [f"{r['id']:<9} {r['title'][:50]:<50} {r['status']}" for r in rows]
    lines.append(f"{right} of {len(rows)} predictions right (answer them in the notebooks: answer(id, value)).")
    return "\n".join(lines)


def _gradescope(out: Path, exercise_ids: list[str] | None, solutions: bool, parser) -> int:
    """`--gradescope F`: grade kvcourse/ (or solutions/) through the classroom boundary, never in this process."""
    from kvcourse.course import gradescope

    for exercise_id in exercise_ids or []:
        if exercise_id not in EXERCISES:
            parser.error(f"unknown exercise {exercise_id!r}: choose from {', '.join(EXERCISES)}.")
    folder = ROOT / ("solutions" if solutions else "kvcourse")
    texts = {ex.module: (folder / f"{ex.module}.py").read_text() for ex in EXERCISES.values()}
    try:
        data = gradescope.grade_submission(None, out, exercise_ids, texts=texts)
    except gradescope.GraderBroken as error:
        print(f"grade: {error} (wrote {out}, which says so)", file=sys.stderr)
        return 2
    print("\n".join(test["output"] for test in data["tests"]))
    print(f"score {data['score']} of {len(data['tests'])}; wrote {out}")
    return 0 if data["score"] == sum(test["max_score"] for test in data["tests"]) else 1


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: print the scoreboard (or JSON) and exit 0 only if all pass."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse grade", description="Grade the course exercises.")
    parser.add_argument("exercises", nargs="*", help="exercise ids such as 2.1 (default: all)")
    parser.add_argument(
        "--solutions", action="store_true", help="grade the reference in solutions/ (KVCOURSE_SOLUTIONS is ignored)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument(
        "--gradescope",
        metavar="PATH",
        type=Path,
        help="grade through the classroom grader's boundary (as root) and write Gradescope's results.json to PATH",
    )
    args = parser.parse_args(argv)
    ignored = not args.solutions and os.environ.get("KVCOURSE_SOLUTIONS", "").strip() not in ("", "0")
    if ignored and not args.json:
        print("KVCOURSE_SOLUTIONS is set but ignored: grading kvcourse/ (pass --solutions for the reference).")
    if args.gradescope:
        return _gradescope(args.gradescope, args.exercises or None, args.solutions, parser)
    try:
        results = run(args.exercises or None, solutions=args.solutions, show_progress=not args.json)
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        graded = "solutions/" if args.solutions else "kvcourse/"
        print(json.dumps({"solutions": args.solutions, "graded": graded, "results": [asdict(r) for r in results]}))
    else:
        print(scoreboard(results))
        if not args.exercises and not args.solutions:
            print(questions_scoreboard())
    return 0 if all(r.status in (CORRECT, SKIPPED) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Grade the learner's exercises: run the graded tests and print a scoreboard.

    python -m kvcourse.grade               # your code in kvcourse/
    python -m kvcourse.grade --solutions   # the reference in solutions/
    python -m kvcourse.grade 2.1 2.2       # only some exercises
    python -m kvcourse.grade --json        # last line: one JSON object (used by check())

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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from kvcourse.course.exercises import EXERCISES, Exercise, get

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "exercises"
TEST_TIMEOUT_S = int(os.environ.get("KVCOURSE_TEST_TIMEOUT_S", "30"))  # per graded test (tests lower it)

CORRECT, INCORRECT, NOT_ATTEMPTED, SKIPPED = "correct", "incorrect", "not attempted", "skipped"


@dataclass
class TestOutcome:
    """What one graded test said, in words a learner can act on."""

    nodeid: str
    exercises: list[str]
    passed: bool
    skipped: bool = False
    message: str = ""
    stub_of: str | None = None  # the exercise whose NotImplementedError stopped the test
    timed_out: bool = False


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
    """A pytest plugin that records every graded test's outcome and drives a progress bar."""

    def __init__(self, show_progress: bool) -> None:
        self.outcomes: dict[str, TestOutcome] = {}
        self.import_errors: dict[str, str] = {}  # test file name -> what went wrong importing it
        self.show_progress = show_progress
        self.bar = None

    def pytest_collectreport(self, report) -> None:
        """A test file that cannot even be imported (a syntax error in kvcourse/, say) is kept, in words."""
        if report.failed:
            self.import_errors[Path(str(report.fspath)).name] = _import_error_message(str(report.longrepr))

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            ids = [ex.id for ex in EXERCISES.values() if item.get_closest_marker(ex.marker)]
            self.outcomes[item.nodeid] = TestOutcome(item.nodeid, ids, passed=False)
        if self.show_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=len(items), desc="grading", unit="test", file=sys.stderr, leave=False)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        outcome = self.outcomes.get(item.nodeid)
        if outcome is None:
            return
        if report.skipped:
            outcome.skipped = True
            outcome.message = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        elif report.failed and not outcome.message:
            outcome.passed = False
            outcome.message, outcome.stub_of, outcome.timed_out = _plain_message(call.excinfo)
        elif report.when == "call" and report.passed and not outcome.message:
            outcome.passed = True

    def pytest_runtest_setup(self, item) -> None:
        """After one test of an exercise timed out, fail its other tests at once instead of waiting again."""
        mine = self.outcomes.get(item.nodeid)
        if mine and any(o.timed_out and set(o.exercises) & set(mine.exercises) for o in self.outcomes.values()):
            pytest.fail("not run: an earlier test of this exercise timed out.", pytrace=False)

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        if self.bar is not None:
            self.bar.update(1)


def _own_stub_message(exercise: Exercise) -> str | None:
    """The message of the exercise's own `raise NotImplementedError`, if it is still in the learner's file."""
    path = ROOT / exercise.path
    found = (
        re.search(rf'NotImplementedError\(\s*"(Exercise {re.escape(exercise.id)} \(.*?)"\s*\)', path.read_text())
        if path.exists()
        else None
    )
    return found[1] if found else None


def _summarize(exercise: Exercise, outcomes: list[TestOutcome]) -> ExerciseResult:
    """Fold one exercise's test outcomes into a status, the first failure and a hint."""
    result = ExerciseResult(exercise.id, exercise.title, exercise.path, outcomes=outcomes)
    ran = [o for o in outcomes if not o.skipped]
    result.total = len(ran)
    result.passed = sum(o.passed for o in ran)
    failures = [o for o in ran if not o.passed]
    if not outcomes:
        result.status, result.message = INCORRECT, "no graded tests found for this exercise."
    elif not ran:
        result.status, result.message = SKIPPED, outcomes[0].message
    elif not failures:
        result.status = CORRECT
    elif all(o.stub_of for o in failures) and (
        all(o.stub_of == exercise.id for o in failures) or _own_stub_message(exercise)
    ):
        # Only stubs stopped the tests, and this exercise's own stub is still there: not started yet.
        result.status = NOT_ATTEMPTED
        result.message = _own_stub_message(exercise) or failures[0].message
        result.needs = next((o.stub_of for o in failures if o.stub_of != exercise.id), None)
    else:
        result.status = INCORRECT
        first = next((o for o in failures if o.stub_of is None), failures[0])
        if first.stub_of and first.stub_of != exercise.id:
            needed = EXERCISES.get(first.stub_of)
            title = f" ({needed.title})" if needed else ""
            result.message = f"this exercise builds on Exercise {first.stub_of}{title}; finish that one first."
        else:
            result.message = first.message
            result.hint = exercise.hint
    return result


def _test_files(selected: list[Exercise]) -> list[str]:
    """Only the graded test files that mention a selected marker: collecting is the slow part of a check."""
    files = [p for p in sorted(TESTS.glob("test_*.py")) if any(ex.marker in p.read_text() for ex in selected)]
    return [str(p) for p in files] or [str(TESTS)]


def run(
    exercise_ids: list[str] | None = None, solutions: bool = False, show_progress: bool = False
) -> list[ExerciseResult]:
    """Run the graded tests in this process and return one result per exercise."""
    selected = [get(i) for i in exercise_ids] if exercise_ids else list(EXERCISES.values())
    if solutions:
        os.environ["KVCOURSE_SOLUTIONS"] = "1"
    collector = _Collector(show_progress)
    marker_expr = " or ".join(ex.marker for ex in selected)
    args = [
        *_test_files(selected),
        "-m",
        marker_expr,
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        f"--timeout={TEST_TIMEOUT_S}",
        "--assert=plain",  # feedback shows the tests' own messages only, so skip rewriting (seconds per check)
        "--continue-on-collection-errors",
        "-q",
        "-o",
        "addopts=",  # pyproject's addopts name nbval's options: a learner's install (Colab, Gradescope) has no nbval
        "--rootdir",
        str(ROOT),
    ]
    with contextlib.redirect_stdout(io.StringIO()) as log:
        code = pytest.main(args, plugins=[collector])
    if collector.bar is not None:
        collector.bar.close()
    if code not in (0, 1, 5):  # 5: nothing collected, reported per exercise below
        raise RuntimeError(f"the graded tests could not run (pytest exit code {code}):\n{log.getvalue()[-3000:]}")
    results = []
    for exercise in selected:
        outcomes = [o for o in collector.outcomes.values() if exercise.id in o.exercises]
        result = _summarize(exercise, outcomes)
        broken = [msg for name, msg in collector.import_errors.items() if exercise.marker in (TESTS / name).read_text()]
        if broken:
            result.status, result.message, result.hint = INCORRECT, broken[0], ""
        results.append(result)
    return results


def scoreboard(results: list[ExerciseResult]) -> str:
    """A plain-text table: exercise, title, tests passed, status."""
    width = max(len(r.title) for r in results)
    lines = [f"{'exercise':<9} {'title':<{width}}  {'passed':>7}  status", "-" * (width + 30)]
    for r in results:
        lines.append(f"{r.id:<9} {r.title:<{width}}  {f'{r.passed}/{r.total}':>7}  {r.status}")
    done = sum(r.status == CORRECT for r in results)
    lines.append("-" * (width + 30))
    lines.append(f"{done} of {len(results)} exercises correct.")
    return "\n".join(lines)


def questions_scoreboard() -> str:
    """The prediction questions answered in the notebooks with answer(id, value): asked, right or not yet."""
    from kvcourse.course.questions import question_results

    rows = question_results()
    right = sum(r["status"] == CORRECT for r in rows)
    lines = ["", f"{'question':<9} {'title':<50} status"]
    lines += [f"{r['id']:<9} {r['title'][:50]:<50} {r['status']}" for r in rows]
    lines.append(f"{right} of {len(rows)} predictions right (answer them in the notebooks: answer(id, value)).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: print the scoreboard (or JSON) and exit 0 only if all pass."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse.grade", description="Grade the course exercises.")
    parser.add_argument("exercises", nargs="*", help="exercise ids such as 2.1 (default: all)")
    parser.add_argument("--solutions", action="store_true", help="grade the reference solutions instead of kvcourse/")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--gradescope", metavar="PATH", type=Path, help="also write Gradescope's results.json to PATH")
    args = parser.parse_args(argv)
    try:
        results = run(args.exercises or None, solutions=args.solutions, show_progress=not args.json)
    except ValueError as error:
        parser.error(str(error))
    if args.gradescope:
        from kvcourse.course.gradescope import write_results

        write_results(args.gradescope, results)
    if args.json:
        print(json.dumps({"solutions": args.solutions, "results": [asdict(r) for r in results]}))
    else:
        print(scoreboard(results))
        if not args.exercises and not args.solutions:
            print(questions_scoreboard())
    return 0 if all(r.status in (CORRECT, SKIPPED) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

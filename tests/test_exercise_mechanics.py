"""The exercise mechanics: stubs generated from solutions, the solutions switch, and graded tests that can fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcourse.course.exercises import EXERCISES
from kvcourse.course.grade import _import_error_message
from kvcourse.course.stubs import StubError, make_stub, solution_files, stale_stubs

ROOT = Path(__file__).resolve().parent.parent


def _grade(*args: str, root: Path = ROOT) -> dict[str, dict]:
    """Run the grader in a fresh process (solutions switch off unless --solutions) and index by exercise."""
    env = {k: v for k, v in os.environ.items() if k != "KVCOURSE_SOLUTIONS"}
    done = subprocess.run(
        [sys.executable, "-m", "kvcourse", "grade", "--json", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return {r["id"]: r for r in json.loads(done.stdout.strip().splitlines()[-1])["results"]}


def test_stubs_match_solutions():
    stale = [str(p.relative_to(ROOT)) for p in stale_stubs()]
    assert not stale, f"stubs out of date, run `python -m kvcourse stubs`: {stale}"


def test_learner_package_has_no_answers():
    leaked = [
        p.name
        for p in (ROOT / "kvcourse").rglob("*")
        if p.is_file() and "BEGIN SOLUTION" in p.read_text(errors="ignore")
    ]
    assert not leaked, f"kvcourse/ ships solution regions: {leaked}"


def test_every_exercise_has_a_region_and_every_region_an_exercise():
    regions = set()
    for path in solution_files():
        regions |= set(re.findall(r"# BEGIN SOLUTION (\d+\.\d+)", path.read_text()))
    assert regions == set(EXERCISES), (
        f"regions without a registry row or rows without a region: {regions ^ set(EXERCISES)}"
    )


def test_stub_replaces_region_with_todo_and_raise():
    source = (
        "def f(x):\n    # Exercise 0.1: double it.\n    # BEGIN SOLUTION 0.1\n    return 2 * x\n    # END SOLUTION\n"
    )
    stub = make_stub(source, "solutions/memory.py")
    assert "return 2 * x" not in stub
    assert "# Exercise 0.1: double it." in stub
    assert (
        'raise NotImplementedError("Exercise 0.1 (KV bytes per token): not written yet: edit kvcourse/memory.py, f.")'
        in stub
    )
    namespace: dict = {}
    exec(compile(stub, "stub", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"Exercise 0\.1"):
        namespace["f"](3)


@pytest.mark.parametrize(
    "source, problem",
    [
        ("# BEGIN SOLUTION 0.1\nx = 1\n", "never closed"),
        ("x = 1\n# END SOLUTION\n", "END marker without"),
        ("# BEGIN SOLUTION 0.1\n# BEGIN SOLUTION 0.2\n# END SOLUTION\n", "inside the region"),
        ("# BEGIN SOLUTION 9.9\n# END SOLUTION\n", "unknown exercise"),
        ("# BEGIN SOLUTION\n# END SOLUTION\n", "malformed marker"),
    ],
)
def test_unbalanced_or_unknown_markers_are_errors(source, problem):
    with pytest.raises(StubError, match=problem):
        make_stub(source, "solutions/x.py")


@pytest.mark.parametrize("switch, folder", [("1", "solutions"), ("", "kvcourse")])
def test_solutions_switch_redirects_exercise_modules(switch, folder):
    env = {**os.environ, "KVCOURSE_SOLUTIONS": switch}
    code = "import kvcourse.memory as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).parent.name == folder


def _copy_with_fresh_stubs(target: Path) -> Path:
    """This tree (notebooks aside) with kvcourse/ stubs generated anew: a learner's edits here stay out of it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file() and not name.startswith("notebooks/"):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    for solution in solution_files():
        (target / "kvcourse" / solution.name).write_text(make_stub(solution.read_text(), str(solution)))
    return target


@pytest.mark.slow  # every graded test against the stubs, in child processes (minutes): `./course test -m slow` (CI runs it)
def test_every_graded_test_fails_on_the_stubs(tmp_path):
    """A graded test that passes on an untouched stub cannot tell right from wrong."""
    results = _grade(root=_copy_with_fresh_stubs(tmp_path))
    for exercise_id, result in results.items():
        assert result["total"] > 0, f"exercise {exercise_id} has no graded tests"
        passing = [o["nodeid"] for o in result["outcomes"] if o["passed"]]
        assert not passing, f"exercise {exercise_id}: these tests pass on the stubs: {passing}"
        assert result["status"] != "correct"


@pytest.mark.slow  # every graded test through the grader's children (a minute or more): `./course test -m slow` (CI runs it)
def test_every_graded_test_passes_on_the_solutions():
    results = _grade("--solutions")
    wrong = {i: (r["status"], r["message"]) for i, r in results.items() if r["status"] not in ("correct", "skipped")}
    assert not wrong, f"the reference fails its own graded tests: {wrong}"


def test_a_file_that_does_not_import_is_reported_in_words():
    report = """ImportError while importing test module '/x/tests/exercises/test_ex0_memory.py'.
E     File "/home/me/kvcourse/kvcourse/memory.py", line 27
E       return 2 * layers * (_kv_width(config)
E                           ^
E   SyntaxError: '(' was never closed"""
    message = _import_error_message(report)
    assert "kvcourse/memory.py, line 27" in message and "SyntaxError: '(' was never closed" in message

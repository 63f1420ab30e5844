"""Gradescope: the autograder zip, run on a stand-in /autograder with a half-solved submission."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kvcourse.course import gradescope
from kvcourse.course.exercises import EXERCISE_MODULES, EXERCISES
from kvcourse.course.grade import ExerciseResult
from kvcourse.course.stubs import stub_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("build") / "autograder.zip"
    gradescope.build(out)
    return out


def test_zip_has_the_scripts_and_fresh_stubs_but_no_reference(autograder_zip):
    with zipfile.ZipFile(autograder_zip) as archive:
        names = set(archive.namelist())
        for script in ("setup.sh", "run_autograder"):
            assert script in names
            assert archive.getinfo(script).external_attr >> 16 & 0o111, f"{script} must be executable"
        assert "pyproject.toml" in names and "tests/exercises/test_ex2_scheduler.py" in names
        assert not [n for n in names if n.startswith("solutions/")], "a submission could import the reference"
        assert "tests/test_gradescope.py" not in names and "notebooks/00_memory_math.py" not in names
        assert archive.read("kvcourse/scheduler.py").decode() == stub_for(ROOT / "solutions" / "scheduler.py")[0]


def run_autograder(autograder_zip: Path, root: Path, modules: list[str]) -> tuple[dict, str]:
    """Unzip the autograder as Gradescope does, submit the reference of `modules`, run it; (results, stdout)."""
    source, submission = root / "source", root / "submission" / "kvcourse"
    with zipfile.ZipFile(autograder_zip) as archive:
        archive.extractall(source)
    (source / "run_autograder").chmod(0o755)
    submission.mkdir(parents=True)
    for module in modules:
        (submission / f"{module}.py").write_text((ROOT / "solutions" / f"{module}.py").read_text())
    (submission.parent / "notes.txt").write_text("not a module: ignored")
    env = {k: v for k, v in os.environ.items() if k not in ("KVCOURSE_SOLUTIONS", "KVCOURSE_EXERCISES")}
    env["KVCOURSE_AUTOGRADER_ROOT"] = str(root)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # python3 = this environment's
    started = time.monotonic()
    done = subprocess.run(
        [str(source / "run_autograder")], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    print(f"run_autograder on {modules}: {time.monotonic() - started:.1f} s")  # the wall time, for the record
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "results" / "results.json").read_text()), done.stdout


@pytest.mark.slow
def test_run_autograder_grades_a_half_solved_submission(autograder_zip, tmp_path):
    """The reference memory.py and kv_cache.py submitted, the rest left as stubs: exactly their exercises pass."""
    results, stdout = run_autograder(autograder_zip, tmp_path, ["memory", "kv_cache"])
    assert "placed kvcourse/kv_cache.py, kvcourse/memory.py;" in stdout
    scores = {test["number"]: test for test in results["tests"]}
    assert set(scores) == set(EXERCISES)
    solved = {ex.id for ex in EXERCISES.values() if ex.module in ("memory", "kv_cache")}
    for number, test in scores.items():
        assert set(test) >= {"name", "score", "max_score", "output", "status"}
        if number in solved:
            assert (test["score"], test["status"]) == (test["max_score"], "passed"), test
            assert "correct" in test["output"]
        else:
            assert (test["score"], test["status"]) == (0, "failed"), test
            assert "correct." not in test["output"], test
    assert results["score"] == sum(test["score"] for test in results["tests"]) == len(solved)


@pytest.mark.slow
def test_run_autograder_gives_the_reference_full_marks(autograder_zip, tmp_path):
    results, _ = run_autograder(autograder_zip, tmp_path, sorted(EXERCISE_MODULES))
    failed = [t["output"] for t in results["tests"] if t["score"] != t["max_score"]]
    assert not failed and results["score"] == len(EXERCISES), failed


def test_partial_credit_and_feedback_follow_check():
    results = [
        ExerciseResult("3.3", "Allocate slots", "kvcourse/kv_cache.py", passed=3, total=4, status="incorrect"),
        ExerciseResult("5.4", "Triton kernel", "kvcourse/attention.py", status="skipped", message="no GPU"),
    ]
    results[0].message, results[0].hint = "a block was held twice", "count what you hold first"
    tests = gradescope.results_json(results, points=2.0)["tests"]
    assert [(t["score"], t["max_score"], t["status"]) for t in tests] == [(1.5, 2.0, "failed"), (2.0, 2.0, "passed")]
    assert tests[0]["output"].splitlines() == [
        "❌ Exercise 3.3 (Allocate slots): not yet. 3/4 tests pass.",
        "   What failed: a block was held twice",
        "   Hint: count what you hold first",
    ]


def test_place_prefers_the_repository_layout_and_ignores_solutions(tmp_path):
    course, submission = tmp_path / "course", tmp_path / "submission"
    (course / "kvcourse").mkdir(parents=True)
    for folder, text in [("", "loose"), ("repo/kvcourse", "in kvcourse"), ("repo/solutions", "reference")]:
        (submission / folder).mkdir(parents=True, exist_ok=True)
        (submission / folder / "scheduler.py").write_text(text)
    assert gradescope.place(submission, course) == ["kvcourse/scheduler.py"]
    assert (course / "kvcourse" / "scheduler.py").read_text() == "in kvcourse"


def test_bad_paths_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        gradescope.place(tmp_path / "missing", tmp_path)
    with pytest.raises(ValueError, match=r"\.zip"):
        gradescope.build(tmp_path / "autograder.tar")

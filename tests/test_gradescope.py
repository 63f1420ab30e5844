"""Gradescope: the autograder zip, run on a stand-in /autograder with a half-solved submission.

Most tests build the zip with the tests' fake observer (tests/grader/fake_observer.py, exercises 0.1 and 0.2):
quick. One slow test builds the real one (the lockstep harness, every exercise) and grades the reference and a
half-written course with it. Running it needs root (the boundary runs submitted code as another user).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from kvcourse.course import gradescope
from kvcourse.course.exercises import EXERCISE_MODULES, EXERCISES
from kvcourse.course.grade import ExerciseResult
from kvcourse.course.stubs import stub_for
from tests.grader.support import OBSERVER, python_for_child, why_not_here

ROOT = Path(__file__).resolve().parent.parent
GRADED = ["0.1", "0.2"]  # what the fake observer knows


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("build") / "autograder.zip"
    gradescope.build(out, OBSERVER, GRADED)
    return out


def test_zip_has_the_scripts_and_fresh_stubs_but_no_reference(autograder_zip):
    with zipfile.ZipFile(autograder_zip) as archive:
        names = set(archive.namelist())
        for script in ("setup.sh", "run_autograder"):
            assert script in names
            assert archive.getinfo(script).external_attr >> 16 & 0o111, f"{script} must be executable"
        assert "pyproject.toml" in names and "tests/exercises/test_ex2_scheduler.py" in names
        assert not [n for n in names if n.startswith("solutions/")], "a submission could import the reference"
        assert archive.getinfo("grader/reference.json").external_attr >> 16 == 0o600, "the answers are root's"
        assert "chmod -R go= grader tests" in archive.read("setup.sh").decode()
        assert "tests/test_gradescope.py" not in names and "notebooks/00_memory_math.py" not in names
        assert archive.read("kvcourse/scheduler.py").decode() == stub_for(ROOT / "solutions" / "scheduler.py")[0]


def run_autograder(
    autograder_zip: Path, root: Path, modules: dict[str, str], exercises: list[str] = GRADED
) -> tuple[dict, str]:
    """Unzip the autograder as Gradescope does (world-readable, like /autograder/source), submit, run it."""
    why = why_not_here()
    if why:
        pytest.skip(why)
    source = Path(tempfile.mkdtemp(prefix="kvcourse-autograder-")) / "source"
    submission = root / "submission" / "kvcourse"
    try:
        source.parent.chmod(0o755)
        with zipfile.ZipFile(autograder_zip) as archive:
            archive.extractall(source)
        for script in ("setup.sh", "run_autograder"):
            (source / script).chmod(0o755)  # extractall drops the modes; Gradescope keeps them
        for path in [source, *source.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))  # setup.sh's chmod -R a+rX
        submission.mkdir(parents=True)
        for module, text in modules.items():
            (submission / f"{module}.py").write_text(text)
        (submission.parent / "notes.txt").write_text("not a module: ignored")
        env = {k: v for k, v in os.environ.items() if k not in ("KVCOURSE_SOLUTIONS", "KVCOURSE_EXERCISES")}
        env.update(KVCOURSE_AUTOGRADER_ROOT=str(root), KVCOURSE_EXERCISES=" ".join(exercises))
        env["KVCOURSE_GRADER_PYTHON"] = python_for_child(source) or sys.executable
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # python3 = this environment's
        started = time.monotonic()
        done = subprocess.run(
            [str(source / "run_autograder")], env=env, capture_output=True, text=True, timeout=900, check=False
        )
        print(f"run_autograder on {sorted(modules)}: {time.monotonic() - started:.1f} s")  # for the record
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads((root / "results" / "results.json").read_text()), done.stdout
    finally:
        shutil.rmtree(source.parent, ignore_errors=True)


@pytest.mark.slow
def test_run_autograder_grades_a_half_solved_submission(autograder_zip, tmp_path, monkeypatch):
    """Exercise 0.1 solved, 0.2 left as its stub: exactly 0.1's point."""
    memory = (ROOT / "solutions" / "memory.py").read_text().split("def max_sequences")[0] + (
        "def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:\n"
        '    raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")\n'
    )
    results, stdout = run_autograder(autograder_zip, tmp_path, {"memory": memory})
    assert "placed kvcourse/memory.py;" in stdout
    scores = {test["number"]: test for test in results["tests"]}
    assert set(scores) == set(GRADED)
    assert (scores["0.1"]["score"], scores["0.1"]["status"]) == (1.0, "passed"), scores["0.1"]
    assert "correct" in scores["0.1"]["output"]
    assert (scores["0.2"]["score"], scores["0.2"]["status"]) == (0, "failed"), scores["0.2"]
    assert results["score"] == 1.0
    # the nbgrader route (this clone, the reference's observations made from solutions/) says the same
    monkeypatch.setenv("KVCOURSE_GRADER_PYTHON", python_for_child() or sys.executable)
    clone = gradescope.grade_submission(
        tmp_path / "submission", tmp_path / "clone.json", GRADED, log=lambda _: None, observer=OBSERVER
    )
    assert [(t["number"], t["score"], t["output"]) for t in clone["tests"]] == [
        (t["number"], t["score"], t["output"]) for t in results["tests"]
    ]


@pytest.mark.slow
def test_run_autograder_gives_the_reference_full_marks(autograder_zip, tmp_path):
    reference = {m: (ROOT / "solutions" / f"{m}.py").read_text() for m in sorted(EXERCISE_MODULES)}
    results, _ = run_autograder(autograder_zip, tmp_path, reference)
    failed = [t["output"] for t in results["tests"] if t["score"] != t["max_score"]]
    assert not failed and results["score"] == len(GRADED), failed


@pytest.mark.slow
def test_the_lockstep_autograder_grades_the_whole_course(tmp_path):
    """The zip as shipped (the lockstep observer, every exercise): the reference scores every point; a course
    with only notebook 00's file written scores exactly 0.1 and 0.2, every other exercise 0 and says so."""
    if why_not_here():
        pytest.skip(why_not_here())
    out = tmp_path / "autograder.zip"
    gradescope.build(out)
    every = list(EXERCISES)
    reference = {m: (ROOT / "solutions" / f"{m}.py").read_text() for m in sorted(EXERCISE_MODULES)}
    results, _ = run_autograder(out, tmp_path / "reference", reference, every)
    scores = {t["number"]: t["score"] for t in results["tests"]}
    assert sorted(scores) == sorted(every), "results.json lists every exercise"
    assert not [t["output"] for t in results["tests"] if t["score"] != t["max_score"]], "the reference loses points"
    memory_only = {"memory": reference["memory"]}
    results, _ = run_autograder(out, tmp_path / "memory-only", memory_only, every)
    earned = sorted(t["number"] for t in results["tests"] if t["score"])
    assert earned == ["0.1", "0.2"], f"only notebook 00's exercises are written, yet points went to {earned}"
    assert results["score"] == 2.0, results["score"]


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

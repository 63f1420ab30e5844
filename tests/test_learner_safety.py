"""A learner's edited kvcourse/ survives every command the README and the notebooks mention.

Each test works on a temporary copy of this checkout (its own git repository) in which the learner has
written exercises 0.1 (wrongly: bytes per element forgotten) and 0.2 (rightly), then runs a command
there as a learner would and compares kvcourse/memory.py before and after. The environment is the
learner's: KVCOURSE_SOLUTIONS unset, whatever the suite itself runs with.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcourse.course.stubs import BEGIN, END, edited_exercises, restore, stub_for

ROOT = Path(__file__).resolve().parent.parent
WRONG_0_1 = "return 0  # my first try at 0.1"
RIGHT_0_2 = "# my answer to 0.2 (the reference's code):"


def reference_code(exercise_id: str) -> str:
    """The reference's code for one exercise of solutions/memory.py, dedented (the learner's right answer)."""
    source = (ROOT / "solutions" / "memory.py").read_text()
    found = re.search(rf"# BEGIN SOLUTION {re.escape(exercise_id)}\n(.*?)\n\s*# END SOLUTION", source, flags=re.S)
    assert found, f"no region {exercise_id} in solutions/memory.py"
    return textwrap.dedent(found[1])


def answer(text: str, exercise_id: str, code: str) -> str:
    """The learner's edit: the TODO and the raise of one exercise replaced by `code`."""
    stub = re.compile(
        rf"(?P<indent>[ ]*)# TODO: Exercise {re.escape(exercise_id)}:[^\n]*\n\s*raise NotImplementedError\((?:[^()]|\([^()]*\))*\)\n"
    )
    found = stub.search(text)
    assert found, f"no stub of exercise {exercise_id} in the file"
    return text[: found.start()] + textwrap.indent(code.rstrip("\n") + "\n", found["indent"]) + text[found.end() :]


def learner_env(**extra: str) -> dict[str, str]:
    """The learner's environment: no reference switch, no network."""
    env = {k: v for k, v in os.environ.items() if k != "KVCOURSE_SOLUTIONS"}
    return env | {"HF_HUB_OFFLINE": "1"} | extra


def run(clone: Path, *command: str, **extra: str) -> subprocess.CompletedProcess:
    """A command in the clone, as the learner would type it."""
    return subprocess.run(command, cwd=clone, env=learner_env(**extra), capture_output=True, text=True, timeout=600)


def python(clone: Path, script: str, **extra: str) -> subprocess.CompletedProcess:
    """A Python script in the clone (a notebook's kernel, say): it imports the clone's kvcourse."""
    return run(clone, sys.executable, "-c", textwrap.dedent(script), **extra)


@pytest.fixture()
def clone(tmp_path: Path) -> Path:
    """A copy of this working tree with fresh stubs, committed in its own repository, then 0.1 and 0.2 written."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    target = tmp_path / "kvcourse-clone"
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file() and not name.startswith("notebooks/"):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    for solution in sorted((ROOT / "solutions").glob("[!_]*.py")):  # the stubs as shipped, whatever is edited here
        (target / "kvcourse" / solution.name).write_text(stub_for(solution)[0])
    git = ["git", "-c", "user.name=learner", "-c", "user.email=learner@example.com"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the course as cloned"]):
        subprocess.run([*git, *step], cwd=target, check=True, capture_output=True)
    memory = target / "kvcourse" / "memory.py"
    right = f"{RIGHT_0_2}\n{reference_code('0.2')}"
    memory.write_text(answer(answer(memory.read_text(), "0.1", WRONG_0_1), "0.2", right))
    return target


def memory_file(clone: Path) -> str:
    return (clone / "kvcourse" / "memory.py").read_text()


# ---- the region logic, in-process ---------------------------------------------------------------


def _learner_version(module: str) -> str:
    """A learner who wrote every exercise of a module exactly as the reference (markers gone)."""
    lines = (ROOT / "solutions" / f"{module}.py").read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not (BEGIN.match(line) or END.match(line)))


@pytest.mark.parametrize("module", ["memory", "kv_cache", "attention", "model_runner"])
def test_each_region_is_found_and_restored_alone(module: str) -> None:
    stub, regions = stub_for(ROOT / "solutions" / f"{module}.py")
    learner = _learner_version(module) + "\n\ndef my_helper():\n    return 1\n"
    ids = edited_exercises(learner, stub, regions)
    assert ids == list(dict.fromkeys(r.exercise for r in regions)), "every written exercise is named"
    for exercise_id in ids:
        restored = restore(learner, stub, regions, {exercise_id})
        compile(restored, module, "exec")
        assert edited_exercises(restored, stub, regions) == [e for e in ids if e != exercise_id]
        assert "def my_helper" in restored, "a learner's helper outside the regions is kept"
    assert edited_exercises(stub, stub, regions) == []


def test_an_older_stub_wording_is_not_a_learners_work() -> None:
    stub, regions = stub_for(ROOT / "solutions" / "memory.py")
    older = stub.replace("not written yet: edit kvcourse/memory.py", "write me in kvcourse/memory.py")
    assert older != stub
    assert edited_exercises(older, stub, regions) == [], "a maintainer's stale stub may be regenerated"


# ---- the commands, on a clone -------------------------------------------------------------------


def test_stubs_command_refuses_to_overwrite_and_check_stays_green(clone: Path) -> None:
    before = memory_file(clone)
    done = run(clone, sys.executable, "-m", "kvcourse", "stubs")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "kvcourse/memory.py" in done.stdout and "0.1, 0.2" in done.stdout, done.stdout
    assert memory_file(clone) == before
    checked = run(clone, sys.executable, "-m", "kvcourse", "stubs", "--check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert memory_file(clone) == before


def test_drift_check_is_green_for_a_learner_who_committed_their_work(clone: Path) -> None:
    git = ["git", "-c", "user.name=learner", "-c", "user.email=learner@example.com"]
    subprocess.run([*git, "commit", "-qam", "my answers"], cwd=clone, check=True, capture_output=True)
    checked = run(clone, sys.executable, "-m", "kvcourse", "stubs", "--check")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_drift_check_still_catches_a_stale_stub(clone: Path) -> None:
    solution = clone / "solutions" / "memory.py"
    solution.write_text(solution.read_text().replace("def max_sequences(", "def max_whole_sequences("))
    checked = run(clone, sys.executable, "-m", "kvcourse", "stubs", "--check")
    assert checked.returncode == 1 and "kvcourse/memory.py" in checked.stdout, checked.stdout + checked.stderr


def test_force_replaces_only_after_a_timestamped_copy(clone: Path) -> None:
    before = memory_file(clone)
    done = run(clone, sys.executable, "-m", "kvcourse", "stubs", "--force")
    assert done.returncode == 0, done.stdout + done.stderr
    copies = list((clone / "backups").glob("memory.py.*.bak"))
    assert len(copies) == 1 and copies[0].read_text() == before
    assert re.fullmatch(r"memory\.py\.\d{8}-\d{6}\.bak", copies[0].name)
    assert "NotImplementedError" in memory_file(clone) and WRONG_0_1 not in memory_file(clone)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(copies[0])], cwd=clone)
    assert ignored.returncode == 0, "backups/ must be ignored by git"


def _fake_venv(tmp_path: Path) -> Path:
    """A venv for ./course whose pip does nothing and whose python is this one (no install in a test)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 0\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return venv


def test_course_reset_restores_one_exercise_with_a_backup(clone: Path, tmp_path: Path) -> None:
    before = memory_file(clone)
    course = {"KVCOURSE_VENV": str(_fake_venv(tmp_path)), "PYTHON": sys.executable}
    done = run(clone, "bash", "course", "reset", "0.2", **course)
    assert done.returncode == 0, done.stdout + done.stderr
    after = memory_file(clone)
    assert WRONG_0_1 in after, "exercise 0.1 is untouched"
    assert RIGHT_0_2 not in after and 'NotImplementedError(\n        "Exercise 0.2' in after
    copies = list((clone / "backups").glob("memory.py.*.bak"))
    assert [c.read_text() for c in copies] == [before]
    again = run(clone, "bash", "course", "reset", "0.2", **course)
    assert again.returncode == 0 and "nothing changed" in again.stdout
    assert memory_file(clone) == after
    bad = run(clone, "bash", "course", "reset", "9.9", **course)
    assert bad.returncode == 2 and "No exercise '9.9'" in bad.stderr


def test_reset_from_a_notebook(clone: Path) -> None:
    done = python(clone, "from kvcourse import reset; reset('0.1')")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Exercise 0.1 (KV bytes per token) is back to its stub" in done.stdout
    assert "Your other exercises (0.2) are untouched" in done.stdout
    after = memory_file(clone)
    assert WRONG_0_1 not in after and RIGHT_0_2 in after


@pytest.mark.slow  # imports torch in a fresh process or two
def test_grade_command_grades_the_learners_file_and_leaves_it(clone: Path, tmp_path: Path) -> None:
    before = memory_file(clone)
    course = {"KVCOURSE_VENV": str(_fake_venv(tmp_path)), "PYTHON": sys.executable}
    done = run(clone, "bash", "course", "grade", "--json", "0.1", "0.2", **course)
    assert memory_file(clone) == before
    results = {r["id"]: r["status"] for r in json.loads(done.stdout.splitlines()[-1])["results"]}
    assert results == {"0.1": "incorrect", "0.2": "correct"}, done.stdout[-2000:]


@pytest.mark.slow  # imports torch in a fresh process or two
def test_study_then_check_in_one_kernel(clone: Path) -> None:
    """Notebook 06's situation: a study runs in the kernel, then check() must still grade the learner's files."""
    before = memory_file(clone)
    done = python(
        clone,
        """
        import os
        from kvcourse import check, hint, progress, solution
        from kvcourse.bench import waste
        small = dict(quick=True, num_requests=30, capacity=4096, block_sizes=(16,))
        try:
            waste.run(**small)
            print("STUDY RAN THE LEARNER'S STUB")
        except NotImplementedError as error:
            print("learner's study stopped:", str(error)[:40])
        result = waste.run(**small, reference=True)
        print("reference study:", result["code"])
        print("switch after studies:", os.environ.get("KVCOURSE_SOLUTIONS"))
        check("0.1")
        check("0.2")
        hint("0.1")
        solution("0.1")
        print(repr(progress("0.1", "0.2")))
        """,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    assert "learner's study stopped: Exercise 3." in out, out
    assert "reference study: the reference (solutions/kv_cache.py)" in out
    assert "switch after studies: None" in out
    assert "Exercise 0.1 (KV bytes per token): not yet" in out, out
    assert re.search(r"Exercise 0\.2 \([^)]*\): correct", out) and "graded on the reference" not in out, out
    assert re.search(r"0\.1 .* incorrect\n0\.2 .* correct\n1 of 2 exercises correct", out), out
    assert memory_file(clone) == before


@pytest.mark.slow  # imports torch in a fresh process or two
def test_check_survives_a_crash_and_stops_a_hang(clone: Path) -> None:
    """A segfault or an endless loop in the learner's code ends the check, not the kernel or the worker; a dead worker is replaced."""
    right = reference_code("0.1").strip().replace("\n", "\n    ")  # in place of a line of the function body
    done = python(
        clone,
        f"RIGHT = {right!r}\n"
        + textwrap.dedent(
            """
        import os
        from pathlib import Path
        from kvcourse import check
        from kvcourse.course import feedback
        memory = Path("kvcourse/memory.py")
        good = memory.read_text()
        wrong = "return 0  # my first try at 0.1"
        memory.write_text(good.replace(wrong, "import ctypes; return ctypes.string_at(0)"))
        check("0.1")
        pid = feedback._WORKER.process.pid
        memory.write_text(good.replace(wrong, "while True: pass"))
        check("0.1")
        memory.write_text(good.replace(wrong, RIGHT))
        check("0.1")
        print("same worker:", feedback._WORKER.process.pid == pid)
        os.kill(pid, 9)  # the worker itself dies between two checks: the next one starts a new worker
        check("0.1")
        print("new worker:", feedback._WORKER.process.pid != pid)
        """
        ),
        KVCOURSE_TEST_TIMEOUT_S="3",
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    crash, hang, fixed, restarted = out.split("Running the tests of Exercise 0.1 ...")[1:]
    assert "could not finish" in crash and "signal 11" in crash, crash
    assert "ran for more than 3 s and was stopped" in hang, hang
    assert "correct." in fixed, fixed
    assert "same worker: True" in out
    assert "correct." in restarted and "new worker: True" in out, restarted


def test_no_study_changes_the_environment() -> None:
    """Whose code a study measures is its `reference` argument, never a variable it sets for everyone after it."""
    writes = re.compile(r"environ\s*\[[^\]]*\]\s*=|environ\.(setdefault|update|pop|clear)\(|putenv\(|unsetenv\(")
    for path in sorted((ROOT / "kvcourse" / "bench").glob("*.py")):
        assert not writes.search(path.read_text()), f"{path.name} changes os.environ"

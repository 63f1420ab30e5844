"""The classroom grader's boundary against hostile submissions (tests/grader/attacks/) and honest partial ones.

Every submission goes through gradescope.grade_submission, the function run_autograder runs: the submitted
code runs only in an unprivileged child that reports observations (tests/grader/fake_observer.py stands in
for the lockstep harness), and the parent scores them. Each attack must score 0 and leave no process of the
child's user and no file in the temporary folders; honest work must score exactly its due.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from kvcourse.course import boundary, grade, gradescope
from tests.grader.support import OBSERVER, python_for_child, why_not_here

ROOT = Path(__file__).resolve().parents[2]
ATTACKS = Path(__file__).resolve().parent / "attacks"
GRADED = ["0.1", "0.2", "5.2"]  # what the fake observer knows
FAST = boundary.Limits(run_s=90, child_s=25)


@pytest.fixture(scope="module")
def child_python() -> str:
    why = why_not_here()
    if why:
        pytest.skip(why)
    python = python_for_child()
    previous = os.environ.get("KVCOURSE_GRADER_PYTHON")
    os.environ["KVCOURSE_GRADER_PYTHON"] = python
    yield python
    if previous is None:
        os.environ.pop("KVCOURSE_GRADER_PYTHON", None)
    else:
        os.environ["KVCOURSE_GRADER_PYTHON"] = previous


@pytest.fixture(scope="module")
def reference(child_python) -> dict:
    """The reference's observations, made once in a trusted process from solutions/."""
    return boundary.reference_observations(GRADED, OBSERVER)


def leftovers(uid: int) -> list[str]:
    """Processes of the child's user and its files in the shared temporary folders."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(f"process {entry.name}")
            except OSError:
                pass
    for folder in boundary.TMP_FOLDERS:
        try:
            with os.scandir(folder) as entries:
                found += [e.path for e in entries if e.stat(follow_symlinks=False).st_uid == uid]
        except OSError:
            pass
    return found


def graded(submission: Path, tmp_path: Path, reference: dict, limits=FAST, ids=GRADED) -> dict[str, dict]:
    """Grade a submission folder through the boundary; {exercise: its results.json test}, nothing left behind."""
    user = boundary.child_user(ROOT)
    before = set(leftovers(user.uid))
    out = tmp_path / "results" / "results.json"
    data = gradescope.grade_submission(
        submission, out, ids, limits, log=lambda _: None, observer=OBSERVER, reference=reference
    )
    assert json.loads(out.read_text()) == data, "results.json is the grader's"
    assert [t["number"] for t in data["tests"]] == ids, "every exercise is listed"
    assert sorted(p.name for p in out.parent.iterdir()) == ["results.json"], "nothing else in the results folder"
    assert set(leftovers(user.uid)) <= before, "the submission left a process or a file behind"
    assert not list(Path("/tmp").glob("kvcourse-attack-*")), "an attack's file survived"
    assert not list(Path(tempfile.gettempdir()).glob("kvcourse-boundary-*")), "the grader's scratch survived"
    return {t["number"]: t for t in data["tests"]}


def submission_with(tmp_path: Path, **modules: str) -> Path:
    """A submission folder holding these module texts under kvcourse/."""
    folder = tmp_path / "submission" / "kvcourse"
    folder.mkdir(parents=True)
    for module, text in modules.items():
        (folder / f"{module}.py").write_text(text)
    return folder.parent


def solution(module: str) -> str:
    return (ROOT / "solutions" / f"{module}.py").read_text()


# Three attacks run in `./course test`; every attack runs in the slow step (`./course test -m slow`, CI runs it).
QUICK_ATTACKS = {"emitter_wrap", "read_answers", "return_none"}


@pytest.mark.parametrize(
    "attack",
    [
        pytest.param(p.name, marks=() if p.name in QUICK_ATTACKS else pytest.mark.slow)
        for p in sorted(ATTACKS.iterdir())
        if p.is_dir()
    ],
)
def test_every_attack_scores_zero_and_leaves_nothing(attack, tmp_path, reference):
    limits = boundary.Limits(run_s=60, child_s=10) if attack == "sleep_forever" else FAST
    ids = ["5.2"] if (ATTACKS / attack / "kvcourse" / "attention.py").exists() else ["0.1", "0.2"]  # its own only
    tests = graded(ATTACKS / attack, tmp_path, reference, limits, ids)
    assert {number: test["score"] for number, test in tests.items()} == dict.fromkeys(ids, 0.0), tests
    if attack == "fast_backend":
        assert "kvcourse.backends.fast" in tests["5.2"]["output"], tests["5.2"]["output"]


def test_the_reference_gets_full_marks(tmp_path, reference):
    tests = graded(submission_with(tmp_path, memory=solution("memory"), attention=solution("attention")), tmp_path, reference)  # fmt: skip
    assert {n: t["score"] for n, t in tests.items()} == dict.fromkeys(GRADED, 1.0), tests


def test_one_exercise_of_two_written_scores_exactly_one(tmp_path, reference):
    half = solution("memory").split("def max_sequences")[0] + (
        "def max_sequences(memory_bytes: int, seq_len: int, bytes_per_token: int) -> int:\n"
        '    raise NotImplementedError("Exercise 0.2 (Sequences that fit in a memory budget): not written yet")\n'
    )
    tests = graded(submission_with(tmp_path, memory=half), tmp_path, reference)
    assert {n: t["score"] for n, t in tests.items()} == {"0.1": 1.0, "0.2": 0.0, "5.2": 0.0}, tests


@pytest.mark.slow
def test_a_good_module_beside_one_that_crashes_the_reporting(tmp_path, reference):
    crash = (ATTACKS / "deep_json" / "kvcourse" / "memory.py").read_text().split("\n\ndef kv_bytes")[0]
    crash += "\nimport os\nos._exit(0)\n"
    tests = graded(submission_with(tmp_path, memory=solution("memory"), attention=crash), tmp_path, reference)
    assert {n: t["score"] for n, t in tests.items()} == {"0.1": 1.0, "0.2": 1.0, "5.2": 0.0}, tests


@pytest.mark.slow
def test_a_good_module_beside_deep_folders_odd_names_and_huge_files(tmp_path, reference):
    submission = submission_with(tmp_path, memory=solution("memory"))
    deep = submission / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(1500):  # 1,500 nested folders, made relative to each other (no path is that long)
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    (submission / "odd\nname.py").write_text("x = 1\n")
    (submission / os.fsdecode(b"bad-\xff-name.py")).write_text("x = 1\n")
    (submission / "kvcourse" / "step.py").write_bytes(b"#" * (gradescope.MAX_MODULE_BYTES + 1))
    try:
        tests = graded(submission, tmp_path, reference)
        assert {n: t["score"] for n, t in tests.items()} == {"0.1": 1.0, "0.2": 1.0, "5.2": 0.0}, tests
    finally:
        boundary.remove(deep)


def test_the_learner_routes_gradescope_file_comes_from_the_boundary(tmp_path, reference, monkeypatch):
    """`python -m kvcourse grade --gradescope F` grades kvcourse/ through the boundary, not in its own process."""
    course = tmp_path / "course"
    (course / "kvcourse").mkdir(parents=True)
    for module in gradescope.pristine_stubs(ROOT):
        shutil.copy(ATTACKS / "atexit_payload" / "kvcourse" / "memory.py", course / "kvcourse" / f"{module}.py")
    monkeypatch.setattr(grade, "ROOT", course)
    monkeypatch.setattr(boundary, "DEFAULT_OBSERVER", OBSERVER)
    out = tmp_path / "results.json"
    before = set(sys.modules)
    assert grade.main([*GRADED, "--gradescope", str(out)]) == 1
    assert not [m for m in set(sys.modules) - before if m.startswith("kvcourse.memory")], "it imported the module"
    assert json.loads(out.read_text())["score"] == 0


def test_no_root_or_no_readable_interpreter_means_refusal(tmp_path, child_python, monkeypatch):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python").symlink_to(child_python)
    with pytest.raises(boundary.Refused, match="cannot run"):
        boundary.child_user(ROOT, str(private / "python"))
    monkeypatch.setattr(boundary, "_CHECKED", {})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = tmp_path / "results.json"
    with pytest.raises(gradescope.GraderBroken, match="must run as root"):
        gradescope.grade_submission(submission_with(tmp_path, memory=solution("memory")), out, GRADED,
                                    observer=OBSERVER, reference={}, log=lambda _: None)  # fmt: skip
    data = json.loads(out.read_text())
    assert data["score"] == 0 and "refused" in data["output"] and len(data["tests"]) == len(GRADED)


def test_the_child_user_cannot_read_what_the_grader_protects(child_python):
    boundary.protect(ROOT, log=lambda _: None)
    user = boundary.child_user(ROOT)
    assert pwd.getpwuid(user.uid).pw_name in boundary.USERS
    for name in ("solutions", "tests", "scripts", "notebooks", "kvcourse/memory.py"):
        assert (ROOT / name).stat().st_mode & 0o077 == 0, f"{name} is readable by others"
    assert (ROOT / "kvcourse").stat().st_mode & 0o005 == 0o005, "the child imports the given code from kvcourse/"


def test_the_child_is_another_user_in_its_own_session_under_limits_it_cannot_raise(tmp_path, child_python):
    """What the child sees of itself, through an observer that reports it (no torch, no submitted module)."""
    observer = tmp_path / "whoami.py"
    observer.write_text(
        "import os, resource\n"
        "def observe(exercise_id, seed, modules, size='small'):\n"
        "    limits = {n: resource.getrlimit(getattr(resource, n)) for n in ('RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE')}\n"
        "    try:\n"
        "        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "        raised = True\n"
        "    except (ValueError, OSError):\n"
        "        raised = False\n"
        "    return [{'uid': os.getuid(), 'groups': os.getgroups(), 'session': os.getsid(0) == os.getpid(),\n"
        "             'limits': limits, 'raised': raised, 'cwd_mode': oct(os.stat('.').st_mode & 0o777)}]\n"
    )  # fmt: skip
    user = boundary.child_user(ROOT)
    limits = boundary.Limits(memory_bytes=3 << 30)
    job = boundary.Job({"0.1": [0]}, {}, str(observer))
    scratch = Path(tempfile.mkdtemp())
    scratch.chmod(0o711)
    try:
        report = boundary.run_child(job, user, limits, 60, scratch)
    finally:
        boundary.remove(scratch)
    seen = report.records[("0.1", 0)]["observations"][0]
    assert (seen["uid"], seen["groups"], seen["session"], seen["raised"]) == (user.uid, [], True, False), seen
    assert seen["limits"]["RLIMIT_AS"] == [3 << 30, 3 << 30] and seen["limits"]["RLIMIT_NPROC"][1] == limits.processes
    assert seen["cwd_mode"] == "0o700"

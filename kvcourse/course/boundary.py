"""The classroom grader's trust boundary: submitted code only ever produces observations, never a verdict.

    parent (root, this module)                     child (unprivileged user, kvcourse/course/boundary_child.py)
    ------------------------------------------     --------------------------------------------------------------
    reads the submission as text, never imports it
    seeds_for(id, size) for every exercise ---->   imports the submitted module, observe(id, seed, modules, size)
    reads at most `report_bytes`, until a   <----  one JSON line per (exercise, seed): plain data only
    deadline; depth- and size-bounded parsing;
    a schema per record; compare(id, seed,
    reference, got) for every seed; scores

The reference's observations are made in a trusted process from solutions/ (or shipped, private, in the
autograder's grader/reference.json). An exercise scores its points only when every one of its seeds matches
the reference (all or nothing: a submission that returns a constant cannot collect the seeds where the
constant happens to be right). A child that hangs, crashes, lies or floods its pipe loses the exercises it
did not report properly, nothing more. The child runs as `kvgrader` (or `nobody`) with CPU, memory, file
size and process limits, in a session and a folder of its own; everything it leaves (processes of its
user, its files in /tmp) is removed. Where that is impossible (not root, or the user cannot run the
interpreter) `Refused` says why: submitted code never runs as the grader.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import resource
import select
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import import_module
from pathlib import Path

from kvcourse.course.exercises import EXERCISE_MODULES, EXERCISES, Exercise
from kvcourse.course.results import CORRECT, INCORRECT, NOT_ATTEMPTED, ExerciseResult, id_key, untouched

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OBSERVER = os.environ.get("KVCOURSE_OBSERVER", "kvcourse.course.lockstep")
USERS = ("kvgrader", "nobody")  # the first that exists runs the submitted code
PUBLIC = ("kvcourse",)  # the only folder of the course the child reads (its exercise modules excepted)
# Course modules that are the answer to an exercise: replaced, in that exercise's child, by one that refuses.
REFUSED_MODULES = {"5.2": ("kvcourse.backends.fast",), "5.3": ("kvcourse.backends.fast",)}
TMP_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # where a child could leave files behind


class Refused(RuntimeError):
    """The classroom grader will not run submitted code here (and says why): it would not be confined."""


@dataclass(frozen=True)
class Limits:
    """What one grading run allows the submitted code; every figure is enforced by the parent or the kernel."""

    run_s: float = float(os.environ.get("KVCOURSE_GRADE_TIMEOUT_S", "540"))  # the whole run
    child_s: float = float(os.environ.get("KVCOURSE_CHILD_TIMEOUT_S", "120"))  # one child, at most
    memory_bytes: int = int(os.environ.get("KVCOURSE_MEMORY_BYTES", str(6 << 30)))  # address space (torch maps ~1 GiB)
    file_bytes: int = 16 << 20  # the largest file a child may write
    processes: int = 64  # processes and threads of the child's user
    report_bytes: int = 64 << 20  # what the parent reads from one child (kv_cache's 10 exercises: ~8 MB today)
    line_bytes: int = 8 << 20  # one record (one exercise, one seed: 0.6 MB at most today)
    depth: int = 64  # nesting of one record


# ----------------------------------------------------------------------------------------------------------
# Reading what a child says: bounded, depth-checked, one schema.


def _too_deep(line: bytes, limit: int) -> bool:
    """True when the JSON text nests deeper than `limit` (brackets inside strings do not count)."""
    if line.count(b"[") + line.count(b"{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def _constant(name: str) -> str:
    """NaN and Infinity become strings, the same on both sides: no float trick survives a comparison."""
    return name


def parse_record(line: bytes, limits: Limits) -> dict | None:
    """One line as a dict, or None when it is too long, too deep, not JSON or not an object."""
    if len(line) > limits.line_bytes or _too_deep(line, limits.depth):
        return None
    try:
        value = json.loads(line, parse_constant=_constant)
    except (ValueError, RecursionError):  # a huge integer is a ValueError too
        return None
    return value if isinstance(value, dict) else None


def valid(record: dict, seeds: dict[str, list[int]]) -> bool:
    """A record of an exercise this child was asked about, with a seed it was given and plain observations."""
    exercise, seed = record.get("exercise"), record.get("seed")
    if not isinstance(exercise, str) or exercise not in seeds or type(seed) is not int or seed not in seeds[exercise]:
        return False
    if "observations" in record:
        got = record["observations"]
        return isinstance(got, list) and all(isinstance(item, dict) for item in got) and "error" not in record
    return isinstance(record.get("error"), str)


@dataclass
class ChildReport:
    """What one child said that passed the schema, and how it ended (\"\" when it said it was done)."""

    records: dict[tuple[str, int], dict] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    ending: str = ""
    fatal: str = ""  # the child's own words on why it could not observe at all (the grader's problem, or not)


def read_child(fd: int, seeds: dict[str, list[int]], limits: Limits, deadline: float) -> ChildReport:
    """Read one child's records until it ends, floods, or its deadline passes; never more than the limits."""
    report, buffer, total = ChildReport(), b"", 0
    while True:
        left = deadline - time.monotonic()
        ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
        if not ready:
            report.ending = "it did not finish in its time (an endless loop, a sleep, or just too slow?)"
            return report
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            report.ending = report.ending or "it stopped before reporting every seed (a crash, or os._exit?)"
            return report
        total += len(chunk)
        if total > limits.report_bytes:
            report.ending = f"it wrote more than {limits.report_bytes >> 20} MB and was stopped"
            return report
        buffer += chunk
        if b"\n" not in buffer:
            if len(buffer) > limits.line_bytes:
                report.ending = "it wrote a line longer than any report and was stopped"
                return report
            continue
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            record = parse_record(line, limits)
            if record is None:
                continue
            if record.get("end") is True:
                report.ending = ""
                return report
            if isinstance(record.get("fatal"), str):
                report.fatal = record["fatal"][:2000]
            elif isinstance(record.get("start"), str) and record["start"] in seeds:
                report.started.append(record["start"])
            elif valid(record, seeds):
                report.records.setdefault((record["exercise"], record["seed"]), record)  # the first one counts


# ----------------------------------------------------------------------------------------------------------
# Who the child is, and what it may read.


@dataclass(frozen=True)
class ChildUser:
    """The unprivileged user and the interpreter it runs."""

    uid: int
    gid: int
    name: str
    python: str
    path: list[str]  # the child's sys.path: the course, then the interpreter's packages


def _site_paths() -> list[str]:
    """The folders this interpreter imports packages from (the child reads torch from there too)."""
    paths = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    return list(dict.fromkeys(p for p in paths if Path(p).is_dir()))


_CHECKED: dict[tuple, ChildUser] = {}  # the probe (an import of torch as the user) runs once per process


def child_user(course: Path = ROOT, python: str | None = None) -> ChildUser:
    """The user to run submitted code as, checked to be able to run the interpreter; else Refused, with why."""
    python = python or os.environ.get("KVCOURSE_GRADER_PYTHON") or sys.executable
    key = (str(course), python, os.geteuid())
    if key not in _CHECKED:
        _CHECKED[key] = _check_user(course, python)
    return _CHECKED[key]


def _check_user(course: Path, python: str) -> ChildUser:
    """Find the user and run the probe (see child_user)."""
    if os.geteuid() != 0:
        raise Refused(
            "the classroom grader must run as root, to run submitted code as an unprivileged user (it refuses to "
            "run it as yourself). Run it as root (Gradescope does), or use `python -m kvcourse grade` for your own work."
        )
    for name in USERS:
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            break
    else:
        raise Refused(
            f"no unprivileged user ({' or '.join(USERS)}) exists: create one with `useradd --system kvgrader`."
        )
    user = ChildUser(entry.pw_uid, entry.pw_gid, name, python, [str(course), *_site_paths()])
    probe = "import torch, kvcourse.course.boundary_child; print('ok')"
    try:
        done = subprocess.run(
            _command(user, probe), env=_env(Path("/")), capture_output=True, timeout=180, check=False,
            user=user.uid, group=user.gid, extra_groups=[], cwd="/",
        )  # fmt: skip
        said = done.stdout.decode(errors="replace").strip()
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
    except (OSError, subprocess.SubprocessError) as error:
        said, why = "", [str(error)]
    if said != "ok":
        raise Refused(
            f"the unprivileged user {name} cannot run {python} with torch and the course ({why[0]}): make the "
            "interpreter, its packages and the course readable to it (setup.sh does `chmod -R a+rX`), or set "
            "KVCOURSE_GRADER_PYTHON to a Python of the same version it can run. Submitted code never runs as root."
        )
    return user


def _command(user: ChildUser, code: str) -> list[str]:
    """`python -I -c`: no environment variable, no user site, no current folder on the path; ours only."""
    return [user.python, "-I", "-c", f"import sys; sys.path[:0] = {user.path!r}; {code}"]


def _env(work: Path) -> dict[str, str]:
    """The child's whole environment: nothing of the grader's."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "LANG": "C.UTF-8",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRITON_INTERPRET": "1",  # 5.4's kernel runs on the observer's CPU tensors, in Triton's interpreter
    }


def protect(course: Path, log: Callable[[str], None] = print) -> None:
    """Make every folder of the course but kvcourse/ (and the interpreter's) private to its owner (0700).

    The reference (solutions/), the tests, the grader's files (grader/), git's history (.git), the scripts
    whose mutants quote the reference: the child reads none of them. The exercise modules lying in
    kvcourse/ (stubs, or an instructor's own work) become 0600: the child gets its own copies.
    """
    needed = [Path(p).resolve() for p in (sys.prefix, *_site_paths())]
    hidden = []
    for entry in sorted(course.iterdir()):
        if entry.is_symlink() or not entry.is_dir() or entry.name in PUBLIC:
            continue
        if any(entry.resolve() in (p, *p.parents) for p in needed):
            continue  # the interpreter or its packages live here (a .venv in the clone)
        if stat.S_IMODE(entry.stat().st_mode) & 0o077:
            entry.chmod(0o700)
            hidden.append(entry.name)
    for module in sorted(EXERCISE_MODULES):
        path = course / "kvcourse" / f"{module}.py"
        if path.is_file() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)
            hidden.append(f"kvcourse/{module}.py")
    if hidden:
        log(f"made private (owner only), so that submitted code cannot read them: {', '.join(hidden)}.")


def _limit_child(limits: Limits, cpu_s: int) -> Callable[[], None]:
    """Run in the child between fork and exec, after it became the unprivileged user: the hard limits."""

    def apply() -> None:
        for limit, value in [
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_CPU, cpu_s),
            (resource.RLIMIT_FSIZE, limits.file_bytes),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NOFILE, 256),
            (resource.RLIMIT_NPROC, limits.processes),
        ]:
            resource.setrlimit(limit, (value, value))

    return apply


def kill_user(uid: int) -> int:
    """Kill every process of `uid` (a forked daemon left its session, not its user) until none is left."""
    killed = 0
    for _ in range(100):
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == uid:
                        found.append(int(entry.name))
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not found:
            return killed
        killed += len(found)
        time.sleep(0.02)
    return killed


def remove(path: Path) -> None:
    """Remove a file or a folder, however deep (rmtree recurses; `rm -rf` does not)."""
    if path.is_dir() and not path.is_symlink():
        try:
            shutil.rmtree(path)
        except (OSError, RecursionError):
            subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False, timeout=300)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def remove_user_files(uid: int, since: float, folders=TMP_FOLDERS) -> list[str]:
    """Remove what `uid` made since `since` (a time.time()) in the shared temporary folders and the
    world-writable folders inside them (/tmp/.X11-unix, say), three levels down at most."""
    removed = []
    stack = [(Path(folder), 0) for folder in folders]
    while stack:
        folder, depth = stack.pop()
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in list(entries):
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if info.st_uid == uid and info.st_ctime >= since - 1:
                        remove(Path(entry.path))
                        removed.append(entry.path)
                    elif stat.S_ISDIR(info.st_mode) and info.st_mode & 0o002 and depth < 3:
                        stack.append((Path(entry.path), depth + 1))
    return removed


# ----------------------------------------------------------------------------------------------------------
# One child.


@dataclass(frozen=True)
class Job:
    """What one child observes: exercises with their seeds, the submitted module texts, the observer."""

    exercises: dict[str, list[int]]
    modules: dict[str, str]  # every exercise module's text (submitted, else its stub)
    observer: str  # a module name, or the path of an observer .py file (copied for the child)
    size: str = "small"


def run_child(
    job: Job, user: ChildUser, limits: Limits, wall_s: float, scratch: Path, confined: bool = True
) -> ChildReport:
    """Run one child on `job` as `user` (confined: False only for the trusted reference) and read its records."""
    work = Path(tempfile.mkdtemp(prefix="child-", dir=scratch))
    folder = work / "modules"
    folder.mkdir()
    for module, text in job.modules.items():
        (folder / f"{module}.py").write_text(text)
    observer = job.observer
    if observer.endswith(".py"):
        shutil.copyfile(observer, work / "observer.py")
        observer = str(work / "observer.py")
    refuse = {name: ex for ex in job.exercises for name in REFUSED_MODULES.get(ex, ())} if confined else {}
    request = {
        "folder": str(folder),
        "modules": sorted(job.modules),
        "observer": observer,
        "exercises": [{"id": ex, "seeds": seeds} for ex, seeds in job.exercises.items()],
        "size": job.size,
        "refuse": refuse,
    }
    if confined:
        for path in [work, *work.rglob("*")]:
            os.chown(path, user.uid, user.gid)
    os.chmod(work, 0o700)
    started = time.monotonic()
    as_user = {"user": user.uid, "group": user.gid, "extra_groups": []} if confined else {}
    process = subprocess.Popen(
        _command(user, "import kvcourse.course.boundary_child as c; c.main()"),
        cwd=work, env=_env(work), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True, preexec_fn=_limit_child(limits, int(wall_s) + 5) if confined else None, **as_user,
    )  # fmt: skip
    try:
        with contextlib.suppress(OSError):
            process.stdin.write((json.dumps(request) + "\n").encode())
            process.stdin.close()
        return read_child(process.stdout.fileno(), job.exercises, limits, started + wall_s)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        if confined:
            kill_user(user.uid)
        process.stdout.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        remove(work)


# ----------------------------------------------------------------------------------------------------------
# The reference's observations, and the comparison.


def observer_api(observer: str):
    """The observer module in this (trusted) process, for seeds_for and compare: never for submitted code."""
    if observer.endswith(".py"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("kvcourse_grader_observer", observer)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
        return module
    return import_module(observer)


def reference_observations(
    exercise_ids: list[str], observer: str, size: str = "small", course: Path = ROOT, limits: Limits | None = None
) -> dict[str, dict[int, list[dict]]]:
    """{exercise: {seed: observations}} of the reference, from solutions/ in a trusted process (the grader's user)."""
    limits = limits or Limits()
    api = observer_api(observer)
    seeds = {ex: list(api.seeds_for(ex, size)) for ex in exercise_ids}
    modules = {m: (course / "solutions" / f"{m}.py").read_text() for m in sorted(EXERCISE_MODULES)}
    scratch = Path(tempfile.mkdtemp(prefix="kvcourse-reference-"))
    try:
        trusted = ChildUser(os.geteuid(), os.getegid(), "grader", sys.executable, [str(course), *_site_paths()])
        whole_course = replace(limits, report_bytes=limits.report_bytes * len(EXERCISE_MODULES))  # trusted: all at once
        report = run_child(
            Job(seeds, modules, observer, size), trusted, whole_course, limits.run_s, scratch, confined=False
        )
    finally:
        remove(scratch)
    out: dict[str, dict[int, list[dict]]] = {}
    for ex, ex_seeds in seeds.items():
        for seed in ex_seeds:
            record = report.records.get((ex, seed))
            if record is None or "observations" not in record:
                why = record.get("error") if record else report.fatal or report.ending or "no record"
                raise RuntimeError(f"the reference could not be observed on {ex}, seed {seed}: {why}")
            if hasattr(api, "usable_reference"):  # the lockstep harness: a reference that only raises grades nothing
                api.usable_reference(ex, seed, record["observations"])
            out.setdefault(ex, {})[seed] = record["observations"]
    return out


def save_reference(path: Path, reference: dict[str, dict[int, list[dict]]], observer: str, size: str) -> None:
    """Write the reference's observations for an autograder (the caller keeps the file private)."""
    data = {"observer": observer, "size": size, "exercises": {ex: {str(s): o for s, o in seeds.items()} for ex, seeds in reference.items()}}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, allow_nan=True))
    path.chmod(0o600)


def load_reference(path: Path) -> tuple[dict[str, dict[int, list[dict]]], str, str]:
    """(observations, observer, size) from save_reference's file, parsed as a child's records are."""
    data = json.loads(path.read_text(), parse_constant=_constant)
    reference = {ex: {int(s): o for s, o in seeds.items()} for ex, seeds in data["exercises"].items()}
    return reference, data["observer"], data["size"]


def _divergence(api, exercise_id: str, seed: int, expected: list[dict], record: dict | None) -> str | None:
    """None when the seed matches the reference; else what differed, in words (never the expected value)."""
    if record is None:
        return "no observation was reported for it"
    if "error" in record:
        return f"your code raised {record['error']}"
    try:
        found = api.compare(exercise_id, seed, expected, record["observations"])
    except Exception as error:  # malformed observations are the submission's loss
        return f"its observations could not be compared ({type(error).__name__})"
    if found is None:
        return None
    return str(getattr(found, "message", found))[:1000]


def score(
    exercise: Exercise, seeds: list[int], expected: dict[int, list[dict]], report: ChildReport, api,
    text: str | None, stub: str | None, ending: str,
) -> ExerciseResult:  # fmt: skip
    """The exercise's row: correct only when every seed matches (all or nothing), else the first divergence."""
    result = ExerciseResult(exercise.id, exercise.title, exercise.path, total=len(seeds), all_or_nothing=True)
    result.unit = "seeds match"
    if not seeds:
        result.status, result.message = INCORRECT, "the grader has no observations for this exercise (ask your instructor)."  # fmt: skip
        return result
    first = None
    for seed in seeds:
        why = _divergence(api, exercise.id, seed, expected.get(seed, []), report.records.get((exercise.id, seed)))
        if why is None:
            result.passed += 1
        elif first is None:
            first = (seed, why)
    if first is None:
        result.status = CORRECT
        return result
    refused = [r["error"] for r in report.records.values() if r.get("exercise") == exercise.id and "CourseAnswerRefused" in r.get("error", "")]  # fmt: skip
    if untouched(exercise, text, stub) and not refused:
        result.status, result.message = (
            NOT_ATTEMPTED,
            f"{exercise.path} still raises NotImplementedError under its TODO.",
        )
        return result
    result.status = INCORRECT
    seed, why = first
    if refused:
        result.message = refused[0]
    elif "no observation" in why and ending:
        result.message = f"seed {seed}: the process running your code reported nothing for it: {ending}."
    else:
        result.message = f"seed {seed}: {why}"
        result.hint = exercise.hint
    return result


# ----------------------------------------------------------------------------------------------------------
# A whole submission.


@dataclass
class Grading:
    """One submission's grading, one child per group of exercises, retried one by one after a bad end."""

    exercises: list[Exercise]
    modules: dict[str, str]
    stubs: dict[str, str]
    observer: str
    reference: dict[str, dict[int, list[dict]]]
    size: str
    limits: Limits
    user: ChildUser
    log: Callable[[str], None] = print
    results: dict[str, ExerciseResult] = field(default_factory=dict)

    def groups(self) -> list[list[Exercise]]:
        """One group per exercise module; an exercise graded without a course module gets a child of its own."""
        groups: dict[str, list[Exercise]] = {}
        for ex in sorted(self.exercises, key=lambda e: id_key(e.id)):
            groups.setdefault(ex.id if ex.id in REFUSED_MODULES else ex.module, []).append(ex)
        return list(groups.values())

    def run(self, api, scratch: Path) -> list[ExerciseResult]:
        """Every exercise's row, within the run's time, whatever the children do."""
        deadline = time.monotonic() + self.limits.run_s
        pending = self.groups()
        while pending:
            group = pending.pop(0)
            left = deadline - time.monotonic()
            todo = sum(len(g) for g in [group, *pending])
            wall = min(left, self.limits.child_s, max(20.0, left * len(group) / todo))
            if wall < 5:
                self._charge(group, ReportEnd("the whole grading run's time limit ran out"), api)
                continue
            seeds = {ex.id: sorted(self.reference.get(ex.id, {})) for ex in group}
            job = Job(seeds, self.modules, self.observer, self.size)
            report = run_child(job, self.user, self.limits, wall, scratch)
            self.log(f"boundary: {', '.join(seeds)}: {report.ending or 'done'}")
            missing = [ex for ex in group if any((ex.id, s) not in report.records for s in seeds[ex.id])]
            if report.ending and len(missing) > 1:
                culprit = report.started[-1] if report.started else None
                again = [ex for ex in missing if ex.id != culprit]
                pending[0:0] = [[ex] for ex in again]  # each in a fresh child: one hang costs only its own
                group = [ex for ex in group if ex not in again]
            for ex in group:
                self.results[ex.id] = self._score(ex, report, api)
        return [self.results[ex.id] for ex in self.exercises]

    def _score(self, ex: Exercise, report: ChildReport, api) -> ExerciseResult:
        expected = self.reference.get(ex.id, {})
        text, stub = self.modules.get(ex.module), self.stubs.get(ex.module)
        return score(ex, sorted(expected), expected, report, api, text, stub, report.ending)

    def _charge(self, group: list[Exercise], end: ReportEnd, api) -> None:
        for ex in group:
            self.results[ex.id] = self._score(ex, ChildReport(ending=end.why), api)


@dataclass(frozen=True)
class ReportEnd:
    """Why a group got no child at all."""

    why: str


def grade(
    submitted: dict[str, str],
    stubs: dict[str, str],
    exercise_ids: list[str] | None = None,
    observer: str = DEFAULT_OBSERVER,
    reference: dict[str, dict[int, list[dict]]] | None = None,
    size: str = "small",
    limits: Limits | None = None,
    course: Path = ROOT,
    log: Callable[[str], None] = print,
) -> tuple[list[ExerciseResult], str]:
    """Grade submitted module texts ({module: text}) through the boundary; (one row per exercise, a note).

    Raises Refused before running anything when the submitted code could not be confined.
    """
    limits = limits or Limits()
    exercises = [EXERCISES[i] for i in exercise_ids] if exercise_ids else list(EXERCISES.values())
    protect(course, log)
    user = child_user(course)
    if reference is None:
        reference = reference_observations([ex.id for ex in exercises], observer, size, course, limits)
    api = observer_api(observer)
    modules = {m: submitted.get(m, stubs[m]) for m in sorted(EXERCISE_MODULES)}
    began = time.time()
    scratch = Path(tempfile.mkdtemp(prefix="kvcourse-boundary-"))
    os.chmod(scratch, 0o711)  # the child enters its own folder inside, and lists nothing
    try:
        grading = Grading(exercises, modules, stubs, observer, reference, size, limits, user, log)
        results = grading.run(api, scratch)
    finally:
        kill_user(user.uid)
        remove(scratch)
        left = remove_user_files(user.uid, began)
        if left:
            log(f"boundary: removed {len(left)} file(s) the submitted code left in the temporary folders.")
    return results, f"the submitted code ran as the unprivileged user {user.name}, one process per exercise module."

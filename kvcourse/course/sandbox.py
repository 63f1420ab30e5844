"""Run submitted code where it cannot touch the grade: child processes, an unprivileged user, limits from outside.

The parent (`grade_course`) never imports a submitted module. It collects the list of graded tests from the
pristine stubs, then starts one child per exercise module (`python -m kvcourse.course.sandbox child ...`),
as an unprivileged user when the grader is root, with its memory, CPU time, file size and process count
capped by setrlimit before the child's first instruction, in a session of its own that the parent kills
(with every process of that user) when it stops reporting. The child streams one JSON line per test over
a pipe; the parent keeps only outcomes of tests it listed itself, counts every listed test (a missing one
is a failure, a skip is a failure unless the test's own marker skipped it), and folds them into results.
A child that crashes, hangs or breaks a rule costs the exercise whose test it was running, and the others
are graded again in a fresh child. CONTRIBUTING.md's "Grader security" says what this does and does not hold.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import pwd
import resource
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

from kvcourse.course.exercises import EXERCISE_MODULES, EXERCISES, Exercise
from kvcourse.course.results import ExerciseResult, TestOutcome, id_key, summarize

VIOLATION_EXIT = 86  # a child's exit code when its guard caught submitted code breaking a rule
MAX_REPORT_BYTES = 8 << 20  # a child that says more than this is not reporting tests


def _default_memory() -> int:
    """A child's address space: three quarters of the machine's memory, between 2 and 8 GiB (torch maps ~1 GiB)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return int(max(2 << 30, min(8 << 30, total * 3 // 4)))


@dataclass(frozen=True)
class Limits:
    """What one grading run allows the submitted code (every figure can be set from the environment)."""

    test_s: float = float(os.environ.get("KVCOURSE_TEST_WALL_S", "60"))  # silence allowed between two tests
    start_s: float = float(os.environ.get("KVCOURSE_START_WALL_S", "240"))  # imports before the first test
    run_s: float = float(os.environ.get("KVCOURSE_GRADE_TIMEOUT_S", "540"))  # the whole run (Gradescope: 10 min)
    memory_bytes: int = (
        int(os.environ.get("KVCOURSE_MEMORY_BYTES", "0")) or _default_memory()
    )  # a child's address space
    file_bytes: int = 64 << 20  # the largest file a child may write
    processes: int = 256  # threads count too (torch, the tests' own)


@dataclass(frozen=True)
class Identity:
    """Who the children run as: an unprivileged uid/gid, or (None) the grader's own user, with why."""

    uid: int | None
    gid: int | None
    name: str
    note: str

    @property
    def isolated(self) -> bool:
        return self.uid is not None


def _readable_by_others(path: Path) -> bool:
    """Every folder above `path` can be entered and `path` read by a user who is neither owner nor group."""
    path = path.resolve()
    for parent in path.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            return False
    return bool(path.stat().st_mode & stat.S_IROTH)


def identity(course: Path) -> Identity:
    """Pick the children's user: `kvgrader` (setup.sh creates it) or `nobody`, when root and when it can run Python."""
    if os.geteuid() != 0:
        return Identity(None, None, pwd.getpwuid(os.geteuid()).pw_name, "not root: the submitted code ran as the grader's own user (grade as root to isolate it).")  # fmt: skip
    for name in ("kvgrader", "nobody"):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            break
    else:
        return Identity(None, None, "root", "no unprivileged user (kvgrader or nobody) exists: the submitted code ran as root.")  # fmt: skip
    import importlib.util

    torch = importlib.util.find_spec("torch")
    needed = [Path(sys.executable), Path(os.__file__), course / "kvcourse" / "__init__.py"]
    needed += [Path(torch.origin)] if torch and torch.origin else []
    blocked = [str(p) for p in needed if not _readable_by_others(p)]
    if blocked:
        return Identity(None, None, "root", f"{name} cannot read {blocked[0]} (a folder above it is private): the submitted code ran as root, with the limits but without a user of its own.")  # fmt: skip
    return Identity(entry.pw_uid, entry.pw_gid, name, f"the submitted code ran as the unprivileged user {name}.")


def _confine(limits: Limits, who: Identity, cpu_s: int) -> None:
    """In a fresh child, before anything submitted runs: a session of its own, the limits, the unprivileged user."""
    os.setsid()
    for limit, value in [
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, 1024),
    ]:
        resource.setrlimit(limit, (value, value))
    if who.isolated:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        os.setgroups([])
        os.setgid(who.gid)
        os.setuid(who.uid)


def _kill_everything(pid: int, who: Identity) -> None:
    """Kill a child's session and, when it has a user of its own, every process of that user."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
    if who.isolated:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == who.uid:
                        os.kill(int(entry.name), signal.SIGKILL)


class Zygote:
    """A warm process that imports torch, transformers and pytest once and forks one confined child per request.

    It runs the grader's code only (never a submitted module): each child it forks confines itself (_confine)
    before importing any test or exercise module. The parent sends a request and the write end of a fresh pipe
    over a Unix socket, and gets back the child's pid, then its exit status.
    """

    def __init__(self, course: Path, scratch: Path) -> None:
        self.course, self.scratch = course, scratch
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        log = open(self.scratch / "zygote.log", "ab")  # noqa: SIM115 (the zygote's own output, kept for errors)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcourse.course.sandbox", "zygote", str(theirs.fileno())],
            cwd=self.course,
            env=child_env(self.scratch, self.course),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
        )
        theirs.close()
        log.close()
        self.sock = ours
        if self._message(300).get("ready") is not True:
            tail = (self.scratch / "zygote.log").read_bytes()[-2000:].decode(errors="replace")
            raise RuntimeError(f"the grader's test process did not start: {tail}")

    def _message(self, timeout: float) -> dict:
        assert self.sock is not None
        self.sock.settimeout(timeout)
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("the grader's test process stopped")
            data += chunk
        return json.loads(data)

    def spawn(self, request: dict, write_fd: int) -> int:
        """Fork a confined child for `request`, reporting on `write_fd`; return its pid."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        assert self.sock is not None
        socket.send_fds(self.sock, [(json.dumps(request) + "\n").encode()], [write_fd])
        return int(self._message(60)["pid"])

    def status(self, timeout: float) -> int | None:
        """The last child's exit status (negative: killed by that signal), None if it did not end in time."""
        try:
            return int(self._message(timeout)["status"])
        except (OSError, RuntimeError, ValueError, KeyError):
            return None

    def close(self) -> None:
        if self.process is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.process.wait(timeout=10)
        if self.sock is not None:
            self.sock.close()


def zygote_main(fd: int) -> None:
    """The zygote: preload, say ready, then fork one child per request and report its pid and exit status."""
    sock = socket.socket(fileno=fd)
    import kvcourse

    if Path(kvcourse.__file__).resolve().parent != Path.cwd().resolve() / "kvcourse":
        raise SystemExit(f"kvcourse was imported from {kvcourse.__file__}, not from {Path.cwd()}")
    _preload()
    sock.sendall(b'{"ready": true}\n')
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
        if not data:
            os._exit(0)
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            sock.close()
            _run_forked(request, fds[0])
        os.close(fds[0])
        sock.sendall((json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sock.sendall((json.dumps({"status": code}) + "\n").encode())


def _preload() -> None:
    """The grader's heavy imports, done once in the zygote (a missing optional one, Triton say, is skipped)."""
    import gc
    import importlib

    for name in ("torch", "transformers", "transformers.models.gpt2.modeling_gpt2",
                 "transformers.models.llama.configuration_llama", "transformers.cache_utils", "numpy", "hypothesis",
                 "_hypothesis_pytestplugin", "pytest", "pytest_timeout", "_pytest.skipping", "triton",
                 "triton.language", "kvcourse.course.grade", "kvcourse.course.static_check"):  # fmt: skip
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    with contextlib.suppress(ImportError):
        import torch

        torch.set_num_threads(1)
    gc.collect()
    gc.freeze()


def _run_forked(request: dict, report_fd: int) -> None:
    """In the forked child: confine, point stdout at the log, set the environment, then run; never return."""
    try:
        limits = Limits(**request.pop("limits"))
        who = Identity(request["uid"], request["gid"], "child", "")
        _confine(limits, who, int(request["cpu_s"]))
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, report_fd)
        os.closerange(report_fd + 1, 65536)
        os.environ.clear()
        os.environ.update(child_env(Path(request["work"]), Path.cwd()))
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.dont_write_bytecode = True
        tempfile.tempdir = None  # the zygote's cached temp folder is not the child's to write
        request["report_fd"] = report_fd
    except BaseException:  # could not confine: never run the tests unconfined
        os._exit(4)
    child_main(request)


@dataclass
class ChildRun:
    """What one child said (its events, in order) and how it ended."""

    events: list[dict] = field(default_factory=list)
    ending: str = ""  # "" when it reported "done"; else why it stopped, in words
    violation: dict | None = None
    log_tail: str = ""
    out_of_time: str = "the whole grading run's time limit ran out."  # what reaching the child's deadline means


def child_env(work: Path, course: Path) -> dict[str, str]:
    """The child's whole environment: nothing of the grader's (no KVCOURSE_SOLUTIONS, no tokens)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(work),
        "TMPDIR": str(work),
        "USER": "kvgrader",
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(course),
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work / "hf"),
        "TRITON_CACHE_DIR": str(work / "triton"),
        "HYPOTHESIS_STORAGE_DIRECTORY": str(work / "hypothesis"),  # the course folder is read-only to the child
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "KVCOURSE_TEST_TIMEOUT_S": os.environ.get("KVCOURSE_TEST_TIMEOUT_S", "30"),
    }


def run_child(
    zygote: Zygote, request: dict, who: Identity, limits: Limits, wall_s: float, out_of_time: str | None = None
) -> ChildRun:
    """Fork one confined child on `request`, read its events until it is done, dies, breaks a rule or stays silent."""
    work = Path(tempfile.mkdtemp(prefix="child-", dir=zygote.scratch))
    log_path = work / "output.log"
    log_path.touch()
    if who.isolated:
        os.chown(work, who.uid, who.gid)
        os.chown(log_path, who.uid, who.gid)
    os.chmod(work, 0o700)
    read_fd, write_fd = os.pipe()
    run = ChildRun(out_of_time=out_of_time or ChildRun.out_of_time)
    full = {**request, "uid": who.uid, "gid": who.gid, "work": str(work), "log": str(log_path),
            "cpu_s": int(wall_s) + 5, "limits": vars(limits)}  # fmt: skip
    try:
        pid = zygote.spawn(full, write_fd)
    finally:
        os.close(write_fd)
    try:
        _read_events(read_fd, run, limits, time.monotonic() + wall_s)
    finally:
        os.close(read_fd)
        _kill_everything(pid, who)
        code = zygote.status(30)
        with contextlib.suppress(OSError):
            run.log_tail = log_path.read_bytes()[-8000:].decode(errors="replace")
        shutil.rmtree(work, ignore_errors=True)
    done = any("done" in e for e in run.events)
    if not run.ending and not done and not run.violation:
        run.ending = _describe(code)
    return run


def _read_events(read_fd: int, run: ChildRun, limits: Limits, deadline: float) -> None:
    """Parse the child's JSON lines as they come; stop at "done", at EOF, at silence or at the run's deadline."""
    buffer, total, done = b"", 0, False
    silence = limits.start_s
    while not done:
        left = deadline - time.monotonic()
        if left <= 0:
            run.ending = run.out_of_time
            return
        ready, _, _ = select.select([read_fd], [], [], min(silence, left))
        if not ready:
            if time.monotonic() >= deadline:
                run.ending = run.out_of_time
            else:
                run.ending = (
                    f"the tests stopped reporting for {silence:.0f} s (an endless loop, or a sleep?) and were stopped."
                )
            return
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_REPORT_BYTES:
            run.ending = "the process running the tests wrote far more than test reports and was stopped."
            return
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    run.events.append(event)
                    run.violation = event if "violation" in event else run.violation
                    done = done or "done" in event
                    silence = limits.test_s


def _describe(code: int | None) -> str:
    """How a child ended without finishing its report, in words."""
    if code is None:
        return "the process running the tests did not finish."
    if code == VIOLATION_EXIT:
        return "the code under test did something the grader does not allow, and the tests were stopped."
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"the process running the tests was killed by {name} (a crash, or a memory or CPU limit) before it reported."
    return f"the process running the tests exited (code {code}) before it reported."


# ----------------------------------------------------------------------------------------------------------
# The parent's side: list the tests, run the groups, fold the outcomes.


@dataclass
class Manifest:
    """The graded tests, listed from the pristine stubs: nodeid -> (exercise ids, skip reason of its own marker)."""

    tests: dict[str, tuple[list[str], str | None]]
    errors: dict[str, str]

    def of(self, exercise_id: str) -> list[str]:
        return [nodeid for nodeid, (ids, _) in self.tests.items() if exercise_id in ids]


def collect(zygote: Zygote, ids: list[str], who: Identity, limits: Limits) -> Manifest:
    """List the graded tests of these exercises in a child that runs the pristine stubs only."""
    run = run_child(zygote, {"mode": "collect", "ids": ids}, who, limits, limits.start_s)
    found = next((e for e in run.events if "manifest" in e), None)
    if found is None:
        raise RuntimeError(f"could not list the graded tests: {run.ending or 'no answer'} {run.log_tail[-1500:]}")
    tests = {t["nodeid"]: (t["exercises"], t["skip"]) for t in found["manifest"]}
    return Manifest(tests, found.get("errors", {}))


def _failed(nodeid: str, ids: list[str], message: str) -> TestOutcome:
    return TestOutcome(nodeid, ids, passed=False, message=message)


class _Grading:
    """One submission's grading: the groups still to run, the results so far, and the rules for a child's end."""

    def __init__(self, course: Path, manifest: Manifest, stubs: dict[str, str], texts: dict[str, str]) -> None:
        self.course, self.manifest, self.stubs, self.texts = course, manifest, stubs, texts
        self.outcomes: dict[str, TestOutcome] = {}
        self.results: dict[str, ExerciseResult] = {}

    def finish(self, exercise: Exercise, message: str | None = None) -> None:
        """Fold the exercise's outcomes; a test with none gets `message` (or "not run")."""
        outcomes = []
        for nodeid in self.manifest.of(exercise.id):
            ids, skip = self.manifest.tests[nodeid]
            outcome = self.outcomes.get(nodeid) or _failed(nodeid, ids, message or "the test did not run.")
            if skip is not None:
                outcome = TestOutcome(nodeid, ids, passed=False, skipped=True, excused=True, message=skip)
            outcomes.append(outcome)
        result = summarize(exercise, outcomes, self.texts.get(exercise.module), self.stubs.get(exercise.module))
        self.results[exercise.id] = result

    def charge(self, exercises: list[Exercise], message: str) -> None:
        """Score these exercises from what they reported so far; every other test of theirs fails with `message`."""
        for exercise in exercises:
            if exercise.id not in self.results:
                self.finish(exercise, message)

    def record(self, events: list[dict], group: list[Exercise]) -> str | None:
        """Keep the outcomes of listed tests of this group (first report wins); return the test still running."""
        mine = {nodeid for ex in group for nodeid in self.manifest.of(ex.id)}
        running = None
        for event in events:
            if isinstance(event.get("start"), str) and event["start"] in mine:
                running = event["start"]
            test = event.get("test")
            if isinstance(test, dict) and test.get("nodeid") in mine and test["nodeid"] not in self.outcomes:
                nodeid = test["nodeid"]
                self.outcomes[nodeid] = TestOutcome(
                    nodeid,
                    self.manifest.tests[nodeid][0],
                    passed=test.get("passed") is True and not test.get("skipped"),
                    skipped=bool(test.get("skipped")),
                    message=str(test.get("message") or "")[:2000],
                    stub_of=test.get("stub_of") if isinstance(test.get("stub_of"), str) else None,
                    timed_out=bool(test.get("timed_out")),
                )
                if running == nodeid:
                    running = None
        return running

    @staticmethod
    def importing(events: list[dict]) -> str | None:
        """The exercise module whose import never finished (the innermost one), if any."""
        stack: list[str] = []
        for event in events:
            if isinstance(event.get("loading"), str):
                stack.append(event["loading"])
            elif event.get("loaded") in stack:
                stack.remove(event["loaded"])
        return stack[-1] if stack else None

    def complete(self, exercise: Exercise) -> bool:
        return all(nodeid in self.outcomes for nodeid in self.manifest.of(exercise.id))


def _violation_message(violation: dict) -> str:
    where = f"{violation.get('file', '?')}, line {violation.get('line', '?')}"
    return (
        f"the grader stopped your code at {where}: it {violation.get('violation', 'broke a rule')}, which no "
        "exercise needs. Remove it and submit again."
    )


def grade_course(
    course: Path,
    exercises: list[Exercise],
    stubs: dict[str, str],
    submitted: dict[str, str],
    limits: Limits | None = None,
    refused: dict[str, str] | None = None,
    log=print,
    guards: bool = True,
) -> tuple[list[ExerciseResult], str]:
    """Grade `course` (stubs + placed modules) one module at a time in children; return (results, a note)."""
    limits = limits or Limits()
    course = course.resolve()
    deadline = time.monotonic() + limits.run_s
    scratch = Path(tempfile.mkdtemp(prefix="kvcourse-children-"))
    os.chmod(scratch, 0o755)
    who = identity(course)
    log(f"sandbox: {who.note}")
    zygote = Zygote(course, scratch)
    try:
        zygote.start()
        results = _grade(zygote, exercises, stubs, submitted, limits, refused or {}, deadline, who, log, guards)
        return results, who.note
    finally:
        zygote.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _grade(zygote, exercises, stubs, submitted, limits, refused, deadline, who, log, guards) -> list[ExerciseResult]:
    """The loop of grade_course: run each group; after a bad end, charge the culprit and run the rest again."""
    manifest = collect_from_stubs(zygote, exercises, stubs, submitted, who, limits)
    course = zygote.course
    grading = _Grading(course, manifest, stubs, {**stubs, **submitted})
    for module, message in refused.items():
        grading.charge([ex for ex in exercises if ex.module == module], message)
    paths = {m: str((course / "kvcourse" / f"{m}.py").resolve()) for m in submitted}
    by_module: dict[str, list[Exercise]] = {}
    for exercise in sorted(exercises, key=lambda e: id_key(e.id)):
        by_module.setdefault(exercise.module, []).append(exercise)
    pending = list(by_module.values())
    while pending:
        group = [ex for ex in pending.pop(0) if ex.id not in grading.results]
        if not group:
            continue
        left = deadline - time.monotonic()
        if left < 10:
            grading.charge(
                [ex for g in [group, *pending] for ex in g], "not graded: the whole grading run's time limit ran out."
            )
            break
        request = {
            "mode": "test",
            "ids": [ex.id for ex in group],
            "submitted": sorted(paths.values()),
            "guards": guards,
        }
        # A fair share of what is left, so that one module's slow hangs cannot starve the modules after it.
        todo = sum(ex.id not in grading.results for ex in exercises)
        wall = min(left, max(90.0, 2 * left * len(group) / max(todo, 1)))
        why = None if wall >= left else f"these exercises used up their share of the run's time ({wall:.0f} s)."
        run = run_child(zygote, request, who, limits, wall, why)
        running = grading.record(run.events, group)
        log(f"sandbox: {', '.join(ex.id for ex in group)}: {run.ending or 'done'}")
        if not run.ending and not run.violation:
            errors = [str(e["message"])[:1000] for e in run.events if "collect_error" in e and "message" in e]
            for exercise in group:
                grading.finish(exercise, errors[0] if errors else "the test did not run.")
            continue
        unfinished = [ex for ex in group if ex.id not in grading.results and not grading.complete(ex)]
        for exercise in group:
            if exercise.id not in grading.results and grading.complete(exercise):
                grading.finish(exercise)
        if run.violation:
            culprit = next((m for m, p in paths.items() if p == run.violation.get("path")), None)
            message = _violation_message(run.violation)
            if culprit is not None:  # that module is graded 0 and put back to its stub for everything else
                grading.charge([ex for ex in exercises if ex.module == culprit], message)
                (course / "kvcourse" / f"{culprit}.py").write_text(stubs[culprit])
                grading.texts[culprit] = stubs[culprit]
                del paths[culprit]
            elif running:
                grading.charge([ex for ex in unfinished if ex.id in manifest.tests[running][0]], message)
            else:
                grading.charge(unfinished, message)
        elif running:
            ids = manifest.tests[running][0]
            grading.charge([ex for ex in unfinished if ex.id in ids], run.ending)
        elif grading.importing(run.events) in paths:  # a submitted module hung or crashed while importing
            culprit = grading.importing(run.events)
            grading.charge(
                [ex for ex in exercises if ex.module == culprit], f"importing kvcourse/{culprit}.py: {run.ending}"
            )
            (course / "kvcourse" / f"{culprit}.py").write_text(stubs[culprit])
            grading.texts[culprit] = stubs[culprit]
            del paths[culprit]
        elif len(unfinished) > 1:
            pending[0:0] = [[ex] for ex in unfinished]  # no test was running: find the culprit one by one
            continue
        else:
            grading.charge(unfinished, run.ending)
        rest = [ex for ex in unfinished if ex.id not in grading.results]
        if rest:
            pending.insert(0, rest)
    return [grading.results[ex.id] for ex in exercises]


def collect_from_stubs(
    zygote: Zygote, exercises: list[Exercise], stubs: dict[str, str], submitted: dict[str, str], who, limits
) -> Manifest:
    """The manifest, listed while every exercise module is its stub; then the submitted modules go in place."""
    course = zygote.course
    for module, text in stubs.items():
        (course / "kvcourse" / f"{module}.py").write_text(text)
    manifest = collect(zygote, [ex.id for ex in exercises], who, limits)
    for module, text in submitted.items():
        (course / "kvcourse" / f"{module}.py").write_text(text)
    return manifest


# ----------------------------------------------------------------------------------------------------------
# The child's side.


def _emitter(fd: int):
    """Write one JSON line per event to the parent's pipe."""

    def emit(event: dict) -> None:
        data = (json.dumps(event, default=str) + "\n").encode()
        while data:
            data = data[os.write(fd, data) :]

    return emit


PROCESS_EVENTS = (
    "os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
    "os.killpg", "os.putenv", "os.unsetenv", "socket.", "ctypes.", "os.remove", "os.rename", "os.rmdir",
    "os.chmod", "os.chown", "os.truncate", "shutil.", "os.symlink", "os.link", "sys.addaudithook", "signal.",
    "os.chdir", "resource.",
)  # fmt: skip
CALLER_EVENTS = (
    "exec", "compile", "sys._getframe", "sys._current_frames", "gc.get_referrers", "gc.get_referents",
    "gc.get_objects", "object.__getattr__", "object.__setattr__", "object.__delattr__", "sys.settrace",
    "sys.setprofile", "function.__new__", "code.__new__", "builtins.input", "marshal.", "pickle.", "cpython.",
)  # fmt: skip


NEVER_LAZY = ("torch.utils.cpp_extension", "torch.hub", "torch.package", "torch.multiprocessing", "torch.distributed")


def _exercise_module(name: str, fromlist, level: int) -> str | None:
    """The exercise module (memory, scheduler, ...) this import loads for the first time, if any."""
    if level:
        return None
    for full in [name, *(f"{name}.{x}" for x in fromlist or () if isinstance(x, str))]:
        parts = full.split(".")
        exercise = len(parts) > 1 and parts[0] == "kvcourse" and parts[1] in EXERCISE_MODULES
        if exercise and f"kvcourse.{parts[1]}" not in sys.modules:
            return parts[1]
    return None


def _is_test_source(args: tuple, tests: str) -> bool:
    """An "open" of the graded tests' own files (where the expected values are written)."""
    path = args[0] if args else None
    return isinstance(path, str) and os.path.abspath(path).startswith(tests)


def _writes(args: tuple) -> bool:
    """An "open" audit event that writes: mode "w", "a", "x" or "+", or os.open's write flags."""
    mode = args[1] if len(args) > 1 else None
    flags = args[2] if len(args) > 2 else 0
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT))


def install_guards(submitted: set[str], allowed: set[str], emit):
    """Stop the child the moment a submitted module imports past the allow-list or reaches the interpreter.

    Two guards, installed before any submitted module is imported: `__import__` refuses, for an import made by a
    submitted module, every module outside the allow-list (even one already loaded); an audit hook (which no
    Python code can remove) stops processes, signals, sockets, ctypes, file writes and changes, made anywhere
    below submitted code, and frame, code and dynamic-code access made by submitted code itself. It returns a
    check (_tamper_check) to run before every report: no function or class of pytest or the course replaced.
    """
    original_import = builtins.__import__
    busy = [False]
    tests = os.path.join(os.getcwd(), "tests") + os.sep  # reading the graded tests' source is not allowed either

    def stop(what: str, frame) -> None:
        emit({"violation": what, "path": frame.f_code.co_filename if frame else None, "file": Path(frame.f_code.co_filename).name if frame else None, "line": frame.f_lineno if frame else None})  # fmt: skip
        os._exit(VIOLATION_EXIT)

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__file__") if isinstance(globals, dict) else None
        if importer in submitted:
            full = name
            if level:
                base = (globals.get("__package__") or "").split(".")
                full = ".".join([*base[: len(base) - level + 1], *([name] if name else [])])
            # torch's C code imports its own submodules lazily (fromlist=[] from C, on the caller's globals)
            lazy = isinstance(fromlist, list) and full.split(".")[0] in allowed and not full.startswith(NEVER_LAZY)
            if full not in allowed and not lazy:
                stop(f"imported {full}", sys._getframe(1))
        loaded = len(sys.modules)
        target = _exercise_module(name, fromlist, level)
        if target:
            emit({"loading": target})  # an import that hangs or crashes is charged to this module
        module = original_import(name, globals, locals, fromlist, level)
        if target:
            emit({"loaded": target})
        if len(sys.modules) != loaded:
            snapshot()  # a course module just loaded: its functions as they are now, before anyone else runs
        return module

    def submitted_frame(frame):
        while frame is not None:
            if frame.f_code.co_filename in submitted:
                return frame
            frame = frame.f_back
        return None

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        process = event.startswith(PROCESS_EVENTS)
        writes = event == "open" and (_writes(args) or _is_test_source(args, tests))
        caller = event.startswith(CALLER_EVENTS)
        if not (process or writes or caller):
            return
        busy[0] = True
        try:
            frame = sys._getframe(1)
            if caller:
                if frame.f_code.co_filename in submitted:
                    stop(f"used {event}", frame)
            else:
                culprit = submitted_frame(frame)
                if culprit is not None:
                    stop(f"used {event}" + (f" on {args[0]}" if writes else ""), culprit)
        finally:
            busy[0] = False

    snapshot, verify = _tamper_check(submitted, stop)
    builtins.__import__ = guarded_import
    snapshot()  # after the guard is in place: builtins as the child runs them
    sys.addaudithook(hook)
    return verify


WATCHED = ("pytest", "_pytest.reports", "_pytest.runner", "_pytest.skipping", "_pytest.outcomes", "_pytest.python",
           "_pytest.main", "_pytest.nodes", "pluggy._callers", "pluggy._hooks", "pluggy._manager", "pytest_timeout",
           "kvcourse.course.grade", "kvcourse.course.results", "kvcourse.course.sandbox", "torch",
           "torch.nn.functional", "torch.testing", "math", "builtins", "operator", "collections")  # fmt: skip
CODE = (type, types.FunctionType, types.BuiltinFunctionType, property, staticmethod, classmethod)


def _tamper_check(submitted: set[str], stop):
    """A check, run before every report, that no function or class of pytest or the course was replaced.

    The snapshot holds the identity of every function, class and method of the watched modules and of every
    course module that is not submitted, each taken right after the module was loaded; a submitted module that
    swaps one (through an alias the static check missed) stops the child at its next report.
    """
    seen: dict[tuple[str, str, str], object] = {}

    def watched(name: str, module) -> bool:
        if name in WATCHED:
            return True
        path = getattr(module, "__file__", None)
        return name.startswith("kvcourse.") and path not in submitted and not name.startswith("kvcourse.course.")

    def snapshot() -> None:
        for name, module in list(sys.modules.items()):
            if (name, "", "") in seen or module is None or not watched(name, module):
                continue
            seen[(name, "", "")] = module
            for key, value in list(vars(module).items()):
                if isinstance(value, CODE):
                    seen[(name, key, "")] = value
                    if isinstance(value, type) and value.__module__ == name:
                        for attr, member in list(vars(value).items()):
                            if isinstance(member, CODE):
                                seen[(name, key, attr)] = member

    def benign(old, new) -> bool:
        """A library re-defining its own function lazily (same name, not written in a submitted file)."""
        code = getattr(getattr(new, "__func__", new), "__code__", None)
        if code is None or code.co_filename in submitted or code.co_name == "<lambda>":
            return False
        return getattr(old, "__qualname__", None) == getattr(new, "__qualname__", "")

    def verify() -> None:
        for (name, key, attr), old in list(seen.items()):
            module = sys.modules.get(name)
            value = module if not key else vars(module).get(key) if module is not None else None
            if attr and value is not None:
                value = vars(value).get(attr)
            if value is old:
                continue
            if benign(old, value):
                seen[(name, key, attr)] = value
                continue
            stop(f"changed {'.'.join(p for p in (name, key, attr) if p)} (part of pytest or the course)", None)

    return snapshot, verify


def child_main(request: dict) -> None:
    """In the child: list the tests (mode "collect") or run a group's tests, streaming JSON lines; never return."""
    emit = _emitter(int(request["report_fd"]))
    emit({"ready": True})
    code = 0
    try:
        import kvcourse

        here = Path.cwd().resolve()
        if Path(kvcourse.__file__).resolve().parent != here / "kvcourse":
            raise RuntimeError(f"kvcourse was imported from {kvcourse.__file__}, not from {here}")
        import pytest
        import torch

        with contextlib.suppress(ImportError):
            import transformers  # noqa: F401
        torch.set_num_threads(1)
        from kvcourse.course import grade

        selected = [EXERCISES[i] for i in request["ids"]]
        if request["mode"] == "collect":
            emit(_collect(selected, here))
            emit({"done": 0})
        else:
            from kvcourse.course.static_check import load_policy

            submitted = set(request.get("submitted") or [])
            report = emit
            if request.get("guards", True):
                verify = install_guards(submitted, load_policy(here).modules, emit)

                def report(event: dict) -> None:
                    verify()
                    emit(event)

            collector = grade._Collector(False, emit=report)
            basetemp = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / "pytest"
            code = pytest.main([*grade.pytest_args(selected, here), f"--basetemp={basetemp}"], plugins=[collector])
            report({"done": int(code)})
    except BaseException as error:  # the grader's own failure: say it, the parent decides
        emit({"error": f"{type(error).__name__}: {error}"})
        code = 3
    finally:
        sys.stdout.flush()
        os._exit(0 if code in (0, 1, 5) else 3)


def _collect(selected: list[Exercise], root: Path) -> dict:
    """Every graded test, its exercises and the skip its own marker makes here ("no CUDA"), or None."""
    import pytest
    from _pytest.skipping import evaluate_skip_marks

    from kvcourse.course import grade

    class Lister:
        def __init__(self) -> None:
            self.tests, self.errors = [], {}

        def pytest_collectreport(self, report) -> None:
            if report.failed:
                self.errors[Path(str(report.fspath)).name] = grade._import_error_message(str(report.longrepr))

        def pytest_collection_modifyitems(self, items) -> None:
            for item in items:
                ids = [ex.id for ex in EXERCISES.values() if item.get_closest_marker(ex.marker)]
                skip = evaluate_skip_marks(item)
                self.tests.append({"nodeid": item.nodeid, "exercises": ids, "skip": skip.reason if skip else None})

    lister = Lister()
    pytest.main([*grade.pytest_args(selected, root), "--collect-only"], plugins=[lister])
    return {"manifest": lister.tests, "errors": lister.errors}


if __name__ == "__main__":
    if sys.argv[1:2] == ["zygote"] and len(sys.argv) == 3:
        zygote_main(int(sys.argv[2]))
    sys.exit("usage: python -m kvcourse.course.sandbox zygote FD (started by the grader, not by hand)")

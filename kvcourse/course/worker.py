"""A warm grader: one process imports torch, transformers and pytest once, then forks a fresh child per check.

`check()` in a notebook talks to it over a pipe (one JSON line each way). Each check runs in a child
forked from the warm process, which first forgets every `kvcourse` module it may hold, so the
learner's files are read afresh; a crash or a hang in the learner's code ends that child only, never
the worker, and never the notebook's kernel. The warm process itself imports no learner code.

    python -m kvcourse.course.worker      # serve requests on stdin/stdout (started by feedback.py)
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK_TIMEOUT_S = 900  # a whole check; each test is stopped after grade.TEST_TIMEOUT_S already
START_TIMEOUT_S = 300  # importing torch and transformers on a busy laptop
# Third-party modules a graded test run imports (measured): loaded once, before any fork.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.cache_utils",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.configuration_llama",
    "triton",
    "triton.language",
    "numpy",
    "hypothesis",
    "_hypothesis_pytestplugin",
    "pytest",
    "pytest_timeout",
    "tqdm",
)
# Course machinery the warm process holds; every other kvcourse module is re-imported in each child.
KEEP = {"kvcourse", "kvcourse.course", "kvcourse.course.exercises", "kvcourse.course.solutions_switch", __name__}


def _preload() -> None:
    """Import the heavy libraries (a missing optional one, Triton say, is simply skipped)."""
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _forget_learner_modules() -> None:
    """Drop kvcourse, solutions and test modules from this process, so the next import reads the files."""
    for name in list(sys.modules):
        top = name.split(".")[0]
        if (
            (top == "kvcourse" and name not in KEEP)
            or top in {"solutions", "tests", "conftest"}
            or top.startswith("test_")
        ):
            del sys.modules[name]
    importlib.invalidate_caches()


def _one_thread() -> None:
    """Graded tests use tiny models: one torch thread runs them faster (2-3x on a busy 2-core machine)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # and for the subprocesses a test may start
    with contextlib.suppress(ImportError):
        import torch

        torch.set_num_threads(1)


def _child(request: dict, write_fd: int, log_path: str) -> None:
    """In the forked child: grade with a clean slate, write the results as JSON, and never return."""
    code = 0
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request.get("env") or {})
        _one_thread()
        _forget_learner_modules()
        from kvcourse.course.grade import run

        results = run(request["ids"], solutions=bool(request.get("solutions")))
        payload = json.dumps({"results": [asdict(r) for r in results]}).encode()
    except BaseException as error:  # report anything, even SystemExit from the learner's code
        payload = json.dumps({"error": f"{type(error).__name__}: {error}"}).encode()
        code = 1
    try:
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
    finally:
        os._exit(code)


def _describe_exit(status: int, log_path: str) -> str:
    """Why a child ended without an answer: a signal or exit code, and the last lines it printed."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        how = f"was killed by signal {number} ({signal.Signals(number).name})"
    else:
        how = f"exited with code {os.WEXITSTATUS(status)}"
    tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-5:] if Path(log_path).exists() else []
    said = (" Its last output: " + " | ".join(tail)) if tail else ""
    return f"the process running the tests {how} before it reported (a crash in the code under test?).{said}"


def grade_forked(request: dict) -> dict:
    """Fork a child that grades `request`; return its answer, or {'error': ...} if it crashed or hung."""
    read_fd, write_fd = os.pipe()
    log_fd, log_path = tempfile.mkstemp(prefix="kvcourse-check-", suffix=".log")
    os.close(log_fd)
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(request, write_fd, log_path)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHECK_TIMEOUT_S
    with os.fdopen(read_fd, "rb") as source:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([source], [], [], max(0.0, left))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"error": f"the check ran for more than {CHECK_TIMEOUT_S} s and was stopped."}
            chunk = os.read(source.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks)) if chunks else {"error": _describe_exit(status, log_path)}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(log_path)


def serve() -> None:
    """Answer one JSON request per line on stdin, one JSON answer per line on the original stdout."""
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # stray prints (from any library) must not corrupt the answers
    _preload()
    gc.collect()
    gc.freeze()  # the preloaded objects: never scanned again by a child's collections (pytest runs several)
    answers.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    answers.flush()
    for line in sys.stdin:
        if line.strip():
            answers.write(json.dumps(grade_forked(json.loads(line))) + "\n")
            answers.flush()


class WorkerError(RuntimeError):
    """The warm worker could not start or stopped answering."""


class Worker:
    """The notebook's side: start the warm process once, send it checks, restart it if it died."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> None:
        """Launch `python -m kvcourse.course.worker` and wait for its ready line."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvcourse.course.worker"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # Ctrl-C / interrupting the kernel does not reach it
        )
        if "ready" not in self._read_line(START_TIMEOUT_S):
            raise WorkerError("the grading worker did not start.")

    def _read_line(self, timeout: float) -> dict:
        """One JSON line from the worker, or WorkerError when it died or said nothing in time."""
        assert self.process is not None and self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise WorkerError("the grading worker stopped answering.")
        return json.loads(line)

    def alive(self) -> bool:
        """True while the warm process runs."""
        return self.process is not None and self.process.poll() is None

    def grade(self, exercise_ids: list[str], solutions: bool) -> dict:
        """Grade in a fresh child of the warm process: {'results': [...]} or {'error': ...}."""
        request = json.dumps({"ids": exercise_ids, "solutions": solutions, "env": dict(os.environ)}) + "\n"
        with self.lock:
            for attempt in (1, 2):  # a worker that died since the last check is restarted once
                try:
                    if not self.alive():
                        self._start()
                    assert self.process is not None and self.process.stdin is not None
                    self.process.stdin.write(request)
                    self.process.stdin.flush()
                    return self._read_line(CHECK_TIMEOUT_S + 60)
                except (WorkerError, OSError):
                    self.stop()
                    if attempt == 2:
                        raise
                except BaseException:  # interrupted mid-check: its answer would arrive late, so start afresh
                    self.stop()
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """End the warm process and any check it is running (it also ends when this process closes its stdin)."""
        if self.process is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the worker and its children
            with contextlib.suppress(Exception):
                self.process.wait(timeout=10)
            self.process = None


if __name__ == "__main__":
    serve()

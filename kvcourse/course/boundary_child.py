"""The untrusted side of the classroom grader: import the submitted modules, call observe(), print plain data.

Started by `kvcourse.course.boundary` as an unprivileged user, in a fresh folder it owns, with limits set
from outside. It reads one request (JSON) on stdin and writes one JSON line per record on its original
stdout: {"start": id}, {"exercise": id, "seed": n, "observations": [...]} or {"exercise": id, "seed": n,
"error": "..."}. It never says pass or fail: anything it prints is data the parent checks and compares with
the reference's observations. Submitted code runs here, so nothing here is trusted (the parent knows).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

MAX_TEXT = 500  # characters of an error message kept


class CourseAnswerRefused(RuntimeError):
    """Raised by a course module the grader hides because it is the answer to the exercise being graded."""


class Refusing:
    """Whatever is done with it (called, or an attribute read) raises CourseAnswerRefused."""

    def __init__(self, why: str) -> None:
        object.__setattr__(self, "_why", why)

    def __call__(self, *args, **kwargs):
        raise CourseAnswerRefused(object.__getattribute__(self, "_why"))

    def __getattr__(self, attr: str):
        raise CourseAnswerRefused(object.__getattribute__(self, "_why"))


def refusing_module(name: str, exercise_id: str) -> types.ModuleType:
    """A stand-in for `name` whose every attribute refuses (CourseAnswerRefused) when used."""
    module = types.ModuleType(name)
    why = (
        f"Exercise {exercise_id} is graded without the course's own {name}: it is the answer to this exercise. "
        "Write the computation yourself instead of calling it."
    )

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Refusing(why)

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return module


class SubmittedFinder(importlib.abc.MetaPathFinder):
    """Load `kvcourse.<exercise module>` from the folder of submitted (or stub) files, nowhere else."""

    def __init__(self, folder: Path, modules: set[str]) -> None:
        self.folder, self.modules = folder, modules

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.partition(".")
        if package != "kvcourse" or name not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, self.folder / f"{name}.py")


class LazyModules(Mapping):
    """{module name: module}, importing a submitted module only when the observer asks for it."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __getitem__(self, name: str) -> types.ModuleType:
        if name not in self.names:
            raise KeyError(name)
        return importlib.import_module(f"kvcourse.{name}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_observer(spec: str):
    """The observer: a module name, or a .py file (copied into this folder by the parent)."""
    if spec.endswith(".py"):
        loader = importlib.util.spec_from_file_location("kvcourse_grader_observer", spec)
        module = importlib.util.module_from_spec(loader)
        sys.modules[loader.name] = module  # dataclasses look their module up while it loads
        loader.loader.exec_module(module)
        return module
    return importlib.import_module(spec)


def describe(error: BaseException) -> str:
    """'TypeError: ...' (an exception whose str() itself fails is named only)."""
    try:
        return f"{type(error).__name__}: {error}"[:MAX_TEXT]
    except BaseException:  # a submitted exception class may fail in __str__
        return "an exception whose message could not be read"


def main() -> None:
    """Read the request, point stdout and stderr away from the report channel, observe every (exercise, seed)."""
    request = json.loads(sys.stdin.readline())
    report = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)

    def emit(record: dict) -> None:
        data = (json.dumps(record, default=repr) + "\n").encode()
        while data:
            data = data[os.write(report, data) :]

    names = list(request["modules"])
    for name, exercise_id in request.get("refuse", {}).items():
        sys.modules[name] = refusing_module(name, exercise_id)
    sys.meta_path.insert(0, SubmittedFinder(Path(request["folder"]), set(names)))
    try:
        observer = load_observer(request["observer"])
    except BaseException as error:  # the grader's own failure (a missing observer): say it, then stop
        emit({"fatal": f"the observer {request['observer']} could not be loaded: {describe(error)}"})
        os._exit(3)
    modules = LazyModules(names)
    for exercise in request["exercises"]:
        emit({"start": exercise["id"]})
        for seed in exercise["seeds"]:
            try:
                got = observer.observe(exercise["id"], seed, modules, request["size"])
                emit({"exercise": exercise["id"], "seed": seed, "observations": got})
            except BaseException as error:  # the learner's code: any exception is data
                emit({"exercise": exercise["id"], "seed": seed, "error": describe(error)})
    emit({"end": True})
    os._exit(0)


if __name__ == "__main__":
    main()

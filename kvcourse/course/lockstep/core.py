"""The lockstep harness's core: run a workload on an implementation, record plain data, compare with the reference.

Every graded exercise has a workload module (chapters.py) that turns (exercise, seed, size) into a list of
plain-data ops and runs them against a set of exercise modules, recording one plain-data observation per
call. `compare` walks two such lists and returns the first `Divergence`: the exercise, the workload, the
step, the rule broken (in the contract's words), expected vs got, and how to reproduce it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kvcourse.course.exercises import EXERCISES, get
from kvcourse.course.stubs import BEGIN_MARK, END_MARK

MODULES = ("memory", "step", "scheduler", "kv_cache", "eviction", "attention", "model_runner", "offload")
SEED_ENV = "KVCOURSE_LOCKSTEP_SEED"  # check("2.6", seed=N) runs only this seed
REFERENCE_ENV = "KVCOURSE_REFERENCE_DIR"  # where the reference is read (the mutation check points at a clean copy)
OBSERVE_TIMEOUT_S = 20.0  # one workload on one side: a learner's endless loop becomes a record, not a hang
_BEGIN = BEGIN_MARK + " "  # the stubs' marker (built at run time: no file of the package holds it)


@dataclass(frozen=True)
class Divergence:
    """The first observation where the code under test differs from the reference."""

    exercise_id: str
    seed: int
    index: int
    message: str

    def __str__(self) -> str:
        """The message is the verdict."""
        return self.message


class WorkloadTimeout(Exception):
    """One workload ran past OBSERVE_TIMEOUT_S (an endless loop in the code under test?)."""


# ---------------------------------------------------------------------------------------------- plain data
def plain(value: object, depth: int = 0) -> object:
    """The value as plain data (numbers, strings, lists, dicts with str keys); anything else as its repr."""
    if depth > 12:
        return "<too deep>"
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, depth + 1) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a tensor scalar
        with contextlib.suppress(Exception):
            return plain(value.item(), depth + 1)
    return f"<{type(value).__name__}>"


def error_record(error: BaseException, module_files: set[str]) -> dict:
    """An exception raised by the code under test, as plain data: its type, message and the function it came from."""
    where = None
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename in module_files or frame.filename.startswith("<lockstep splice"):
            where = frame.name
            break
    return {"error": type(error).__name__, "message": str(error)[:300], "where": where}


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise WorkloadTimeout inside the block after `seconds` (main thread on POSIX only; elsewhere no limit)."""
    usable = hasattr(signal, "setitimer") and _main_thread()
    if not usable:
        yield
        return

    def _stop(signum, frame):
        raise WorkloadTimeout(f"the workload ran for more than {seconds:.0f} s (an endless loop?)")

    old = signal.signal(signal.SIGALRM, _stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _main_thread() -> bool:
    """Signals can only be handled in the main thread."""
    import threading

    return threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------------------------------------- comparing
@dataclass(frozen=True)
class Rules:
    """How one exercise's observations compare: the contract's words per observable, tolerances, what is free."""

    words: Mapping[str, str]  # observable key -> the rule, in the contract's words
    free: frozenset[str] = frozenset()  # keys the contract leaves free: never compared
    rel_tol: Mapping[str, float] | None = None  # float tolerance per key (default: exact)
    abs_tol: Mapping[str, float] | None = None


def _tolerance(rules: Rules, key: str) -> tuple[float, float]:
    """(relative, absolute) tolerance for floats under `key`."""
    rel = (rules.rel_tol or {}).get(key, (rules.rel_tol or {}).get("*", 0.0))
    ab = (rules.abs_tol or {}).get(key, (rules.abs_tol or {}).get("*", 0.0))
    return rel, ab


def _short(value: object, limit: int = 300) -> str:
    """A value for a message, cut to a readable length."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_difference(expected: object, got: object, rules: Rules, key: str = "", path: str = "") -> tuple | None:
    """(path, top key, expected, got) of the first difference, or None; never raises on malformed `got`."""
    if key in rules.free:
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return path, key, expected, got
        for name, value in expected.items():
            if name in rules.free:
                continue
            if name not in got:
                return f"{path}.{name}", name, value, "<missing>"
            found = first_difference(value, got[name], rules, key or name, f"{path}.{name}")
            if found:
                return found
        return None
    if isinstance(expected, list):
        if not isinstance(got, list):
            return path, key, expected, got
        for i, (e, g) in enumerate(zip(expected, got)):
            found = first_difference(e, g, rules, key, f"{path}[{i}]")
            if found:
                return found
        if len(expected) != len(got):
            return path, key, expected, got
        return None
    if isinstance(expected, float) and not isinstance(expected, bool):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return path, key, expected, got
        rel, ab = _tolerance(rules, key)
        if math.isnan(expected):
            return None if isinstance(got, float) and math.isnan(got) else (path, key, expected, got)
        if math.isnan(got) or not math.isclose(expected, got, rel_tol=rel, abs_tol=ab):
            return path, key, expected, got
        return None
    if type(expected) is not type(got) or expected != got:
        if isinstance(expected, int) and isinstance(got, int) and not isinstance(got, bool) and expected == got:
            return None
        return path, key, expected, got
    return None


def describe(exercise_id: str, workload: str, record: Mapping, found: tuple, rules: Rules, seed: int) -> str:
    """The divergence message: where, which rule, expected vs got, how to reproduce."""
    path, key, expected, got = found
    exercise = get(exercise_id)
    call = record.get("call", "?") if isinstance(record, Mapping) else "?"
    step = record.get("step", "?") if isinstance(record, Mapping) else "?"
    rule = rules.words.get(key) or rules.words.get("*", "the result must match the contract")
    lines = [
        f"Exercise {exercise.id} ({exercise.title}), workload {workload}, call #{step} ({call}): {rule}.",
        f"   at {path.lstrip('.') or key or 'the result'}: expected {_short(expected)}, got {_short(got)}.",
    ]
    return "\n".join(lines) + f'\n   Reproduce with check("{exercise.id}", seed={seed}).'


# ---------------------------------------------------------------------------------------------- modules
def solutions_dir() -> Path:
    """Where the reference is read: KVCOURSE_REFERENCE_DIR, else solutions/ next to this checkout's kvcourse/."""
    from kvcourse.course.solutions_switch import SOLUTIONS_DIR

    return Path(os.environ.get(REFERENCE_ENV) or SOLUTIONS_DIR)


def _load_file(name: str, path: Path) -> ModuleType:
    """Execute a source file as a module under a private name (registered: dataclasses look modules up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_REFERENCE: dict[tuple[str, str], ModuleType] = {}


def reference_modules() -> dict[str, ModuleType]:
    """The reference's exercise modules, loaded from solutions/ under private names (never kvcourse.*)."""
    root = solutions_dir()
    out = {}
    for name in MODULES:
        key = (str(root), name)
        if key not in _REFERENCE:
            _REFERENCE[key] = _load_file(f"_kvcourse_reference_{name}", root / f"{name}.py")
        out[name] = _REFERENCE[key]
    return out


def learner_modules() -> dict[str, ModuleType]:
    """The learner's exercise modules, imported as kvcourse.<name> (solutions/ under KVCOURSE_SOLUTIONS=1)."""
    return {name: importlib.import_module(f"kvcourse.{name}") for name in MODULES}


def region_owners(module: str) -> dict[str, set[str]]:
    """qualname -> the exercise ids whose solution regions (the marked x.y regions) lie in that function (solutions/)."""
    source = (solutions_dir() / f"{module}.py").read_text()
    lines = source.splitlines()
    owners: dict[str, set[str]] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[child.lineno - 1 : child.end_lineno]
                ids = {line.strip()[len(_BEGIN) :].strip() for line in body if line.strip().startswith(_BEGIN)}
                if ids:
                    owners[f"{prefix}{child.name}"] = ids

    visit(ast.parse(source), "")
    return owners


def functions_of(exercise_id: str) -> list[str]:
    """The functions holding exercise_id's regions, in file order (for 'still raises NotImplementedError')."""
    module = get(exercise_id).module
    return [q for q, ids in region_owners(module).items() if exercise_id in ids]


def _resolve(module: ModuleType, qualname: str) -> tuple[object, str]:
    """(owner object, attribute name) of a dotted qualname inside a module."""
    owner: object = module
    *parents, name = qualname.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


_HYBRIDS: dict[tuple, ModuleType] = {}
UNSPLIT: set[str] = set()  # exercises whose shared function could not be split: an earlier region's bug reaches them


def hybrid_modules(
    exercise_id: str, learner: Mapping[str, ModuleType], reference: Mapping[str, ModuleType]
) -> dict[str, ModuleType]:
    """Exercise X's code alone: the learner's module with every function owning OTHER exercises' regions
    replaced by the reference's (a function shared with another exercise stays the learner's); every other
    module is the reference's."""
    module = get(exercise_id).module
    learner_file = getattr(learner[module], "__file__", None)
    key = (exercise_id, learner_file, id(learner[module]), id(reference[module]))
    if key not in _HYBRIDS:
        name = f"_kvcourse_hybrid_{module}_{exercise_id.replace('.', '_')}"
        hybrid = _load_file(name, Path(learner_file)) if learner_file else learner[module]
        for qualname, ids in region_owners(module).items():
            if exercise_id in ids:
                if len(ids) > 1:  # shared with another exercise: only THAT exercise's region becomes the reference's
                    _splice(hybrid, reference[module], qualname, exercise_id)
                continue
            with contextlib.suppress(AttributeError):
                ref_owner, attr = _resolve(reference[module], qualname)
                owner, _ = _resolve(hybrid, qualname)
                value = ref_owner.__dict__[attr] if isinstance(ref_owner, type) else getattr(ref_owner, attr)
                setattr(owner, attr, value)
        _HYBRIDS[key] = hybrid
    return {**reference, module: _HYBRIDS[key]}


def _segments(lines: list[str]) -> list[tuple[str | None, list[str]]]:
    """A reference function's lines cut at its given code lines: (anchor line, the lines before it)."""
    out, pending, depth = [], [], None
    for line in lines:
        text = line.strip()
        if text.startswith(_BEGIN):
            depth = text[len(_BEGIN) :].strip()
        if depth is None and text and not text.startswith(_BEGIN):
            out.append((line, pending))
            pending = []
        else:
            pending.append(line)
        if text.startswith(END_MARK):
            depth = None
    out.append((None, pending))
    return out


def _splice(hybrid: ModuleType, reference: ModuleType, qualname: str, exercise_id: str) -> None:
    """Replace, inside the learner's version of a shared function, every OTHER exercise's region by the
    reference's: the given lines (anchors) cut both versions into the same segments. Left as it is when
    the learner's version no longer has the given lines in order."""
    import inspect
    import textwrap

    owner, name = _resolve(hybrid, qualname)
    ref_owner, _ = _resolve(reference, qualname)
    try:
        mine = inspect.getsource(owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
        theirs = inspect.getsource(
            ref_owner.__dict__[name] if isinstance(ref_owner, type) else getattr(ref_owner, name)
        )
    except (OSError, TypeError, KeyError):
        return
    learner_lines, at, out, carried = mine.splitlines(), 0, [], []
    for anchor, before in _segments(theirs.splitlines()):
        before = carried + before
        if anchor is None:
            stop = len(learner_lines)
        else:
            stop = next((i for i in range(at, len(learner_lines)) if learner_lines[i].strip() == anchor.strip()), None)
            if stop is None and anchor.strip().startswith("#"):
                carried = [*before, anchor]  # a comment the learner deleted: its segment joins the next one
                continue
            if stop is None:
                UNSPLIT.add(exercise_id)  # the given code was edited: keep the learner's function whole
                return
        carried = []
        regions = [ln.strip()[len(_BEGIN) :].strip() for ln in before if ln.strip().startswith(_BEGIN)]
        other = bool(regions) and exercise_id not in regions
        out += before if other else learner_lines[at:stop]
        if anchor is not None:
            out.append(learner_lines[stop])
        at = stop + 1
    space: dict = {}
    exec(compile(textwrap.dedent("\n".join(out)), f"<lockstep splice of {qualname}>", "exec"), vars(hybrid), space)
    function = space[name]
    function.__qualname__ = qualname
    setattr(owner, name, function)


def module_files(modules: Mapping[str, ModuleType]) -> set[str]:
    """The source files of the modules under test (to say which function raised)."""
    return {str(getattr(m, "__file__", "")) for m in modules.values()}


def exercises_sharing(exercise_id: str) -> list[str]:
    """Earlier exercises whose regions share a function with this one's (their bugs reach its check)."""
    module = get(exercise_id).module
    order = list(EXERCISES)
    shared: set[str] = set()
    for ids in region_owners(module).values():
        if exercise_id in ids:
            shared |= ids
    shared.discard(exercise_id)
    return [i for i in order if i in shared and order.index(i) < order.index(exercise_id)]


Runner = Callable[[list, Mapping[str, ModuleType]], list[dict]]

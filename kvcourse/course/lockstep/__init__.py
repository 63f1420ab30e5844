"""Verdicts by comparison (issue 35): run the learner's code beside the reference and name the first difference.

The interface the classroom grader uses across a process boundary (plain data only):

    observe(exercise_id, seed, modules, size="small") -> list[dict]
    compare(exercise_id, seed, expected, got) -> Divergence | None
    seeds_for(exercise_id, size) -> list[int]

Locally, `verdict(exercise_id)` runs both sides in this process: the reference from solutions/ under private
names, the learner's code as a HYBRID (the learner's module with every function that owns another exercise's
region replaced by the reference's), so exercise X's check sees X's code only.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from types import ModuleType

from kvcourse.course.exercises import EXERCISES, get

from .core import (
    SEED_ENV,
    Divergence,
    exercises_sharing,
    first_difference,
    functions_of,
    hybrid_modules,
    learner_modules,
    plain,
    reference_modules,
)
from .registry import WORKLOADS, rules_for

__all__ = [
    "Divergence",
    "compare",
    "hybrid_modules",
    "observe",
    "reference_modules",
    "seeds_for",
    "usable_reference",
    "verdict",
]

SEEDS = {"small": 5, "classroom": 60}
SHRINK_BUDGET_S = 4.0


def seeds_for(exercise_id: str, size: str = "small") -> list[int]:
    """The seeds a check runs: a few locally ("small"), many in the classroom grader ("classroom")."""
    get(exercise_id)
    if size not in SEEDS:
        raise ValueError(f"size is {size!r}; use one of {', '.join(SEEDS)}.")
    return list(range(SEEDS[size]))


def _ops(exercise_id: str, seed: int, size: str) -> list[tuple[str, list, object]]:
    """(workload name, ops, runner) for each of the exercise's workloads at this seed."""
    return [(name, gen(exercise_id, seed, size), run) for name, gen, run in WORKLOADS[exercise_id]]


def _run(name: str, ops: list, runner, modules: Mapping[str, ModuleType]) -> list[dict]:
    """One workload's records, tagged with its name; nothing the code under test raises escapes."""
    try:
        records = runner(ops, modules)
    except Exception as error:
        from .core import error_record, module_files

        records = [{"step": 0, "call": "building the workload", **error_record(error, module_files(modules))}]
    return [{"workload": name, **record} for record in records]


def observe(exercise_id: str, seed: int, modules: Mapping[str, ModuleType], size: str = "small") -> list[dict]:
    """Run the exercise's workloads for `seed` against `modules`; one plain-data record per call."""
    records: list[dict] = []
    for name, ops, runner in _ops(exercise_id, seed, size):
        records += _run(f"{name}#{seed}", ops, runner, modules)
    return plain(records)  # type: ignore[return-value]


def compare(exercise_id: str, seed: int, expected: list[dict], got: object) -> Divergence | None:
    """The first record where `got` differs from `expected` by the exercise's rules; `got` may be anything."""
    try:
        return _compare(exercise_id, seed, expected, got)
    except Exception as error:
        return _divergence(
            exercise_id, seed, 0, f"the observations could not be read ({type(error).__name__}: {error})"
        )


def _divergence(exercise_id: str, seed: int, index: int, text: str) -> Divergence:
    """A Divergence with the standard head and tail."""
    exercise = get(exercise_id)
    head = f"Exercise {exercise.id} ({exercise.title})"
    message = text if text.startswith("Exercise ") else f"{head}: {text}"
    if "Reproduce with" not in message:
        message += f'\n   Reproduce with check("{exercise.id}", seed={seed}).'
    return Divergence(exercise.id, seed, index, message)


def _compare(exercise_id: str, seed: int, expected: list[dict], got: object) -> Divergence | None:
    """compare() without the safety net."""
    from .core import describe

    rules = rules_for(exercise_id)
    if not isinstance(got, list):
        return _divergence(exercise_id, seed, 0, f"the observations are a {type(got).__name__}, not a list.")
    for index, want in enumerate(expected):
        where = f"workload {want.get('workload')}, call #{want.get('step')} ({want.get('call')})"
        if index >= len(got):
            return _divergence(
                exercise_id,
                seed,
                index,
                f"{where}: the run stopped early ({len(got)} records, expected {len(expected)}).",
            )
        have = got[index]
        if not isinstance(have, dict):
            return _divergence(exercise_id, seed, index, f"{where}: the record is {type(have).__name__}, not a dict.")
        if have.get("call") != want.get("call") and "error" not in have:
            return _divergence(
                exercise_id, seed, index, f"{where}: the run went a different way (got a call to {have.get('call')!r})."
            )
        if "error" in want or "error" in have:
            if want.get("error") != have.get("error"):
                return _divergence(exercise_id, seed, index, _error_text(where, want, have, rules))
            continue
        found = first_difference(want.get("obs"), have.get("obs"), rules)
        if found:
            return _divergence(
                exercise_id, seed, index, describe(exercise_id, str(want.get("workload")), want, found, rules, seed)
            )
    if len(got) > len(expected):
        return _divergence(
            exercise_id, seed, len(expected), f"the run made {len(got) - len(expected)} more calls than the reference."
        )
    return None


def _error_text(where: str, want: Mapping, have: Mapping, rules) -> str:
    """Words for an exception on one side only (or of another type)."""
    raised = have.get("error")
    if raised == "NotImplementedError":
        said = str(have.get("message"))[:200]
        return f"`{have.get('where')}` still raises NotImplementedError ({said}); at {where}."
    if raised and not want.get("error"):
        return (
            f"{where}: raised {raised}: {str(have.get('message'))[:300]}{_in(have)}; the reference raises nothing here."
        )
    if want.get("error") and not raised:
        return f"{where}: {rules.words.get('error', 'the contract says this call raises')}: expected {want['error']}, but it returned normally."
    return f"{where}: expected {want.get('error')}, got {raised}: {str(have.get('message'))[:200]}."


def _in(record: Mapping) -> str:
    """' (in `function`)' when the record says which function raised."""
    return f" (in `{record['where']}`)" if record.get("where") else ""


# ---------------------------------------------------------------------------------------------- locally
def _seeds(exercise_id: str, seed: int | None, size: str) -> list[int]:
    """One seed if asked (check(..., seed=N) sets KVCOURSE_LOCKSTEP_SEED), else the size's seeds."""
    if seed is None and os.environ.get(SEED_ENV, "").strip():
        seed = int(os.environ[SEED_ENV])
    return [seed] if seed is not None else seeds_for(exercise_id, size)


def usable_reference(exercise_id: str, seed: int, expected: list[dict]) -> list[dict]:
    """The reference's records, refused when every call raised: a workload the reference cannot run (a wrong
    config, a kernel without its interpreter) would make any code that raises anything "match"."""
    if expected and all("error" in record for record in expected):
        first = expected[0]
        raise RuntimeError(
            f"the reference raises on every call of exercise {exercise_id}'s workload (seed {seed}): "
            f"{first.get('error')}: {str(first.get('message'))[:300]}. Nothing can be judged against that: "
            "fix the workload or the environment (5.4 needs TRITON_INTERPRET=1 on a machine without a GPU)."
        )
    return expected


def first_divergence(
    exercise_id: str, seed: int | None = None, size: str = "small", learner: Mapping[str, ModuleType] | None = None
) -> Divergence | None:
    """The first divergence of the learner's code (as a hybrid) from the reference, over the seeds; unshrunk."""
    reference = reference_modules()
    test = hybrid_modules(exercise_id, learner or learner_modules(), reference)
    for s in _seeds(exercise_id, seed, size):
        expected = usable_reference(exercise_id, s, observe(exercise_id, s, reference, size))
        found = compare(exercise_id, s, expected, observe(exercise_id, s, test, size))
        if found:
            return found
    return None


def verdict(
    exercise_id: str, seed: int | None = None, size: str = "small", learner: Mapping[str, ModuleType] | None = None
) -> str | None:
    """None when the learner's code matches the reference on every seed; else the message: first rule broken,
    a shrunk workload, which earlier exercise to fix first, how to reproduce."""
    exercise_id = get(exercise_id).id
    found = first_divergence(exercise_id, seed, size, learner)
    if found is None:
        return None
    message = found.message
    if "NotImplementedError" not in message:
        message += _shrunk(exercise_id, found.seed, size, learner)
    from .core import UNSPLIT

    for earlier in exercises_sharing(exercise_id) if exercise_id in UNSPLIT else []:
        if first_divergence(earlier, None, "small", learner) is not None:
            message = f"{exercise_id} uses {earlier}, which fails: fix {earlier} first.\n{message}"
            break
    return message


def _shrunk(exercise_id: str, seed: int, size: str, learner: Mapping[str, ModuleType] | None) -> str:
    """A smaller workload that still diverges (delta reduction of the op list), as a line to show."""
    reference = reference_modules()
    test = hybrid_modules(exercise_id, learner or learner_modules(), reference)
    deadline = time.monotonic() + SHRINK_BUDGET_S
    for name, ops, runner in _ops(exercise_id, seed, size):

        def fails(candidate: list, name=name, runner=runner) -> bool:
            want = _run(name, candidate, runner, reference)
            return compare(exercise_id, seed, want, _run(name, candidate, runner, test)) is not None

        if not fails(ops):
            continue
        body = ops[1:]
        chunk = max(1, len(body) // 2)
        while chunk >= 1 and time.monotonic() < deadline:
            i, changed = 0, False
            while i < len(body) and time.monotonic() < deadline:
                trial = body[:i] + body[i + chunk :]
                if trial and fails([ops[0], *trial]):
                    body, changed = trial, True
                else:
                    i += chunk
            if not changed:
                chunk //= 2
        small = [ops[0], *body]
        want = _run(name, small, runner, reference)
        again = compare(exercise_id, seed, want, _run(name, small, runner, test))
        text = repr(small)
        text = text if len(text) < 900 else text[:897] + "..."
        detail = again.message.split("\n")[1] if again and "\n" in again.message else ""
        return f"\n   A smaller workload that fails the same way ({len(body)} calls): {text}\n{detail}"
    return ""


def assert_lockstep(exercise_id: str) -> None:
    """The graded test's body: fail with the divergence message (pytest.fail, no traceback noise)."""
    import pytest

    message = verdict(exercise_id)
    stub = re.search(r"\((Exercise [^\n]*?not written yet: edit \S+, \S+\.)\)", message or "")
    if stub:  # a region still stubbed: the stub's own error, so the grader says "not attempted" and names it
        raise NotImplementedError(stub[1])
    if message:
        pytest.fail(message, pytrace=False)


def exercises_with_workloads() -> list[str]:
    """The exercises the harness covers, in course order."""
    return [i for i in EXERCISES if i in WORKLOADS]


def unwritten(exercise_id: str) -> list[str]:
    """The exercise's functions (for messages)."""
    return functions_of(exercise_id)

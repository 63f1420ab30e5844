"""The contract-clause table (tests/exercises/contract_clauses.py) stays complete and true.

Every exercise has rows; every row names a graded test that exists and carries the exercise's
marker; and an exercise's instruction comment (its contract) has not changed since its rows were
written: a new clause must come with a row (and a test).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import sys
from pathlib import Path

import pytest

from kvcourse.course.exercises import EXERCISES
from kvcourse.course.stubs import BEGIN_MARK

ROOT = Path(__file__).resolve().parents[1]
GRADED = ROOT / "tests" / "exercises"
sys.path.insert(0, str(GRADED))
from contract_clauses import CLAUSES, CONTRACT_DIGESTS, PENDING  # noqa: E402


def contract_comment(exercise_id: str) -> str:
    """The comment lines right above each `# BEGIN SOLUTION <id>` of the exercise, joined (its contract)."""
    lines = (ROOT / "solutions" / f"{EXERCISES[exercise_id].module}.py").read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if re.fullmatch(rf"\s*{re.escape(BEGIN_MARK)} {re.escape(exercise_id)}\s*", line):
            start = i
            while start > 0 and lines[start - 1].strip().startswith("#"):
                start -= 1
            blocks.append("\n".join(text.strip() for text in lines[start:i]))
    return "\n\n".join(blocks)


def contract_digest(exercise_id: str) -> str:
    """What CONTRACT_DIGESTS stores for an exercise."""
    return hashlib.sha256(contract_comment(exercise_id).encode()).hexdigest()[:12]


@functools.cache
def marked_tests(path: Path) -> dict[str, set[str]]:
    """Test name -> the exercise markers on it (decorators, a module's `pytestmark`, or `TestX = pytest.mark.exN_M(...)`)."""
    found: dict[str, set[str]] = {}
    body = ast.parse(path.read_text()).body
    module_marks = {  # `pytestmark = pytest.mark.exN_M` marks every test of the file
        ast.unparse(node.value).split(".")[-1]
        for node in body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and ast.unparse(node.value).startswith("pytest.mark.ex")
    }
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            marks = {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}
            found[node.name] = {m for m in marks if m.startswith("ex")} | module_marks
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = ast.unparse(node.value.func)
            for target in node.targets:
                if isinstance(target, ast.Name) and func.startswith("pytest.mark.ex"):
                    found[target.id] = {func.split(".")[-1]}
    return found


def test_every_exercise_has_rows():
    missing = [eid for eid in EXERCISES if eid not in PENDING and not CLAUSES.get(eid)]
    assert not missing, f"exercises with no contract-clause rows in tests/exercises/contract_clauses.py: {missing}"
    unknown = sorted(set(CLAUSES) - set(EXERCISES))
    assert not unknown, f"rows for exercises that do not exist: {unknown}"


@pytest.mark.parametrize("exercise_id", sorted(CLAUSES))
def test_every_row_names_a_marked_test(exercise_id):
    marker = EXERCISES[exercise_id].marker
    for clause, where in CLAUSES[exercise_id]:
        file_name, _, test_name = where.partition("::")
        path = GRADED / file_name
        assert path.exists(), f"{exercise_id} '{clause}': no graded test file {file_name}"
        tests = marked_tests(path)
        assert test_name in tests, f"{exercise_id} '{clause}': {file_name} has no test {test_name}"
        assert marker in tests[test_name], f"{exercise_id} '{clause}': {test_name} is not marked {marker}"


@pytest.mark.parametrize("exercise_id", sorted(CLAUSES))
def test_contract_unchanged_since_its_rows(exercise_id):
    assert contract_comment(exercise_id), f"Exercise {exercise_id} has no instruction comment above its region"
    digest = contract_digest(exercise_id)
    assert CONTRACT_DIGESTS.get(exercise_id) == digest, (
        f"Exercise {exercise_id}'s contract (its instruction comment) changed since its clause rows were written: "
        f"review its rows in tests/exercises/contract_clauses.py (a new clause needs a row and a graded test), "
        f"then set CONTRACT_DIGESTS[{exercise_id!r}] = {digest!r}"
    )

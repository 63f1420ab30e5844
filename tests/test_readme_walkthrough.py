"""The README's walk through exercise 0.1 shows what check("0.1") really prints, not what it once printed.

A copy of the course (stubs as shipped) gets the README's wrong first try, then the reference's answer;
one Python process (a notebook's kernel, say) runs check("0.1") before, between and after, and each
output must equal the README's block for that moment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcourse.course.stubs import stub_for

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
STUB = re.compile(
    r"(?P<indent>[ ]*)# TODO: Exercise 0\.1:[^\n]*\n\s*raise NotImplementedError\((?:[^()]|\([^()]*\))*\)\n"
)
SEPARATOR = "=== next check ==="


def readme_walkthrough() -> tuple[str, list[str]]:
    """The wrong first try's code and the three check() outputs, as the README quotes them."""
    text = README.read_text(encoding="utf-8")
    start = text.index('Before you write anything, `check("0.1")` says:')
    part = text[start : text.index("tests/test_readme_walkthrough.py", start)]
    wrong = re.search(r"```python\n(.*?)```", part, flags=re.S)
    outputs = re.findall(r"```\n(Running the tests of Exercise 0\.1 .*?)\n```", part, flags=re.S)
    assert wrong and len(outputs) == 3, "the README's walkthrough needs a ```python block and three check() outputs"
    return wrong[1], outputs


def region(code: str, source: str) -> str:
    """The learner's file with exercise 0.1's TODO and raise replaced by `code`."""
    found = STUB.search(source)
    assert found, "no stub of exercise 0.1 in the shipped kvcourse/memory.py"
    body = textwrap.indent(code.rstrip("\n") + "\n", found["indent"])
    return source[: found.start()] + body + source[found.end() :]


def reference_region() -> str:
    """The reference's code for 0.1, dedented."""
    source = (ROOT / "solutions" / "memory.py").read_text()
    found = re.search(r"# BEGIN SOLUTION 0\.1\n(.*?)\n\s*# END SOLUTION", source, flags=re.S)
    return textwrap.dedent(found[1])


@pytest.fixture()
def course_copy(tmp_path: Path) -> Path:
    """What check() reads: the package with the stubs as shipped, the solutions and the graded tests."""
    target = tmp_path / "course"
    for name in ("kvcourse", "solutions", "tests/exercises"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("conftest.py", "pyproject.toml"):
        shutil.copy2(ROOT / name, target / name)
    for solution in sorted((ROOT / "solutions").glob("[!_]*.py")):
        (target / "kvcourse" / solution.name).write_text(stub_for(solution)[0])
    return target


@pytest.mark.slow  # starts the grading worker once (torch, transformers, pytest)
def test_the_readme_walkthrough_is_what_check_prints(course_copy: Path) -> None:
    wrong, expected = readme_walkthrough()
    memory = course_copy / "kvcourse" / "memory.py"
    shipped = memory.read_text()
    states = [shipped, region(wrong, shipped), region(reference_region(), shipped)]
    script = f"""
        from pathlib import Path
        from kvcourse import check
        memory = Path({str(memory)!r})
        for number, text in enumerate({states!r}):
            memory.write_text(text)
            if number:
                print({SEPARATOR!r})
            check("0.1")
    """
    env = {k: v for k, v in os.environ.items() if k != "KVCOURSE_SOLUTIONS"} | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=course_copy,
        env=env | {"PYTHONPATH": str(course_copy)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    printed = [block.strip("\n") for block in done.stdout.split(SEPARATOR)]
    for moment, (want, got) in enumerate(zip(expected, printed)):
        assert got == want, f"README's walkthrough block {moment + 1} is stale:\n--- README\n{want}\n--- check()\n{got}"

"""Generate the learner's stubs in kvcourse/ from the reference modules in solutions/.

Usage:  python -m kvcourse.stubs          # rewrite kvcourse/<module>.py from solutions/
        python -m kvcourse.stubs --check  # exit 1 if any stub is out of date

A solution region is opened by a comment "# BEGIN", the word SOLUTION and the exercise id
(e.g. 2.1), and closed by "# END" and the same word (CONTRIBUTING.md shows one). The comment
lines just above a region are kept, so write the instructions there. In the stub the region
becomes a TODO line and `raise NotImplementedError("Exercise 2.1: ...")`.
(The marker words are assembled below rather than written out, so that no file of the learner's
package contains a marker.)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kvcourse.course.exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[2]
MARK = "SOL" + "UTION"
BEGIN_MARK, END_MARK = f"# BEGIN {MARK}", f"# END {MARK}"
BEGIN = re.compile(rf"^(?P<indent>\s*){BEGIN_MARK} (?P<id>\d+\.\d+)\s*$")
END = re.compile(rf"^\s*{END_MARK}\s*$")
DEF = re.compile(r"^(?P<indent>\s*)(?:async\s+)?(?:def|class)\s+(?P<name>\w+)")


class StubError(ValueError):
    """A solution file whose markers cannot be turned into stubs."""


def _enclosing(lines: list[str], index: int, indent: int) -> str:
    """Qualified name of the def/class around line `index` (for the error message)."""
    names: list[str] = []
    for line in reversed(lines[:index]):
        match = DEF.match(line)
        if match and len(match["indent"]) < indent:
            names.append(match["name"])
            indent = len(match["indent"])
    return ".".join(reversed(names)) or "<module>"


LINE_LENGTH = 120  # ruff's line length (pyproject.toml): stubs come out already formatted


def _raise_line(indent: str, message: str) -> list[str]:
    """The stub's `raise NotImplementedError(...)`, split the way `ruff format` would when it is long."""
    one_line = f'{indent}raise NotImplementedError("{message}")\n'
    if len(one_line) - 1 <= LINE_LENGTH:
        return [one_line]
    return [f"{indent}raise NotImplementedError(\n", f'{indent}    "{message}"\n', f"{indent})\n"]


def make_stub(source: str, filename: str = "<solution>") -> str:
    """Replace every BEGIN/END SOLUTION region by a TODO and a NotImplementedError."""
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    region: tuple[int, str] | None = None  # (line number, exercise id) of the open BEGIN
    module = Path(filename).stem
    for number, line in enumerate(lines, start=1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if region:
                raise StubError(f"{filename}:{number}: a BEGIN marker inside the region opened at line {region[0]}.")
            if begin["id"] not in EXERCISES:
                raise StubError(
                    f"{filename}:{number}: unknown exercise {begin['id']}; add it to kvcourse/exercises.py."
                )
            region = (number, begin["id"])
            indent = begin["indent"]
            exercise = EXERCISES[begin["id"]]
            where = _enclosing(lines, number - 1, len(indent))
            out.append(f"{indent}# TODO: Exercise {exercise.id}: write your code here, then delete the raise below.\n")
            out.extend(
                _raise_line(
                    indent,
                    f"Exercise {exercise.id} ({exercise.title}): not written yet: edit kvcourse/{module}.py, {where}.",
                )
            )
        elif end:
            if not region:
                raise StubError(f"{filename}:{number}: an END marker without a BEGIN marker.")
            region = None
        elif f"BEGIN {MARK}" in line or f"END {MARK}" in line:
            raise StubError(
                f"{filename}:{number}: malformed marker {line.strip()!r}; write '{BEGIN_MARK} N.M' or '{END_MARK}'."
            )
        elif not region:
            out.append(line)
    if region:
        raise StubError(f"{filename}:{region[0]}: the region of exercise {region[1]} is never closed by '{END_MARK}'.")
    return "".join(out)


def solution_files() -> list[Path]:
    """The reference modules (every .py in solutions/ except package files)."""
    return sorted(p for p in (ROOT / "solutions").glob("*.py") if not p.name.startswith("_"))


def stale_stubs() -> list[Path]:
    """Stubs in kvcourse/ that differ from what solutions/ generates."""
    stale = []
    for solution in solution_files():
        stub = ROOT / "kvcourse" / solution.name
        if not stub.exists() or stub.read_text() != make_stub(solution.read_text(), str(solution)):
            stale.append(stub)
    return stale


def main(argv: list[str] | None = None) -> int:
    """Write (or, with --check, verify) every stub."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stubs that are out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run: python -m kvcourse.stubs)")
        return 1 if stale else 0
    for solution in solution_files():
        stub = ROOT / "kvcourse" / solution.name
        stub.write_text(make_stub(solution.read_text(), str(solution)))
        print(f"wrote {stub.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

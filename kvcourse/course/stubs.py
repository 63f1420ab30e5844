"""Generate the learner's stubs in kvcourse/ from the reference modules in solutions/, never over a learner's work.

Usage:  python -m kvcourse stubs          # write kvcourse/<module>.py from solutions/ (refuses over your exercises)
        python -m kvcourse stubs --force  # replace edited files too, after saving a timestamped copy in backups/
        python -m kvcourse stubs --check  # exit 1 if any stub is out of date

A file whose exercise regions differ from the generated stub holds a learner's answers: it is left
alone (the message names the file and the exercises) unless --force, which first copies it to
backups/. `./course reset 2.4` (kvcourse/course/reset.py) restores one exercise instead.
The out-of-date check accepts a stub that matches either the working file or the committed one
(`git show HEAD:...`), and ignores regions a learner has written: so a learner's `./course test` stays green.

A solution region is opened by a comment "# BEGIN", the word SOLUTION and the exercise id
(e.g. 2.1), and closed by "# END" and the same word (CONTRIBUTING.md shows one). The comment
lines just above a region are kept, so write the instructions there. In the stub the region
becomes a TODO line and `raise NotImplementedError("Exercise 2.1: ...")`.
(The marker words are assembled below rather than written out, so that no file of the learner's
package contains a marker.)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvcourse.course.exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[2]
BACKUPS = ROOT / "backups"
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


@dataclass(frozen=True)
class Region:
    """Where one exercise's stub sits in a generated stub file: lines [start, end)."""

    exercise: str
    start: int
    end: int


def exercise_span(ids: list[str]) -> str:
    """["2.1", "2.2", "2.3", "7.1"] -> "2.1-2.3, 7.1": consecutive exercises of a chapter as one range."""
    runs: list[list[tuple[int, int]]] = []
    for chapter, number in sorted({tuple(int(part) for part in i.split(".")) for i in ids}):
        if runs and runs[-1][-1] == (chapter, number - 1):
            runs[-1].append((chapter, number))
        else:
            runs.append([(chapter, number)])
    name = "{}.{}".format
    return ", ".join(name(*run[0]) + (f"-{name(*run[-1])}" if len(run) > 1 else "") for run in runs)


def header(module: str, ids: list[str]) -> str:
    """The stub's first line: which exercises the file holds, and that only their TODO regions are the learner's."""
    several = len(set(ids)) > 1
    return (
        f"# kvcourse/{module}.py holds exercise{'s' * several} {exercise_span(ids)}: write only inside "
        f"{'their' if several else 'its'} TODO region{'s' * (len(ids) > 1)} (the rest is given).\n"
    )


def generate(source: str, filename: str = "<solution>") -> tuple[str, list[Region]]:
    """The stub text (opening with its header line), and where each exercise's TODO + raise landed in it."""
    lines = source.splitlines(keepends=True)
    module = Path(filename).stem
    ids = [m["id"] for line in lines if (m := BEGIN.match(line))]
    out: list[str] = [header(module, ids)] if ids else []
    regions: list[Region] = []
    region: tuple[int, str] | None = None  # (line number, exercise id) of the open BEGIN
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
            first = len(out)
            out.append(f"{indent}# TODO: Exercise {exercise.id}: write your code here, then delete the raise below.\n")
            out.extend(
                _raise_line(
                    indent,
                    f"Exercise {exercise.id} ({exercise.title}): not written yet: edit kvcourse/{module}.py, {where}.",
                )
            )
            regions.append(Region(exercise.id, first, len(out)))
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
    return _mark_unused_imports("".join(out)), regions


def make_stub(source: str, filename: str = "<solution>") -> str:
    """Replace every BEGIN/END SOLUTION region by a TODO and a NotImplementedError."""
    return generate(source, filename)[0]


NOQA_UNUSED = "  # noqa: F401"  # an import only the learner's code will use: no lint warning before they write it


def _mark_unused_imports(text: str) -> str:
    """Tag the imports that only the removed solutions used, so a learner's editor shows a clean stub."""
    tree = ast.parse(text)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    used |= {  # names re-exported through __all__ count as used (as ruff counts them)
        element.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List | ast.Tuple)
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets)
        for element in node.value.elts
        if isinstance(element, ast.Constant)
    }
    unused_lines = {
        alias.lineno
        for node in tree.body
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.module != "__future__")
        for alias in node.names
        if (alias.asname or alias.name).split(".")[0] not in used
    }
    lines = text.splitlines(keepends=True)
    for number in sorted(unused_lines):
        line = lines[number - 1]
        if "noqa" not in line:
            lines[number - 1] = line.rstrip("\n") + NOQA_UNUSED + "\n"
    return "".join(lines)


def locate(text: str, stub: str, regions: list[Region]) -> list[tuple[int, int]]:
    """For each stub region, the lines [start, end) of `text` that stand in its place (the learner's answer).

    The lines around a region are anchors: the learner's answer is whatever lies between the last line
    before the region and the first line after it that `text` still shares with the stub.
    """
    mine, theirs = text.splitlines(keepends=True), stub.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, mine, theirs, autojunk=False)
    to_mine = {j + k: i + k for i, j, n in matcher.get_matching_blocks() for k in range(n)}
    spans: list[tuple[int, int]] = []
    for region in regions:
        before = [to_mine[j] for j in range(region.start) if j in to_mine]
        after = [to_mine[j] for j in range(region.end, len(theirs)) if j in to_mine]
        start = max(before[-1] + 1 if before else 0, spans[-1][1] if spans else 0)
        end = max(start, after[0] if after else len(mine))
        spans.append((start, _dedent_end(mine, start, end, _indent(theirs[region.start]))))
    return spans


def _indent(line: str) -> int:
    """Leading spaces of a line."""
    return len(line) - len(line.lstrip(" "))


def _dedent_end(lines: list[str], start: int, end: int, indent: int) -> int:
    """Cut a span at its first line less indented than the region (code after the function is not the answer)."""
    for index in range(start, end):
        if lines[index].strip() and _indent(lines[index]) < indent:
            while index > start and not lines[index - 1].strip():
                index -= 1
            return index
    return end


def restore(text: str, stub: str, regions: list[Region], exercise_ids: set[str]) -> str:
    """`text` with the given exercises' regions put back to their stubs; every other line kept."""
    mine, theirs = text.splitlines(keepends=True), stub.splitlines(keepends=True)
    out: list[str] = []
    cursor = 0
    for region, (start, end) in zip(regions, locate(text, stub, regions)):
        if region.exercise in exercise_ids:
            out += mine[cursor:start] + theirs[region.start : region.end]
            cursor = end
    return "".join(out + mine[cursor:])


def edited_exercises(text: str, stub: str, regions: list[Region]) -> list[str]:
    """Exercises whose region in `text` a learner has written (not a stub, of this or an older wording), in file order."""
    mine, theirs = text.splitlines(keepends=True), stub.splitlines(keepends=True)
    edited = [
        region.exercise
        for region, (start, end) in zip(regions, locate(text, stub, regions))
        if mine[start:end] != theirs[region.start : region.end] and _learner_written(mine[start:end])
    ]
    return list(dict.fromkeys(edited))


def solution_files() -> list[Path]:
    """The reference modules (every .py in solutions/ except package files)."""
    return sorted(p for p in (ROOT / "solutions").glob("*.py") if not p.name.startswith("_"))


def stub_for(solution: Path) -> tuple[str, list[Region]]:
    """The stub that solutions/<module>.py generates, with its regions."""
    return generate(solution.read_text(), str(solution))


def committed_text(path: Path) -> str | None:
    """The file as committed (git HEAD), or None without git or outside a repository."""
    try:
        done = subprocess.run(
            ["git", "show", f"HEAD:{path.relative_to(ROOT).as_posix()}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


STUB_TEXT = re.compile(r'\s*# TODO: Exercise [^\n]*\n\s*raise NotImplementedError\(\s*"Exercise [^"\n]*"\s*\)\s*')


def _learner_written(lines: list[str]) -> bool:
    """A region is the learner's once it is more than a TODO line and a stub's raise (of any wording)."""
    return not STUB_TEXT.fullmatch("".join(lines))


def _in_date(text: str | None, stub: str, regions: list[Region]) -> bool:
    """The stub matches `text`, once regions a learner has written (no stub raise left) are put back."""
    if text is None:
        return False
    if text == stub:
        return True
    lines = text.splitlines(keepends=True)
    written = {
        r.exercise
        for r, (start, end) in zip(regions, locate(text, stub, regions))
        if _learner_written(lines[start:end])
    }
    return bool(written) and restore(text, stub, regions, written) == stub


def stale_stubs() -> list[Path]:
    """Stubs in kvcourse/ out of date with solutions/: neither the working nor the committed file matches."""
    stale = []
    for solution in solution_files():
        stub_path = ROOT / "kvcourse" / solution.name
        stub, regions = stub_for(solution)
        working = stub_path.read_text() if stub_path.exists() else None
        if not (_in_date(working, stub, regions) or _in_date(committed_text(stub_path), stub, regions)):
            stale.append(stub_path)
    return stale


def backup(path: Path) -> Path:
    """Copy `path` to backups/<name>.<timestamp>.bak (never overwriting an earlier copy) and return the copy."""
    BACKUPS.mkdir(exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    copy, n = BACKUPS / f"{path.name}.{stamp}.bak", 1
    while copy.exists():
        copy, n = BACKUPS / f"{path.name}.{stamp}-{n}.bak", n + 1
    copy.write_text(path.read_text())
    return copy


def write_stubs(force: bool = False) -> int:
    """Write every stub; leave files with a learner's exercises alone unless `force` (then back them up)."""
    refused = 0
    for solution in solution_files():
        path = ROOT / "kvcourse" / solution.name
        stub, regions = stub_for(solution)
        current = path.read_text() if path.exists() else None
        name = path.relative_to(ROOT)
        if current == stub:
            print(f"up to date: {name}")
            continue
        edited = edited_exercises(current, stub, regions) if current is not None else []
        edited.sort(key=lambda e: tuple(int(part) for part in e.split(".")))
        if edited and not force:
            refused += 1
            print(
                f"NOT replaced: {name}: your code for exercise{'s' * (len(edited) > 1)} {', '.join(edited)} "
                "differs from the stub. Nothing was changed. To restore one exercise: ./course reset ID; "
                "to replace the whole file: python -m kvcourse stubs --force (a copy goes to backups/ first)."
            )
            continue
        if current is not None and current != committed_text(path):
            print(f"saved a copy of {name} in {backup(path).relative_to(ROOT)}")
        path.write_text(stub)
        print(f"wrote {name}")
    return 1 if refused else 0


def main(argv: list[str] | None = None) -> int:
    """Write (or, with --check, verify) every stub."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse stubs", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stubs that are out of date")
    parser.add_argument(
        "--force", action="store_true", help="replace files holding your exercises too (a copy goes to backups/)"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)} (run: python -m kvcourse stubs)")
        return 1 if stale else 0
    return write_stubs(force=args.force)


if __name__ == "__main__":
    sys.exit(main())

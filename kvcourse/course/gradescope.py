"""Grade a class on Gradescope: results.json in its schema, and the autograder zip that produces it.

    python -m kvcourse.grade --gradescope results.json     # grade kvcourse/ and write Gradescope's file
    python -m kvcourse.course.gradescope build autograder.zip   # the zip to upload as the autograder
    python -m kvcourse.course.gradescope place SUBMISSION_DIR   # put a student's exercise modules in place

The zip holds the course with fresh stubs (never the reference: a submission could import it), a
`setup.sh` that installs it, and a `run_autograder` that places the submitted modules and grades them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import zipfile
from pathlib import Path

from kvcourse.course.exercises import EXERCISE_MODULES, EXERCISES
from kvcourse.course.grade import CORRECT, NOT_ATTEMPTED, SKIPPED, ExerciseResult

ROOT = Path(__file__).resolve().parents[2]
ICONS = {"correct": "✅", "incorrect": "❌", "not attempted": "⏳", "skipped": "⏭️"}

# What the autograder needs of the course: the package, the graded tests and what they import.
SOURCES = ["pyproject.toml", "README.md", "conftest.py", "kvcourse", "tests/exercises"]

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, when the autograder image is built: install the course.
set -euo pipefail
cd "$(dirname "$0")"
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup.sh: kvcourse needs Python 3.11+, not $(python3 --version 2>&1): choose Ubuntu 24.04 (Python 3.12)." >&2
    exit 1
fi
python3 -m pip --version >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq python3-pip; }
export PIP_BREAK_SYSTEM_PACKAGES=1  # a throwaway container: install into its system Python (PEP 668)
# Gradescope has no GPU: take torch's CPU build instead of gigabytes of CUDA libraries.
python3 -m pip install torch --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -e .
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission: put the student's exercise modules in place, grade them,
# write results.json. KVCOURSE_AUTOGRADER_ROOT stands in for /autograder (tests use a temporary one).
set -euo pipefail
AUTOGRADER="${KVCOURSE_AUTOGRADER_ROOT:-/autograder}"
cd "$(dirname "$0")"
export HF_HUB_OFFLINE=1
unset KVCOURSE_SOLUTIONS
python3 -m kvcourse.course.gradescope place "$AUTOGRADER/submission"
mkdir -p "$AUTOGRADER/results"
# The grade exits 1 when an exercise fails; Gradescope reads the scores from results.json either way.
python3 -m kvcourse.grade --gradescope "$AUTOGRADER/results/results.json" || true
"""


def feedback(result: ExerciseResult) -> str:
    """What check() would say about this exercise, as text for the student's Gradescope page."""
    head = f"{ICONS[result.status]} Exercise {result.id} ({result.title}):"
    counts = f" {result.passed}/{result.total} tests pass." if result.total else ""
    if result.status == CORRECT:
        return f"{head} correct.{counts}"
    if result.status == NOT_ATTEMPTED:
        return f"{head} not attempted: {result.path} still raises NotImplementedError under its TODO."
    if result.status == SKIPPED:
        return f"{head} skipped: {result.message}"
    lines = [f"{head} not yet.{counts}", f"   What failed: {result.message}"]
    if result.hint:
        lines.append(f"   Hint: {result.hint}")
    return "\n".join(lines)


def results_json(results: list[ExerciseResult], points: float = 1.0) -> dict:
    """Gradescope's results.json: one test per exercise, scored by the share of its tests that pass."""
    tests = []
    for result in results:
        share = result.passed / result.total if result.total else 0.0
        if result.status == SKIPPED:
            share = 1.0  # a test skipped for want of a GPU is not the student's fault
        tests.append(
            {
                "name": f"Exercise {result.id}: {result.title}",
                "number": result.id,
                "score": round(points * share, 4),
                "max_score": points,
                "status": "passed" if result.status in (CORRECT, SKIPPED) else "failed",
                "output": feedback(result),
                "visibility": "visible",
            }
        )
    done = sum(r.status == CORRECT for r in results)
    return {
        "score": round(sum(t["score"] for t in tests), 4),
        "output": f"{done} of {len(results)} exercises correct.",
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
    }


def write_results(path: Path, results: list[ExerciseResult]) -> None:
    """Write results.json where Gradescope looks for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results_json(results), indent=2, ensure_ascii=False) + "\n")


def _submitted(submission: Path, module: str) -> Path | None:
    """The student's <module>.py: kvcourse/<module>.py if the submission is the repository, else a loose file."""
    found = [
        p
        for p in submission.rglob(f"{module}.py")
        if not {"solutions", ".venv", "site-packages", "__MACOSX"} & set(p.relative_to(submission).parts)
    ]
    found.sort(key=lambda p: (p.parent.name != "kvcourse", len(p.parts), str(p)))
    return found[0] if found else None


def place(submission: Path, course: Path = ROOT) -> list[str]:
    """Copy the exercise modules found in a submission over the stubs in course/kvcourse; say which."""
    if not submission.is_dir():
        raise ValueError(f"submission folder {submission} does not exist: pass the folder Gradescope unpacked.")
    placed = []
    for module in sorted(EXERCISE_MODULES):
        source = _submitted(submission, module)
        if source is not None:
            shutil.copyfile(source, course / "kvcourse" / f"{module}.py")
            placed.append(f"kvcourse/{module}.py")
    return placed


def _course_files() -> list[tuple[Path, str]]:
    """(file, name in the zip) for every course file the autograder needs, caches left out."""
    files = []
    for entry in SOURCES:
        path = ROOT / entry
        for file in sorted([path] if path.is_file() else path.rglob("*")):
            if file.is_file() and "__pycache__" not in file.parts and file.suffix != ".pyc":
                files.append((file, file.relative_to(ROOT).as_posix()))
    return files


def build(out: Path) -> list[str]:
    """Write the autograder zip: the course with fresh stubs, setup.sh and run_autograder at its root."""
    from kvcourse.course.stubs import stub_for

    if out.suffix != ".zip":
        raise ValueError(
            f"{out}: the autograder must be a .zip file (Gradescope's format); name it e.g. autograder.zip."
        )
    stubs = {f"kvcourse/{m}.py": stub_for(ROOT / "solutions" / f"{m}.py")[0] for m in EXERCISE_MODULES}
    out.parent.mkdir(parents=True, exist_ok=True)
    names = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in [("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)]:
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16  # executable, as Gradescope runs them
            archive.writestr(info, text)
            names.append(name)
        for file, name in _course_files():
            if name in stubs:
                archive.writestr(name, stubs[name])  # the student's file, untouched: never the instructor's
            else:
                archive.write(file, name)
            names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    """`build OUT.zip` or `place SUBMISSION_DIR`."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse.course.gradescope", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="write the Gradescope autograder zip").add_argument("out", type=Path)
    commands.add_parser("place", help="copy a submission's exercise modules into kvcourse/").add_argument(
        "submission", type=Path
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            names = build(args.out)
            print(
                f"wrote {args.out}: {len(names)} files; upload it as the assignment's autograder (Ubuntu 24.04 base image)."
            )
        else:
            placed = place(args.submission)
            print(f"placed {', '.join(placed) or 'nothing'}; {len(EXERCISES)} exercises will be graded.")
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())

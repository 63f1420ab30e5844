"""Grade a class on Gradescope (or any folder of submitted files): the autograder zip and the sandboxed grading.

    python -m kvcourse.course.gradescope build autograder.zip          # the zip to upload as the autograder
    python -m kvcourse.course.gradescope grade SUBMISSION_DIR --out results.json   # grade one submission, safely
    python -m kvcourse.course.gradescope place SUBMISSION_DIR --into COURSE_COPY   # write its modules, stubs for the rest

The zip holds exactly the tracked course files the grading needs, with fresh stubs (never the reference: a
submission could import it), the reference's observations (grader/reference.json, private to root), a
`setup.sh` that installs it and a `run_autograder` that runs `grade` on /autograder/submission. `grade` reads
the submitted modules as text and grades them through the trust boundary (kvcourse/course/boundary.py): the
submitted code runs only in unprivileged children that report observations, and this process compares them
with the reference's, scores them and always writes results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvcourse.course.exercises import EXERCISE_MODULES, EXERCISES, get
from kvcourse.course.results import (  # noqa: F401  (feedback, results_json, write_results: this module's API)
    ExerciseResult,
    fallback_results,
    feedback,
    results_json,
    write_json,
    write_results,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "README.md", "conftest.py", "kvcourse", "tests/exercises"]  # what grading needs
NEVER_SHIPPED = (".orig", ".rej", ".bak", ".pyc", ".swp", "~")  # editor and merge leftovers
SKIPPED_FOLDERS = {"solutions", ".venv", "site-packages", "__MACOSX", ".ipynb_checkpoints", ".git", "__pycache__"}
MAX_MODULE_BYTES = 512 << 10  # a submitted module larger than this is not read (the reference's largest: 40 kB)
MAX_DEPTH = 8  # folders deeper than this in a submission are not searched (a module sits at most a few deep)
MAX_ENTRIES = 20_000  # files and folders looked at in one submission
REFERENCE = "grader/reference.json"  # in an autograder: the reference's observations, readable by root only
OBSERVER_FILE = "grader/observer.py"  # in an autograder built with an observer file instead of a module

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
# The user the submitted code runs as: it owns nothing, so it cannot write the results or the course.
id kvgrader >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin kvgrader
# The interpreter, its packages and the course readable to kvgrader; the tests and the reference's observations not.
chmod -R a+rX . $(python3 -c 'import site; print(" ".join(site.getsitepackages()))')
chmod -R go= grader tests
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for each submission: grade it through the boundary, write results.json (always).
# KVCOURSE_AUTOGRADER_ROOT stands in for /autograder (tests use a temporary one).
set -uo pipefail
AUTOGRADER="${KVCOURSE_AUTOGRADER_ROOT:-/autograder}"
RESULTS="$AUTOGRADER/results/results.json"
cd "$(dirname "$0")"
unset KVCOURSE_SOLUTIONS
export HF_HUB_OFFLINE=1
mkdir -p "$AUTOGRADER/results"
rm -f "$RESULTS"
# The grader bounds its own run (KVCOURSE_GRADE_TIMEOUT_S, 540 s by default); this bounds the grader.
# KVCOURSE_EXERCISES (ids separated by spaces) grades only some exercises: the tests' shortcut.
timeout --kill-after=30 "${KVCOURSE_AUTOGRADER_TIMEOUT_S:-620}" \\
    python3 -m kvcourse.course.gradescope grade "$AUTOGRADER/submission" --out "$RESULTS" \\
    ${KVCOURSE_EXERCISES:+--exercises $KVCOURSE_EXERCISES}
status=$?
if [ ! -s "$RESULTS" ]; then
    printf '{"score": 0.0, "output": "The grader failed (exit code %s) before it wrote any result, not your code. Tell your instructor.", "tests": []}\\n' "$status" > "$RESULTS"
    exit 1
fi
exit "$status"
"""


class GraderBroken(RuntimeError):
    """The grader itself failed (not the submission): a fallback results.json was written."""


def find_submission(submission: Path) -> tuple[dict[str, str], list[str]]:
    """The exercise modules in a submission ({module: text}) and what was ignored, in words.

    Regular files only, read without following a link: a symlink, a device, a folder named like a module or a
    file over MAX_MODULE_BYTES is ignored (and said). kvcourse/<module>.py wins over a loose <module>.py.
    """
    if not submission.is_dir():
        raise ValueError(f"submission folder {submission} does not exist: pass the folder Gradescope unpacked.")
    wanted = {f"{m}.py": m for m in EXERCISE_MODULES}
    candidates, ignored, others = _walk(submission, wanted)
    found = {}
    for module, paths in sorted(candidates.items()):
        paths.sort(key=lambda p: (p.parent.name != "kvcourse", len(p.parts), str(p)))
        for path in paths:
            why = _unreadable(path)
            shown = path.relative_to(submission).as_posix()
            if why:
                ignored.append(f"{shown} ({why})")
            elif module in found:
                ignored.append(f"{shown} (another {module}.py was taken)")
            else:
                found[module] = path.read_bytes().decode("utf-8-sig")  # a Windows editor's BOM is not code
    if others:
        ignored.append(f"{others} other file(s): only the exercise modules are graded")
    return found, [_printable(note) for note in ignored]


def _printable(text: str) -> str:
    """A note about a file whose name is not UTF-8 (or holds a newline), safe to print and to store."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\n", "\\n")


def _walk(submission: Path, wanted: dict[str, str]) -> tuple[dict[str, list[Path]], list[str], int]:
    """Candidate files per module, notes, and the count of other files: no recursion, bounded depth and size."""
    candidates: dict[str, list[Path]] = {}
    ignored, others, seen = [], 0, 0
    stack = [(submission, 0)]
    while stack:
        here, depth = stack.pop()
        try:
            with os.scandir(here) as listing:
                entries = list(listing)
        except OSError as error:
            ignored.append(f"{here.relative_to(submission)} (could not be listed: {error.strerror})")
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            seen += 1
            if seen > MAX_ENTRIES:
                ignored.append(f"everything after the first {MAX_ENTRIES} files and folders")
                return candidates, ignored, others
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                if entry.name in wanted:
                    ignored.append(f"{path.relative_to(submission)} (a folder, not a file)")
                elif depth >= MAX_DEPTH:
                    ignored.append(f"{path.relative_to(submission)} (deeper than {MAX_DEPTH} folders: not searched)")
                elif entry.name not in SKIPPED_FOLDERS:
                    stack.append((path, depth + 1))
            elif entry.name in wanted:
                candidates.setdefault(wanted[entry.name], []).append(path)
            else:
                others += 1
    return candidates, ignored, others


def _unreadable(path: Path) -> str | None:
    """Why a submitted file is not taken (a link, not a regular file, too large, not UTF-8 text), or None."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "a link: submit the file itself"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_size > MAX_MODULE_BYTES:
        return f"larger than {MAX_MODULE_BYTES >> 10} kB"
    try:
        path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    return None


def pristine_stubs(course: Path = ROOT) -> dict[str, str]:
    """Every exercise module's stub: grader/stubs/ in an autograder, else generated from solutions/ here."""
    shipped = course / "grader" / "stubs"
    if all((shipped / f"{m}.py").is_file() for m in EXERCISE_MODULES):
        return {m: (shipped / f"{m}.py").read_text() for m in EXERCISE_MODULES}
    from kvcourse.course.stubs import stub_for

    solutions = ROOT / "solutions"
    if not all((solutions / f"{m}.py").is_file() for m in EXERCISE_MODULES):
        raise GraderBroken(f"no stubs to grade against: neither {shipped} nor {solutions} holds every exercise module.")
    return {m: stub_for(solutions / f"{m}.py")[0] for m in EXERCISE_MODULES}


def place(submission: Path, course: Path = ROOT) -> list[str]:
    """Write every exercise module of course/kvcourse: the submitted one if any, else its stub; say what was ignored."""
    found, ignored = find_submission(submission)
    stubs = pristine_stubs(course)
    for module in sorted(EXERCISE_MODULES):
        (course / "kvcourse" / f"{module}.py").write_text(found.get(module, stubs[module]))
    for note in ignored:
        print(f"ignored {note}")
    return [f"kvcourse/{m}.py" for m in sorted(found)]


# ----------------------------------------------------------------------------------------------------------
# The build: exactly the tracked files grading needs, checked for the reference.


def _tracked(root: Path = ROOT) -> list[str]:
    """The course files grading needs, from `git ls-files` (so nothing untracked, ignored or generated ships)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--", *SOURCES], cwd=root, capture_output=True, check=True, timeout=60
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError) as error:
        raise ValueError(f"build needs a git clone of the course (git ls-files failed: {error}).") from error
    names = [n for n in listed.split("\0") if n and _shippable(n)]
    return sorted(n for n in names if (root / n).is_file() and not (root / n).is_symlink())


def _shippable(name: str) -> bool:
    """Not a cache, a JupyterLab checkpoint or an editor/merge leftover (scheduler.py.orig)."""
    parts = name.split("/")
    return not ({"__pycache__", ".ipynb_checkpoints"} & set(parts) or name.endswith(NEVER_SHIPPED))


def _solution_bodies() -> list[str]:
    """The reference's exercise regions (three lines or more), whitespace-normalized, to find a copy anywhere."""
    from kvcourse.course.stubs import BEGIN, END

    bodies = []
    for module in sorted(EXERCISE_MODULES):
        lines, inside = (ROOT / "solutions" / f"{module}.py").read_text().splitlines(), None
        for line in lines:
            if BEGIN.match(line):
                inside = []
            elif END.match(line) and inside is not None:
                code = [x.strip() for x in inside if x.strip() and not x.strip().startswith("#")]
                if len(code) >= 3 and sum(map(len, code)) >= 80:
                    bodies.append("\n".join(code))
                inside = None
            elif inside is not None:
                inside.append(line)
    return bodies


def _leak(name: str, text: str, bodies: list[str]) -> str | None:
    """Why a file must not ship (it holds a solution region or a copy of the reference), or None."""
    from kvcourse.course.stubs import BEGIN

    opened = next((line for line in text.splitlines() if BEGIN.match(line)), None)
    if opened is not None:
        return f"{name} holds a solution region ({opened.strip()} ...)"
    normalized = "\n".join(x.strip() for x in text.splitlines() if x.strip() and not x.strip().startswith("#"))
    for module in EXERCISE_MODULES:
        if text.strip() == (ROOT / "solutions" / f"{module}.py").read_text().strip():
            return f"{name} is a copy of solutions/{module}.py"
    for body in bodies:
        if body in normalized:
            return f"{name} contains reference code of an exercise (it starts {body.splitlines()[0]!r})"
    return None


def course_files() -> dict[str, bytes]:
    """{name: content} of everything the autograder needs: tracked files, fresh stubs, the grader's own files."""
    from kvcourse.course.static_check import POLICY_FILE, derive_policy

    stubs = pristine_stubs(ROOT) if (ROOT / "solutions").is_dir() else {}
    files = {name: (ROOT / name).read_bytes() for name in _tracked()}
    for module, text in stubs.items():
        files[f"kvcourse/{module}.py"] = text.encode()  # the student's file, untouched: never the instructor's
        files[f"grader/stubs/{module}.py"] = text.encode()  # what a module left out is graded as
    policy = json.dumps(derive_policy(ROOT).to_json(), indent=1) + "\n"
    files[f"kvcourse/course/{POLICY_FILE.name}"] = policy.encode()
    bodies = _solution_bodies()
    for name, data in files.items():
        if name.endswith((".py", ".md", ".toml", ".txt", ".json", ".cfg")):
            why = _leak(name, data.decode(errors="replace"), bodies)
            if why:
                raise ValueError(f"refusing to build: {why}. Remove it (or `git rm` it) and build again.")
    return files


def build(out: Path, observer: str | None = None, exercise_ids: list[str] | None = None) -> list[str]:
    """Write the autograder zip: the course files, the reference's observations, setup.sh and run_autograder."""
    from kvcourse.course import boundary

    if out.suffix != ".zip":
        raise ValueError(
            f"{out}: the autograder must be a .zip file (Gradescope's format); name it e.g. autograder.zip."
        )
    files = course_files()
    observer = observer or boundary.DEFAULT_OBSERVER
    ids = exercise_ids or list(EXERCISES)
    reference = boundary.reference_observations(ids, observer)
    shipped = observer
    if observer.endswith(".py"):  # an observer file (the tests' stand-in) ships beside the observations
        files[OBSERVER_FILE] = Path(observer).read_bytes()
        shipped = OBSERVER_FILE
    with tempfile.TemporaryDirectory() as folder:
        boundary.save_reference(Path(folder) / "reference.json", reference, shipped, "small")
        files[REFERENCE] = (Path(folder) / "reference.json").read_bytes()
    out.parent.mkdir(parents=True, exist_ok=True)
    names = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in [("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)]:
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16  # executable, as Gradescope runs them
            archive.writestr(info, text)
            names.append(name)
        for name in sorted(files):
            info = zipfile.ZipInfo(name)
            private = name.startswith(("grader/", "tests/"))
            info.external_attr = (0o600 if private else 0o644) << 16
            archive.writestr(info, files[name], zipfile.ZIP_DEFLATED)
            names.append(name)
    return names


# ----------------------------------------------------------------------------------------------------------
# Grading one submission.


def grader_setup(observer: str | None = None, reference=None) -> tuple[str, dict | None, str]:
    """(observer, reference observations or None to compute them, size): the autograder's, else this clone's."""
    from kvcourse.course import boundary

    shipped = ROOT / REFERENCE
    if observer is None and reference is None and shipped.is_file():
        reference, observer, size = boundary.load_reference(shipped)
        return (str(ROOT / observer) if observer.endswith(".py") else observer), reference, size
    return observer or boundary.DEFAULT_OBSERVER, reference, "small"


def _early_notes(found: dict[str, str]) -> list[str]:
    """The static check's words on each submitted module: help only, the boundary does not depend on it."""
    from kvcourse.course.static_check import check_source, explain, load_policy

    notes = []
    try:
        policy = load_policy(ROOT)
        for module, text in sorted(found.items()):
            refusals = check_source(text, f"kvcourse/{module}.py", policy, f"kvcourse.{module}")
            if refusals:
                notes.append(f"kvcourse/{module}.py: {explain(refusals)}")
    except Exception:  # a module too odd to parse: the boundary grades it anyway
        pass
    return notes


def grade_submission(
    submission: Path | None,
    out: Path,
    exercise_ids: list[str] | None = None,
    limits=None,
    log=print,
    observer: str | None = None,
    reference=None,
    texts: dict[str, str] | None = None,
) -> dict:
    """Grade a submission folder (or module `texts`) through the boundary; write results.json to `out`, always.

    A results.json saying the grading did not finish is written first, so one exists whatever happens next.
    Raises GraderBroken (after writing a results.json that says why) when the grader failed or refused to run.
    """
    from kvcourse.course import boundary

    exercises = [get(i) for i in exercise_ids] if exercise_ids else list(EXERCISES.values())
    write_json(out, fallback_results("the grading did not finish.", exercises))
    if texts is None:
        found, ignored = find_submission(submission)  # a missing folder is the caller's error (ValueError)
    else:
        found, ignored = dict(texts), []
    try:
        observer, reference, size = grader_setup(observer, reference)
        log(f"placed {', '.join(f'kvcourse/{m}.py' for m in sorted(found)) or 'nothing'}; {len(exercises)} exercises will be graded.")  # fmt: skip
        for note in ignored:
            log(f"ignored {note}")
        early = _early_notes(found)
        for note in early:
            log(f"note: {note}")
        results, isolation = boundary.grade(
            found, pristine_stubs(ROOT), [ex.id for ex in exercises], observer, reference, size, limits, ROOT, log
        )
        notes = [f"Graded: {', '.join(f'kvcourse/{m}.py' for m in sorted(found)) or 'no exercise module'}"
                 " (every module not submitted is graded as its stub)."]  # fmt: skip
        notes += [f"Ignored: {note}." for note in ignored]
        notes += [f"Note: {note}" for note in early]
        notes.append(f"Isolation: {isolation}")
        data = results_json(results, note="\n".join(notes))
        write_json(out, data)
        return data
    except boundary.Refused as error:
        write_json(out, fallback_results(f"the grader refused to run: {error}", exercises))
        raise GraderBroken(f"the grader refused to run: {error}") from error
    except Exception as error:
        write_json(out, fallback_results(f"{type(error).__name__}: {error}", exercises))
        raise GraderBroken(f"the grader failed: {type(error).__name__}: {error}") from error


def main(argv: list[str] | None = None) -> int:
    """`build OUT.zip`, `grade SUBMISSION_DIR --out results.json` or `place SUBMISSION_DIR`."""
    parser = argparse.ArgumentParser(prog="python -m kvcourse.course.gradescope", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_ = commands.add_parser("build", help="write the Gradescope autograder zip")
    build_.add_argument("out", type=Path)
    build_.add_argument("--observer", help="the observer module (default: the lockstep harness)")
    grade = commands.add_parser("grade", help="grade a folder of submitted modules through the boundary")
    grade.add_argument("submission", type=Path)
    grade.add_argument("--out", type=Path, required=True, help="where to write results.json")
    grade.add_argument("--exercises", nargs="*", help="exercise ids (default: all)")
    place_ = commands.add_parser("place", help="write a submission's exercise modules (stubs for the rest)")
    place_.add_argument("submission", type=Path)
    place_.add_argument("--into", type=Path, help="the course folder to write into (default: this one)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            names = build(args.out, args.observer)
            print("\n".join(f"  {name}" for name in names))
            print(f"wrote {args.out}: the {len(names)} files above; upload it as the assignment's autograder "
                  "(Ubuntu 24.04 base image).")  # fmt: skip
        elif args.command == "grade":
            for exercise_id in args.exercises or []:
                if exercise_id not in EXERCISES:
                    parser.error(f"unknown exercise {exercise_id!r}: choose from {', '.join(EXERCISES)}.")
            data = grade_submission(args.submission, args.out, args.exercises or None)
            print(f"score {data['score']} of {len(data['tests'])}; wrote {args.out}")
        else:
            if args.into is None and (ROOT / "solutions").is_dir():
                parser.error(
                    "place would overwrite the exercise modules of this clone (yours or an instructor's): pass "
                    "--into DIR, a copy of the course, or grade the folder with `grade SUBMISSION_DIR --out FILE`."
                )
            placed = place(args.submission, args.into or ROOT)
            print(f"placed {', '.join(placed) or 'nothing'}; {len(EXERCISES)} exercises will be graded.")
    except GraderBroken as error:
        print(f"gradescope: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        if args.command == "grade":  # even a missing submission folder leaves a results.json
            write_json(args.out, fallback_results(str(error)))
            print(f"gradescope: {error}", file=sys.stderr)
            return 0
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())

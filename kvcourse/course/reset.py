"""Put one exercise back to its stub, keeping every other line of the learner's file and a copy of it.

    ./course reset 2.4                  # or: python -m kvcourse.course.reset 2.4
    from kvcourse import reset; reset("2.4")

Only the region(s) of that exercise change; your other exercises, helpers and comments stay. The file
as it was goes to backups/<file>.<timestamp>.bak first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcourse.course.exercises import EXERCISES, get
from kvcourse.course.results import id_key
from kvcourse.course.stubs import ROOT, backup, edited_exercises, restore, stub_for


def reset(exercise_id: str) -> Path | None:
    """Restore exercise `exercise_id` to its stub in kvcourse/; return the backup made (None: nothing to do)."""
    exercise = get(exercise_id)
    path = ROOT / "kvcourse" / f"{exercise.module}.py"
    stub, regions = stub_for(ROOT / "solutions" / f"{exercise.module}.py")
    if not path.exists():
        path.write_text(stub)
        print(f"{path.relative_to(ROOT)} was missing: wrote the stub file.")
        return None
    current = path.read_text()
    restored = restore(current, stub, regions, {exercise.id})
    if restored == current:
        print(f"Exercise {exercise.id} is already the stub in {path.relative_to(ROOT)}: nothing changed.")
        return None
    try:
        compile(restored, str(path), "exec")
    except SyntaxError as error:
        raise ValueError(
            f"could not tell where Exercise {exercise.id} ends in {path.relative_to(ROOT)} (the result would not "
            f"parse: line {error.lineno}); nothing changed. Replace its code by hand with the TODO and raise from "
            f"a fresh stub (python -m kvcourse stubs --force writes the whole file, after a backup)."
        ) from error
    copy = backup(path)
    path.write_text(restored)
    others = sorted((e for e in edited_exercises(restored, stub, regions) if e != exercise.id), key=id_key)
    kept = f" Your other exercises ({', '.join(others)}) are untouched." if others else ""
    print(
        f"Exercise {exercise.id} ({exercise.title}) is back to its stub in {path.relative_to(ROOT)}.{kept}\n"
        f"Your previous file is saved as {copy.relative_to(ROOT)}."
    )
    return copy


def main(argv: list[str] | None = None) -> int:
    """`python -m kvcourse.course.reset ID [ID ...]`."""
    parser = argparse.ArgumentParser(prog="./course reset", description=__doc__.splitlines()[0])
    parser.add_argument("exercises", nargs="*", help="exercise ids such as 2.4 (none: list them)")
    args = parser.parse_args(argv)
    if not args.exercises:
        print("Exercises you can reset (./course reset ID):")
        for exercise in sorted(EXERCISES.values(), key=lambda e: id_key(e.id)):
            print(f"  {exercise.id:<5} {exercise.title} ({exercise.path})")
        return 0
    try:
        for exercise_id in sorted(dict.fromkeys(args.exercises), key=id_key):
            reset(exercise_id)
    except ValueError as error:
        print(f"reset: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

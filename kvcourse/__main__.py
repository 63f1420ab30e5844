"""`python -m kvcourse COMMAND [ARGS]`: the course's commands; each lives in kvcourse/course/.

python -m kvcourse grade [IDS] [--solutions] [--json]   grade your exercises (kvcourse/course/grade.py)
python -m kvcourse stubs [--check | --force]            regenerate the stubs (kvcourse/course/stubs.py)
python -m kvcourse reset ID                              put one exercise back to its stub (kvcourse/course/reset.py)
python -m kvcourse generate [--model M] [--json] PROMPT  one answer through your engine (kvcourse/course/generate.py)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "grade": "kvcourse.course.grade",
    "stubs": "kvcourse.course.stubs",
    "reset": "kvcourse.course.reset",
    "generate": "kvcourse.course.generate",
}


def main(argv: list[str] | None = None) -> int:
    """Run one command with the rest of the arguments; without a known command, say which exist."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        asked = f"unknown command {argv[0]!r}; " if argv and argv[0] not in ("-h", "--help") else ""
        print(f"{asked}usage: python -m kvcourse {{{','.join(COMMANDS)}}} [ARGS]\n{__doc__}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

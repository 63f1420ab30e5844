"""Lockstep sweep: the comparison with the reference, ALONE, must catch every mutant of its own exercise.

scripts/mutation_check.py asks whether an exercise's graded tests (named tests + lockstep) catch a mutant.
That hides a lockstep workload that cannot fail (every call raising on both sides, say): the named tests
catch the mutant anyway. Here each mutant is loaded beside the clean reference, in this process, and only
`lockstep.verdict(exercise, learner=...)` judges it: "caught" when it names a divergence.

    python scripts/lockstep_sweep.py              # every mutant of every exercise the harness covers
    python scripts/lockstep_sweep.py --only 4.7   # one exercise
    python scripts/lockstep_sweep.py --min-rate 0.95   # exit 1 below this share caught (default 1.0)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # 5.4's kernel on the CPU: set before triton is imported
os.environ.setdefault("KVCOURSE_SOLUTIONS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from mutation_check import ALL_MUTANTS, Mutant, apply  # noqa: E402

from kvcourse.course import lockstep  # noqa: E402
from kvcourse.course.exercises import EXERCISES  # noqa: E402
from kvcourse.course.lockstep.core import _load_file, reference_modules  # noqa: E402


def judge(mutant: Mutant, folder: Path, number: int) -> str | None:
    """The lockstep verdict on the reference with this one mutant applied (None: it survived)."""
    module = EXERCISES[mutant.exercise].module
    path = folder / f"{module}_{number}.py"
    path.write_text(apply(mutant, (ROOT / "solutions" / f"{module}.py").read_text()))
    learner = {**reference_modules(), module: _load_file(f"_kvcourse_sweep_{module}_{number}", path)}
    return lockstep.verdict(mutant.exercise, learner=learner)


def main(argv: list[str] | None = None) -> int:
    """Judge every covered mutant by lockstep alone; print survivors and the rate per exercise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="exercise id(s), e.g. --only 4.7")
    parser.add_argument("--min-rate", type=float, default=1.0, help="share that must be caught (default 1.0)")
    args = parser.parse_args(argv)
    covered = set(lockstep.exercises_with_workloads())
    mutants = [m for m in ALL_MUTANTS if (not args.only or m.exercise in args.only)]
    uncovered = sorted({m.exercise for m in mutants} - covered)
    mutants = [m for m in mutants if m.exercise in covered]
    start, survivors = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for number, mutant in enumerate(mutants):
            began = time.perf_counter()
            try:
                found = judge(mutant, Path(tmp), number)
            except Exception as error:  # the harness itself broke: as bad as a survivor
                found, mutant_error = None, f"{type(error).__name__}: {error}"
            else:
                mutant_error = ""
            took = time.perf_counter() - began
            status = "caught" if found else "SURVIVED" + (f" ({mutant_error})" if mutant_error else "")
            print(f"{mutant.exercise:>4}  {status:<9} {took:5.1f} s  {mutant.description[:70]}", flush=True)
            if not found:
                survivors.append(mutant)
    caught = len(mutants) - len(survivors)
    rate = caught / len(mutants) if mutants else 1.0
    print(
        f"\n{caught} of {len(mutants)} mutants caught by lockstep alone ({rate:.1%}) in {time.perf_counter() - start:.0f} s."
    )
    if uncovered:
        print(f"exercises with mutants but no lockstep workload: {', '.join(uncovered)}")
    return 1 if rate < args.min_rate or uncovered else 0


if __name__ == "__main__":
    sys.exit(main())

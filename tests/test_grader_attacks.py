"""The static check (now only an early, helpful message), the submission reader and the autograder build.

The classroom grader's security is the boundary (kvcourse/course/boundary.py); its attack suite, graded through
the real boundary, is tests/grader/test_attacks.py. The rows of issue 25's table stay here as what the static
check still names for the student before grading.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvcourse.course import boundary, gradescope
from kvcourse.course.exercises import EXERCISE_MODULES
from kvcourse.course.static_check import check_source, derive_policy
from kvcourse.course.stubs import stub_for

ROOT = Path(__file__).resolve().parent.parent
OBSERVER = str(ROOT / "tests" / "grader" / "fake_observer.py")
STUBS = {m: stub_for(ROOT / "solutions" / f"{m}.py")[0] for m in EXERCISE_MODULES}
ONE_PER_MODULE = {"memory": "0.1", "step": "1.1", "scheduler": "2.1", "kv_cache": "3.1", "attention": "5.1",
                  "model_runner": "5.5"}  # fmt: skip
FUTURE = "from __future__ import annotations\n"
FULL_MARKS = json.dumps({"score": 32.0, "tests": [{"name": "all", "score": 32.0, "max_score": 32.0}]})


def attack(module: str, code: str) -> str:
    """The module's honest stub with `code` run at import (appended, so `from __future__` stays first)."""
    return STUBS[module] + "\n\n" + code.strip() + "\n"


def table(results_path: Path) -> dict[str, str]:
    """Issue 25's table (and its paragraph), one attack per module in each batch: {module: source}."""
    stub_skip = STUBS["attention"].replace("raise NotImplementedError(", "raise unittest.SkipTest(")
    return {
        # atexit hook that rewrites the results file; a full-marks results.json then os._exit(0)
        "memory": attack(
            "memory", f"import atexit\natexit.register(lambda: open({str(results_path)!r}, 'w').write({FULL_MARKS!r}))"
        ),
        "step": attack("step", "import kvcourse.course.results as r\nr.summarize = lambda *a, **k: None"),
        "scheduler": attack(
            "scheduler",
            "from _pytest.reports import TestReport\nTestReport.from_item_and_call = classmethod(lambda cls, item, call: None)",
        ),
        "kv_cache": attack(
            "kv_cache", f"import os\nopen({str(results_path)!r}, 'w').write({FULL_MARKS!r})\nos._exit(0)"
        ),
        "attention": stub_skip.replace(FUTURE, FUTURE + "import unittest\n", 1),
        "model_runner": attack("model_runner", "import inspect\nEXPECTED = inspect.stack()[1].frame.f_globals"),
    }


def table_more() -> dict[str, str]:
    """The rest of the table: a skip after one right answer, an always-equal int, exec of the reference, env writes."""
    memory = STUBS["memory"].replace(
        'raise NotImplementedError(\n        "Exercise 0.1', 'import unittest\n    if dtype == torch.float32:\n        return 2 * 3 * 40 * 4\n    raise unittest.SkipTest(\n        "Exercise 0.1'
    )  # fmt: skip
    checkpoint = "exec(open(__file__.replace('attention.py', '.ipynb_checkpoints/scheduler-checkpoint.py')).read())"
    return {
        "memory": memory,
        "kv_cache": attack("kv_cache", "class Always(int):\n    def __eq__(self, other):\n        return True"),
        "step": attack(
            "step", "from pathlib import Path\nexec((Path(__file__).parents[1] / 'solutions' / 'step.py').read_text())"
        ),
        "scheduler": attack("scheduler", "import os\nos.environ['KVCOURSE_SOLUTIONS'] = '1'"),
        "attention": attack("attention", checkpoint),
    }


def test_every_row_is_refused_by_the_static_check_and_the_reference_is_not():
    policy = derive_policy()
    for module, text in [*table(Path("/tmp/r.json")).items(), *table_more().items()]:
        assert check_source(text, f"kvcourse/{module}.py", policy, f"kvcourse.{module}"), module
    for module in EXERCISE_MODULES:
        for text in ((ROOT / "solutions" / f"{module}.py").read_text(), STUBS[module]):
            assert check_source(text, f"{module}.py", policy, f"kvcourse.{module}") == [], module
    more = [
        "import builtins\nbuiltins.len = lambda x: 0",
        "x = __builtins__",
        "import sys\nsys._getframe(1)",
        "def f():\n    yield 1\ng = f().gi_frame.f_back",
        "import ctypes",
        "import signal",
        "getattr(int, '__subclasses__')",
        "X = type('X', (int,), {})",
        "from kvcourse.engine.llm_engine import sys",
        "import kvcourse\nkvcourse.course.grade",
        "import torch\ntorch.load('x')",
        "from kvcourse.core.request import Request\nRequest.num_tokens = 3",
        "import math as m\nmodule = m",
        "eval('1')",
        "compile('1', 'x', 'eval')",
        "class A:\n    def __eq__(self, other):\n        return True",
        "'{0.__class__}'.format(1)",
        "import importlib",
        "import subprocess",
        "import pytest",
        "import torch\ntorch.os.system('x')",
        "import torch\nx = torch.nn.modules.module.sys",
        "from torch import os",
        "import torch\nx = getattr(torch.nn, 'os')",
        "import triton\ntriton.compiler.compile",
        "import torch\ntorch._C",
        "from kvcourse import check",
        "import torch\nclass T(torch.Tensor):\n    def allclose(self, other, **kwargs):\n        return True",
        "from kvcourse.core.request import Request\nclass R(Request):\n    pass",
        "from kvcourse.worker.paged_cache import ATTENTION_IMPLEMENTATIONS as A\nA['reference'] = len",
        "from kvcourse.worker.paged_cache import ATTENTION_IMPLEMENTATIONS as A\nA.update(reference=len)",
        "import torch\nx = torch.UntypedStorage.from_file('tests/exercises/test_ex0_memory.py')",
    ]
    for text in more:
        assert check_source(text, "kvcourse/memory.py", policy, "kvcourse.memory"), text
    fine = "import heapq\nimport math\nfrom dataclasses import dataclass\n\n@dataclass\nclass P:\n    x: int\n\n    def __post_init__(self):\n        self.x = math.ceil(self.x)\n"  # fmt: skip
    found = check_source(fine, "kvcourse/memory.py", policy, "kvcourse.memory")
    assert [r.why for r in found if "__post_init__" not in r.why] == []


def test_a_reused_folder_keeps_no_earlier_student(tmp_path):
    course = tmp_path / "course"
    (course / "kvcourse").mkdir(parents=True)
    first, second = tmp_path / "first" / "kvcourse", tmp_path / "second" / "kvcourse"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    (first / "memory.py").write_text((ROOT / "solutions" / "memory.py").read_text())
    (second / "step.py").write_text(STUBS["step"] + "\n# the second student's step\n")
    assert gradescope.place(first.parent, course) == ["kvcourse/memory.py"]
    assert gradescope.place(second.parent, course) == ["kvcourse/step.py"]
    assert (course / "kvcourse" / "memory.py").read_text() == STUBS["memory"], "the first student's module stayed"
    big = tmp_path / "big" / "kvcourse"
    big.mkdir(parents=True)
    (big / "memory.py").write_text("x = 1\n" * (gradescope.MAX_MODULE_BYTES // 5))
    found, ignored = gradescope.find_submission(big.parent)
    assert found == {} and any("larger than" in note for note in ignored)


def test_build_ships_no_leftover_and_refuses_reference_code(tmp_path):
    names = gradescope.build(tmp_path / "a.zip", OBSERVER, ["0.1"])
    assert not [n for n in names if ".ipynb_checkpoints" in n or n.endswith((".orig", ".rej", ".bak"))]
    assert "grader/stubs/memory.py" in names and "kvcourse/course/grader_policy.json" in names
    assert "grader/reference.json" in names and "grader/observer.py" in names
    bodies = gradescope._solution_bodies()
    reference = (ROOT / "solutions" / "scheduler.py").read_text()
    assert gradescope._leak("kvcourse/.ipynb_checkpoints/scheduler-checkpoint.py", reference, bodies)
    assert gradescope._leak("kvcourse/scheduler.py.orig", reference.replace("# BEGIN", "# begun"), bodies)
    assert gradescope._leak("kvcourse/x.py", STUBS["scheduler"], bodies) is None
    assert not gradescope._shippable("kvcourse/.ipynb_checkpoints/scheduler-checkpoint.py")
    assert not gradescope._shippable("kvcourse/scheduler.py.orig") and gradescope._shippable(
        "kvcourse/engine/llm_engine.py"
    )


def test_the_grade_command_ignores_an_exported_solutions_switch():
    env = {**os.environ, "KVCOURSE_SOLUTIONS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "kvcourse", "grade", "--json", "0.2"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert (answer["solutions"], answer["graded"]) == (False, "kvcourse/")
    learner = (ROOT / "kvcourse" / "memory.py").read_text()
    if learner == STUBS["memory"]:
        assert answer["results"][0]["status"] == "not attempted", "it graded the reference, not kvcourse/"


def test_a_broken_grader_still_writes_results_and_says_so(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the zygote could not start")

    monkeypatch.setattr(boundary, "grade", broken)
    (tmp_path / "submission").mkdir()
    out = tmp_path / "results.json"
    assert gradescope.main(["grade", str(tmp_path / "submission"), "--out", str(out), "--exercises", "0.1"]) == 2
    results = json.loads(out.read_text())
    assert results["score"] == 0 and "The grader failed, not your code" in results["output"]
    assert [t["number"] for t in results["tests"]] == ["0.1"]
    missing = tmp_path / "nothing-here"
    assert gradescope.main(["grade", str(missing), "--out", str(out)]) == 0, "a missing submission is not a grader bug"
    assert json.loads(out.read_text())["score"] == 0

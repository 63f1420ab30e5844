"""Submissions that try to fool the classroom grader: each scores what an honest stub scores (0).

Every row of issue 25's table is submitted next to stubs, through the built autograder's `run_autograder`
(the static check refuses them), and again through the sandbox with the static check off (the child's
guards, the graded tests' exact types and the skip rule stop them). Hangs, crashes, links and a reused folder
are covered too. Attacks are batched: one attack per exercise module, one exercise graded per module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcourse.course import gradescope, sandbox
from kvcourse.course.exercises import EXERCISE_MODULES
from kvcourse.course.static_check import check_source, derive_policy
from kvcourse.course.stubs import stub_for

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.fixture(scope="module")
def autograder(tmp_path_factory) -> Path:
    """The built autograder, unzipped as Gradescope does, once for the module."""
    source = tmp_path_factory.mktemp("autograder") / "source"
    gradescope.build(source.parent / "autograder.zip")
    with zipfile.ZipFile(source.parent / "autograder.zip") as archive:
        archive.extractall(source)
    (source / "run_autograder").chmod(0o755)
    return source


def run_autograder(source: Path, root: Path, files: dict[str, str | Path], exercises: list[str]) -> dict:
    """Submit `files` (text, or a Path to link to) under root/submission and run the autograder on them."""
    submission = root / "submission"
    for name, content in files.items():
        path = submission / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            path.symlink_to(content)
        elif content == "<folder>":
            path.mkdir()
        else:
            path.write_text(content)
    env = {k: v for k, v in os.environ.items() if k != "KVCOURSE_SOLUTIONS"}
    env.update(KVCOURSE_AUTOGRADER_ROOT=str(root), KVCOURSE_EXERCISES=" ".join(exercises), KVCOURSE_SOLUTIONS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        [str(source / "run_autograder")], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads((root / "results" / "results.json").read_text())
    results["stdout"] = done.stdout
    return results


def scores(results: dict) -> dict[str, float]:
    return {t["number"]: t["score"] for t in results["tests"]}


def test_the_table_is_refused_before_anything_runs(autograder, tmp_path):
    results_path = tmp_path / "results" / "results.json"
    results = run_autograder(autograder, tmp_path, {f"kvcourse/{m}.py": t for m, t in table(results_path).items()},
                             list(ONE_PER_MODULE.values()))  # fmt: skip
    assert scores(results) == dict.fromkeys(ONE_PER_MODULE.values(), 0.0), results
    assert results["score"] == 0
    for module, word in [("memory", "atexit"), ("step", "kvcourse.course"), ("scheduler", "_pytest"),
                         ("kv_cache", "import"), ("attention", "unittest"), ("model_runner", "inspect")]:  # fmt: skip
        assert f"refused kvcourse/{module}.py" in results["stdout"] and word in results["stdout"], module
    assert "the grader did not run this file" in {t["number"]: t["output"] for t in results["tests"]}["0.1"]


def test_the_rest_of_the_table_links_and_folders_score_zero(autograder, tmp_path):
    files: dict[str, str | Path] = {f"kvcourse/{m}.py": t for m, t in table_more().items()}
    files["kvcourse/model_runner.py"] = Path("/etc/hostname")  # a link is never followed
    files["loose/step.py"] = Path("/dev/zero")
    files["extra/memory.py"] = "<folder>"
    files["conftest.py"] = "import pytest\n@pytest.hookimpl\ndef pytest_runtest_makereport(item, call): pass\n"
    results = run_autograder(autograder, tmp_path, files, list(ONE_PER_MODULE.values()))
    assert scores(results) == dict.fromkeys(ONE_PER_MODULE.values(), 0.0), results
    out = results["stdout"]
    assert "ignored kvcourse/model_runner.py (a link" in out and "ignored loose/step.py (a link" in out
    assert "ignored extra/memory.py (a folder" in out
    hostname = Path("/etc/hostname").read_text().strip()
    assert not hostname or hostname not in json.dumps(results["tests"])
    assert {t["number"]: t["output"] for t in results["tests"]}["5.5"].startswith("⏳"), "a module left out is a stub"


def grade_unchecked(tmp_path, files: dict[str, str], exercises: list[str], guards: bool = True, **limits) -> dict:
    """Grade through the sandbox with the static check switched off: only the run-time defences stand."""
    submission = tmp_path / "submission" / "kvcourse"
    submission.mkdir(parents=True)
    for module, text in files.items():
        (submission / f"{module}.py").write_text(text)
    return gradescope.grade_submission(
        submission.parent, tmp_path / "results.json", exercises, sandbox.Limits(**limits), log=lambda _: None,
        static=False, guards=guards,
    )  # fmt: skip


@pytest.mark.slow  # one grader child per attack: `./course test -m slow` (CI runs it)
def test_without_the_static_check_the_children_still_cannot_cheat(tmp_path):
    results_path = tmp_path / "results.json"
    files = table(results_path)
    files["memory"] = table_more()["kv_cache"].replace(STUBS["kv_cache"], STUBS["memory"]).replace(
        'raise NotImplementedError(\n        "Exercise 0.1', 'return Always(0)\n    raise NotImplementedError(\n        "Exercise 0.1'
    )  # fmt: skip
    # a trusted class patched through an alias (no import the guard would stop): caught before the next report
    files["model_runner"] = attack("model_runner", "box = [PagedKVCache]\nbox[0].for_model = lambda *a, **k: None")
    # the expected values read from the graded tests' own source, then the results file written and os._exit
    tests = "__file__.replace('kvcourse/kv_cache.py', 'tests/exercises/test_ex3_allocator.py')"
    files["kv_cache"] = (
        attack("kv_cache", f"EXPECTED = open({tests}).read()\n") + files["kv_cache"][len(STUBS["kv_cache"]) :]
    )
    results = grade_unchecked(tmp_path, files, list(ONE_PER_MODULE.values()), test_s=20)
    assert scores(results) == dict.fromkeys(ONE_PER_MODULE.values(), 0.0), results
    assert json.loads(results_path.read_text())["score"] == 0, "the grader's results.json, not the attack's"
    outputs = {t["number"]: t["output"] for t in results["tests"]}
    assert "plain int" in outputs["0.1"], outputs["0.1"]
    for number in ("1.1", "2.1", "3.1", "5.1", "5.5"):
        assert "the grader stopped your code" in outputs[number], outputs[number]


@pytest.mark.slow  # waits out hangs and crashes, one grader child each: `./course test -m slow` (CI runs it)
def test_hangs_crashes_and_skips_cost_only_their_exercise(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOURSE_TEST_TIMEOUT_S", "2")
    solution = (ROOT / "solutions" / "memory.py").read_text()
    hang = solution.replace("def kv_bytes_per_token(config, dtype: torch.dtype) -> int:", "def kv_bytes_per_token(config, dtype: torch.dtype) -> int:\n    while True:\n        try:\n            while True:\n                pass\n        except BaseException:\n            pass")  # fmt: skip
    files = {
        "memory": hang,  # 0.1 hangs past pytest-timeout (a bare except swallows it); 0.2 is right
        "step": attack("step", "import os\nos._exit(0)"),
        "scheduler": attack("scheduler", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"),
        "attention": STUBS["attention"]
        .replace("raise NotImplementedError(", "raise unittest.SkipTest(")
        .replace(FUTURE, FUTURE + "import unittest\n", 1),
    }
    results = grade_unchecked(tmp_path, files, ["0.1", "0.2", "1.1", "2.1", "5.1"], guards=False, test_s=6)
    assert scores(results) == {"0.1": 0.0, "0.2": 1.0, "1.1": 0.0, "2.1": 0.0, "5.1": 0.0}, results
    outputs = {t["number"]: t["output"] for t in results["tests"]}
    assert "stopped reporting" in outputs["0.1"] and "SIGSEGV" in outputs["2.1"], outputs
    assert "skip counts as a failure" in outputs["5.1"] and re.search(r"0/[1-9]\d* tests pass", outputs["5.1"])


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
    names = gradescope.build(tmp_path / "a.zip")
    assert not [n for n in names if ".ipynb_checkpoints" in n or n.endswith((".orig", ".rej", ".bak"))]
    assert "grader/stubs/memory.py" in names and "kvcourse/course/grader_policy.json" in names
    bodies = gradescope._solution_bodies()
    reference = (ROOT / "solutions" / "scheduler.py").read_text()
    assert gradescope._leak("kvcourse/.ipynb_checkpoints/scheduler-checkpoint.py", reference, bodies)
    assert gradescope._leak("kvcourse/scheduler.py.orig", reference.replace("# BEGIN", "# begun"), bodies)
    assert gradescope._leak("kvcourse/x.py", STUBS["scheduler"], bodies) is None
    assert not gradescope._shippable("kvcourse/.ipynb_checkpoints/scheduler-checkpoint.py")
    assert not gradescope._shippable("kvcourse/scheduler.py.orig") and gradescope._shippable(
        "kvcourse/engine/llm_engine.py"
    )


@pytest.mark.slow  # a whole `kvcourse grade` run in a fresh process: `./course test -m slow` (CI runs it)
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


def test_the_whole_run_is_bounded_and_still_writes_every_exercise(tmp_path):
    solution = (ROOT / "solutions" / "memory.py").read_text()
    results = grade_unchecked(tmp_path, {"memory": solution}, ["0.1", "0.2", "1.1"], run_s=2)
    assert scores(results) == {"0.1": 0.0, "0.2": 0.0, "1.1": 0.0}
    assert all("time limit ran out" in t["output"] for t in results["tests"]), results["tests"]
    assert json.loads((tmp_path / "results.json").read_text())["tests"] == results["tests"]


def test_a_hang_while_importing_costs_only_that_module(tmp_path):
    files = {"memory": attack("memory", "while True:\n    pass")}  # allowed by the static check: plain Python
    submission = tmp_path / "submission" / "kvcourse"
    submission.mkdir(parents=True)
    (submission / "memory.py").write_text(files["memory"])
    results = gradescope.grade_submission(
        submission.parent, tmp_path / "results.json", ["0.1", "0.2", "1.1"], sandbox.Limits(test_s=5), log=print
    )
    outputs = {t["number"]: t["output"] for t in results["tests"]}
    assert scores(results) == {"0.1": 0.0, "0.2": 0.0, "1.1": 0.0}
    assert "importing kvcourse/memory.py" in outputs["0.1"] and "importing kvcourse/memory.py" in outputs["0.2"]
    assert outputs["1.1"].startswith("⏳"), "step.py (a stub) is graded as usual"


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_a_confined_child_is_another_user_under_limits_it_cannot_raise(tmp_path):
    """What every grading child does first (sandbox._confine), checked in a bare fork: no Python to read."""
    import resource

    private = tmp_path / "results"
    private.mkdir(mode=0o755)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: confine, then try what a submission would
        facts = {}
        try:
            sandbox._confine(sandbox.Limits(memory_bytes=3 << 30), sandbox.Identity(65534, 65534, "nobody", ""), 30)
            facts["uid"] = os.getuid()
            facts["as"] = resource.getrlimit(resource.RLIMIT_AS)[1]
            try:
                (private / "results.json").write_text("{}")
                facts["wrote"] = True
            except PermissionError:
                facts["wrote"] = False
            try:
                resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
                facts["raised"] = True
            except (ValueError, OSError):
                facts["raised"] = False
            facts["session"] = os.getsid(0) == os.getpid()
        finally:
            os.write(write, json.dumps(facts).encode())
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    facts = json.loads(os.read(read, 4096))
    assert facts == {"uid": 65534, "as": 3 << 30, "wrote": False, "raised": False, "session": True}


def test_a_broken_grader_still_writes_results_and_says_so(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the zygote could not start")

    monkeypatch.setattr(sandbox, "grade_course", broken)
    (tmp_path / "submission").mkdir()
    out = tmp_path / "results.json"
    assert gradescope.main(["grade", str(tmp_path / "submission"), "--out", str(out), "--exercises", "0.1"]) == 2
    results = json.loads(out.read_text())
    assert results["score"] == 0 and "The grader failed, not your code" in results["output"]
    assert [t["number"] for t in results["tests"]] == ["0.1"]
    missing = tmp_path / "nothing-here"
    assert gradescope.main(["grade", str(missing), "--out", str(out)]) == 0, "a missing submission is not a grader bug"
    assert json.loads(out.read_text())["score"] == 0

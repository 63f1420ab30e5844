"""The course names vLLM's files and symbols on almost every page: each must be one the committed report found.

`scripts/check_vllm.py` reads a vLLM wheel (downloaded, never installed) and writes its verdicts to
`notebooks/data/vllm_checked.json`; CI never downloads it. These tests read the course's text again and
fail when it names a vLLM path, a symbol beside one, or a `vllm:` metric that the report does not list as
found, so a sentence added after the last check is caught until someone re-runs the script.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_vllm", ROOT / "scripts" / "check_vllm.py")
check_vllm = importlib.util.module_from_spec(_spec)
sys.modules["check_vllm"] = check_vllm  # dataclasses look their module up while the class is built
_spec.loader.exec_module(check_vllm)

RERUN = "re-run `python scripts/check_vllm.py` (it downloads the wheel) and commit notebooks/data/vllm_checked.json"


@pytest.fixture(scope="module")
def report() -> dict:
    assert check_vllm.REPORT.is_file(), f"no {check_vllm.REPORT.relative_to(ROOT)}: {RERUN}"
    return json.loads(check_vllm.REPORT.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def named() -> dict:
    return check_vllm.named_references(check_vllm.course_files())


def _found(report: dict, kind: str, key) -> set:
    return {key(v) for v in report[kind] if v["found"]}


def test_the_report_is_for_the_release_the_readme_names(report):
    assert report["vllm_version"] == check_vllm.VLLM_VERSION, f"the report checked another release: {RERUN}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"vLLM {check_vllm.VLLM_VERSION}" in readme, "README should say which vLLM release the course compares with"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", report["checked_on"]) and re.fullmatch(
        r"[0-9a-f]{64}", report["wheel_sha256"]
    )


def test_no_other_vllm_release_is_named():
    """The release is stated once (README); a page that names another one compares with something unchecked."""
    version = re.escape(check_vllm.VLLM_VERSION.rsplit(".", 1)[0])
    wrong = []
    for path in check_vllm.course_files():
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"vLLM v?(0\.\d+(?:\.\d+)?)\b", text):
            if not re.fullmatch(rf"{version}(\.0)?", match.group(1)):
                wrong.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert not wrong, f"these name a vLLM release other than {check_vllm.VLLM_VERSION}: {wrong}"


def test_every_vllm_path_the_course_names_was_found_in_the_release(report, named):
    found = _found(report, "paths", lambda v: v["path"])
    missing = {path: where for path, where in named["paths"].items() if path not in found}
    assert named["paths"], "no vLLM path found in the course's text: the extraction is broken"
    assert not missing, f"the course names vLLM paths the report does not list as found: {missing}; {RERUN}"


def test_every_symbol_named_beside_a_path_was_found(report, named):
    found = _found(report, "symbols", lambda v: (v["path"], v["symbol"]))
    missing = {f"{p} · {s}": where for (p, s), where in named["symbols"].items() if (p, s) not in found}
    assert not missing, f"symbols not found beside their vLLM path: {missing}; {RERUN}"


def test_every_vllm_metric_name_was_found(report, named):
    found = _found(report, "metrics", lambda v: v["metric"])
    missing = {m: where for m, where in named["metrics"].items() if m not in found}
    assert not missing, f"vllm: metric names the report did not find in the release: {missing}; {RERUN}"


def test_every_listed_claim_was_checked_and_holds(report):
    checked = {(v["path"], v["symbol"], tuple(v.get("contains", ()))) for v in report["claims"] if v["found"]}
    unchecked = [c for c in check_vllm.CLAIMS if (c.path, c.symbol, c.contains) not in checked]
    assert not unchecked, f"claims in scripts/check_vllm.py the report does not confirm: {unchecked}; {RERUN}"
    assert report["all_found"], f"the committed report has verdicts that failed: {RERUN}, then fix the text"


def test_prose_gives_every_vllm_path_so_that_a_reader_can_open_it(named):
    """`v1/core/x.py` or a bare `block_pool.py` cannot be opened; `vllm/v1/core/block_pool.py` can."""
    bad = [line for line in named["partial"] + named["bare"] if check_vllm.is_prose(line)]
    assert not bad, f"write these vLLM paths from the package root (vllm/...): {bad}"


# ---------------------------------------------------------------- the checker itself, on made-up text


def _refs(tmp_path: Path, text: str) -> dict:
    (tmp_path / "kvcourse").mkdir(exist_ok=True)
    (tmp_path / "kvcourse" / "engine.py").write_text("")
    page = tmp_path / "README.md"
    page.write_text(text)
    return check_vllm.named_references([page], root=tmp_path)


def test_paths_symbols_and_metrics_are_read_from_the_text(tmp_path):
    refs = _refs(
        tmp_path,
        "| `vllm/v1/core/block_pool.py` · `BlockPool`, `FreeQ` (`popleft`) |\n"
        "`AsyncLLM` (`vllm/v1/engine/async_llm.py`), `vllm/entrypoints/openai/completion/{serving,protocol}.py`,\n"
        "`vllm/v1/core/`, `kvcourse/engine/llm_engine.py`, https://github.com/vllm-project/vllm/blob/v0.1/vllm/x.py, "
        "`vllm:num_requests_running` and `nano-vllm/x.py`\n",
    )
    assert set(refs["paths"]) == {
        "vllm/v1/core/block_pool.py",
        "vllm/v1/engine/async_llm.py",
        "vllm/entrypoints/openai/completion/serving.py",
        "vllm/entrypoints/openai/completion/protocol.py",
        "vllm/v1/core/",
        "vllm/x.py",  # from the link
    }
    assert set(refs["symbols"]) == {
        ("vllm/v1/core/block_pool.py", "BlockPool"),
        ("vllm/v1/core/block_pool.py", "FreeQ"),
        ("vllm/v1/core/block_pool.py", "FreeQ.popleft"),
        ("vllm/v1/engine/async_llm.py", "AsyncLLM"),
    }
    assert set(refs["metrics"]) == {"vllm:num_requests_running"}
    assert refs["paths"]["vllm/v1/core/"] == ["README.md:3"]
    assert refs["partial"] == [] and refs["bare"] == []


def test_paths_a_reader_cannot_open_are_reported(tmp_path):
    refs = _refs(tmp_path, "see `v1/core/sched/scheduler.py` and `block_pool.py`, not `engine.py`\n")
    assert refs["partial"] == ["README.md:1: v1/core/sched/scheduler.py"]
    assert refs["bare"] == ["README.md:1: block_pool.py"]  # engine.py is a course file


MODULE = '''
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    FLAG: bool = False

NONE_HASH = object()

class Pool:
    size: int = Field(default=0.0)
    """The share kept free."""

    def __init__(self):
        self.null_block = 0

    @router.post("/reset")
    def free_blocks(self, blocks):
        self.queue.prepend_n(blocks)
'''


@pytest.fixture
def wheel(tmp_path) -> object:
    path = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm/v1/core/pool.py", MODULE)
        archive.writestr("vllm/__init__.py", "")
    return check_vllm.Wheel(path)


@pytest.mark.parametrize(
    ("symbol", "contains", "found"),
    [
        ("Pool", (), True),
        ("Pool.free_blocks", ("prepend_n", 'router.post("/reset")'), True),  # the decorator counts
        ("Pool.free_blocks", ("append_n",), False),
        ("free_blocks", (), True),  # a method named alone
        ("Pool.null_block", (), True),  # set on self
        ("Pool.size", ("default=0.0", "share kept free"), True),  # a field and its docstring
        ("NONE_HASH", (), True),
        ("FLAG", (), True),  # under `if TYPE_CHECKING:`
        ("Pool.missing", (), False),
        ("Other", (), False),
    ],
)
def test_symbols_are_looked_up_in_the_wheels_source(wheel, symbol, contains, found):
    verdict = check_vllm.check_symbol(wheel, "vllm/v1/core/pool.py", symbol, contains)
    assert verdict["found"] is found, verdict
    assert found or verdict["problem"]


def test_paths_are_files_or_folders_of_the_wheel(wheel):
    assert wheel.has("vllm/v1/core/pool.py") == "file"
    assert wheel.has("vllm/v1/core/") == "directory" and wheel.has("vllm/v1/") == "directory"
    assert wheel.has("vllm/v1/core/gone.py") is None
    assert check_vllm.check_symbol(wheel, "vllm/v1/core/gone.py", "X")["problem"] == "no such file in the wheel"


def test_a_missing_wheel_is_refused_in_words(tmp_path, capsys):
    with pytest.raises(SystemExit):
        check_vllm.main(["--wheel", str(tmp_path / "nope.whl")])
    assert "no such file" in capsys.readouterr().err

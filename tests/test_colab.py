"""Each notebook's first code cell installs the course in Colab without touching Colab's CUDA torch.

The cell is taken from the notebook's paired .py source and run as Python, with a stand-in
`google.colab` module, `kvcourse` hidden from `find_spec`, and `subprocess.run` recording commands.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest

from kvcourse.course import colab

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(ROOT.glob("notebooks/[0-9][0-9]_*.py"))
CLONE = "/content/kvcourse"


def first_code_cell(source: Path) -> str:
    """The text of the first `# %%` code cell of a jupytext percent script (magics stay comments)."""
    cells = re.split(r"^# %%(.*)$", source.read_text(), flags=re.M)
    for header, body in zip(cells[1::2], cells[2::2]):
        if "[markdown]" not in header:
            return body
    raise AssertionError(f"{source.name} has no code cell")


def run_cell(cell: str, clone: Path, monkeypatch, in_colab: bool) -> list[list[str]]:
    """Run the cell with Colab (or not) simulated; return every command it asked subprocess to run."""
    commands: list[list[str]] = []

    def fake_run(command, *args, **kwargs):
        commands.append([str(part) for part in command])
        if command[:2] == ["git", "clone"]:  # the stand-in clone: the files the installer reads
            Path(command[-1]).mkdir(parents=True)
            shutil.copy(ROOT / "pyproject.toml", Path(command[-1]) / "pyproject.toml")
        return subprocess.CompletedProcess(command, 0)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kvcourse" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(os, "chdir", lambda path: commands.append(["chdir", str(path)]))
    monkeypatch.setattr(sys, "path", list(sys.path))
    if in_colab:
        google = types.ModuleType("google")
        google.colab = types.ModuleType("google.colab")
        monkeypatch.setitem(sys.modules, "google", google)
        monkeypatch.setitem(sys.modules, "google.colab", google.colab)
    else:
        monkeypatch.setitem(sys.modules, "google.colab", None)  # import google.colab -> ImportError
    exec(compile(cell.replace(CLONE, str(clone)), "first_cell", "exec"), {"__name__": "__main__"})
    return commands


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_first_cell_in_colab_installs_the_course_but_not_torch(notebook, tmp_path, monkeypatch):
    clone = tmp_path / "kvcourse"
    commands = run_cell(first_code_cell(notebook), clone, monkeypatch, in_colab=True)
    clone_cmd, deps_cmd, course_cmd, model_cmd, chdir = commands
    assert clone_cmd == ["git", "clone", "--depth=1", colab.REPOSITORY, str(clone)]
    assert deps_cmd[:4] == [sys.executable, "-m", "pip", "install"]
    packages = [arg for arg in deps_cmd[4:] if not arg.startswith("-") and not arg.endswith(".txt")]
    names = {colab._name(p) for p in packages}
    assert {"transformers", "pytest", "matplotlib"} <= names
    assert not names & {"torch", "triton", "jupyterlab", "nbval", "playwright"}, f"would install {names}"
    constraints = Path(deps_cmd[deps_cmd.index("-c") + 1]).read_text().split()
    assert f"torch=={metadata.version('torch')}" in constraints, "the installed torch must be held in place"
    assert course_cmd[-3:] == ["--no-deps", "-e", str(clone)]
    assert model_cmd == [sys.executable, "-m", "kvcourse.models.smollm2"], "SmolLM2 is fetched as ./course setup does"
    assert chdir == ["chdir", str(clone / "notebooks")]
    assert str(clone) in sys.path
    assert "%load_ext autoreload" in first_code_cell(notebook)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_first_cell_outside_colab_only_turns_on_autoreload(notebook, tmp_path, monkeypatch):
    cell = first_code_cell(notebook)
    assert run_cell(cell, tmp_path / "kvcourse", monkeypatch, in_colab=False) == []
    assert "# %load_ext autoreload\n# %autoreload 2" in cell


def test_every_notebook_has_the_same_first_cell():
    """One cell, copied: a change to it is made everywhere (the lead's notebooks 07 and 08 included)."""
    cells = {path.name: first_code_cell(path) for path in NOTEBOOKS}
    assert len(set(cells.values())) == 1, f"first cells differ: {sorted(cells)}"


def test_repository_address_is_the_same_everywhere():
    """The repository's address is a placeholder until the course is published: all copies must agree."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(
        r"https://colab\.research\.google\.com/github/([^/]+/[^/]+)/blob/main/(notebooks/\S+?\.ipynb)", readme
    )
    assert links, "README has no Open-in-Colab links"
    assert {f"https://github.com/{repo}" for repo, _ in links} == {colab.REPOSITORY}
    assert {path for _, path in links} == {f"notebooks/{p.stem}.ipynb" for p in NOTEBOOKS}
    for notebook in NOTEBOOKS:
        assert colab.REPOSITORY in first_code_cell(notebook)


def test_installed_torch_is_kept_even_when_a_range_would_allow_another(tmp_path):
    """The constraints name exactly the torch and triton installed now (a CUDA build keeps its +cu tag)."""
    pins = colab.keep_installed(("torch", "triton", "not-a-package-kvcourse"))
    assert pins == [f"torch=={metadata.version('torch')}", f"triton=={metadata.version('triton')}"]


def test_the_site_build_warns_while_the_repository_is_the_placeholder(capsys) -> None:
    """An instructor who forgets to name the real repository hears it from `./course book`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
    build_site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_site)
    assert build_site.placeholder_warning(colab.PLACEHOLDER_REPOSITORY)
    assert "placeholder" in capsys.readouterr().err
    assert build_site.placeholder_warning("https://github.com/someone/kvcourse") is None

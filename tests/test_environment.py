"""environment.yml (conda, repo2docker) installs the same packages as pyproject.toml (pip), extras included."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _normalize(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement).replace('"', "'").lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _conda_pip_requirements() -> list[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:") + 1
    return [line.strip()[2:] for line in lines[start:] if line.strip().startswith("- ")]


def test_environment_yml_lists_pyproject_dependencies_and_extras():
    project = _project()
    wanted = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert sorted(map(_normalize, _conda_pip_requirements())) == sorted(map(_normalize, wanted))


def test_torch_is_a_range_for_learners():
    """An exact torch pin would replace the CUDA torch a learner (or Colab) already has."""
    torch = [r for r in _project()["dependencies"] if re.match(r"torch\b", r)]
    assert torch and "==" not in torch[0], f"pyproject.toml pins torch exactly ({torch}): state a range"


def test_maintainers_tools_are_an_extra():
    """A learner's install carries no maintainers' tools; the dev extra has them."""
    names = {re.split(r"[<>=;\[ ]", r)[0].lower() for r in _project()["dependencies"]}
    dev = {re.split(r"[<>=;\[ ]", r)[0].lower() for r in _project()["optional-dependencies"]["dev"]}
    assert not names & {"nbval", "playwright", "ruff", "jupytext"}
    assert {"nbval", "playwright", "ruff", "jupytext"} <= dev


def test_repo2docker_builds_the_course():
    """repo2docker (Binder, a JupyterHub) reads environment.yml, then runs postBuild: it must install the course."""
    post_build = ROOT / "postBuild"
    assert post_build.stat().st_mode & 0o111, "postBuild must be executable"
    assert "pip install --no-deps -e ." in post_build.read_text()
    minimum = re.search(r">=\s*(\d+\.\d+)", _project()["requires-python"])[1]
    conda_python = re.search(r"- python=(\d+\.\d+)", (ROOT / "environment.yml").read_text())[1]
    assert tuple(map(int, conda_python.split("."))) >= tuple(map(int, minimum.split(".")))

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


def _floor_lock() -> dict[str, str]:
    lines = (ROOT / "requirements" / "floor.lock").read_text().splitlines()
    pins = [line.split("==") for line in lines if "==" in line and not line.startswith("#")]
    return {re.sub(r"[-_.]+", "-", name).lower(): pin.strip() for name, pin in pins}


def _floors() -> dict[str, str]:
    """Each dependency's lowest version as pyproject.toml states it (`name>=X`)."""
    floors = {}
    for requirement in _project()["dependencies"]:
        found = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)", requirement)
        if found:
            floors[re.sub(r"[-_.]+", "-", found[1]).lower()] = found[2]
    return floors


def _padded(v: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in v.split("."))
    return parts + (0,) * (3 - len(parts))


def test_the_floor_lock_installs_pyprojects_floors():
    """The floor job installs each floor pyproject.toml states (torch apart: its floor is checked by reading)."""
    lock, floors = _floor_lock(), _floors()
    tested = {name for name in floors if name in lock and name != "torch"}
    assert {"transformers", "tokenizers", "triton", "numpy", "pytest", "hypothesis"} <= tested
    wrong = {name: (floors[name], lock[name]) for name in tested if _padded(floors[name]) != _padded(lock[name])}
    assert not wrong, f"pyproject.toml's floor differs from what requirements/floor.lock installs: {wrong}"
    assert _padded(lock["torch"]) >= _padded(floors["torch"]), "floor.lock's torch is below pyproject's floor"
    readme = (ROOT / "requirements" / "README.md").read_text()
    assert f"torch>={floors['torch']}" in readme, "requirements/README.md must say how the torch floor was checked"


def test_ci_runs_the_floor_job_before_the_suite():
    """.ci/run makes the floor environment and the GPU kit before `./course test` (tests/test_gpu_kit.py needs them)."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/floor_check.sh" in ci and ci.index("scripts/floor_check.sh") < ci.index("./course test")
    assert {".venv-floor/", "gpu_wheels/"} <= set((ROOT / ".gitignore").read_text().split())

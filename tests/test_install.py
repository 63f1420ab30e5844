"""The install CI and the stored notebook outputs rely on: requirements/ci.lock pins every package exactly."""

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "ci.lock"


def _lock() -> dict[str, str]:
    """Package name -> exact version, from the lock's `name==version` lines."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"requirements/ci.lock: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version
    return pins


def _project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
    return [Requirement(r) for r in project["dependencies"] + extras]


def test_lock_pins_the_cpu_torch_that_ci_installs():
    """An unpinned torch downloads gigabytes of CUDA wheels; 2.13.0 is the CPU build on CI's disk."""
    assert _lock().get("torch") == "2.13.0"


def test_lock_satisfies_every_range_in_pyproject():
    pins = _lock()
    for requirement in _project_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is in pyproject.toml but not pinned in requirements/ci.lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements/ci.lock pins {name}=={pins[name]}, outside pyproject's range {requirement}"
        )


def _closure(requirements: list[Requirement]) -> set[str]:
    """Every distribution the course's requirements pull in, as installed here."""
    seen, todo = set(), [r for r in requirements if r.marker is None or r.marker.evaluate()]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # reported by the caller
        for text in dist.requires or []:
            child = Requirement(text)
            if child.marker is None or child.marker.evaluate({"extra": ""}):
                todo.append(child)
    return seen


def test_lock_covers_everything_installed_for_the_course():
    """No package CI installs is left to float: the whole dependency closure is pinned."""
    pins = _lock()
    missing = sorted(name for name in _closure(_project_requirements()) if name not in pins)
    assert not missing, f"not pinned in requirements/ci.lock: {missing} (regenerate it: see requirements/README.md)"


def test_installed_versions_are_the_locked_ones():
    """The environment that runs this suite (and produced the notebook outputs) is the locked one."""
    pins = _lock()
    drift = []
    for name in sorted(_closure(_project_requirements())):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            drift.append(f"{name} not installed")
            continue
        if name in pins and installed.split("+")[0] != pins[name]:
            drift.append(f"{name} {installed} (lock {pins[name]})")
    assert not drift, f"installed versions differ from requirements/ci.lock: {drift}"


def test_course_setup_installs_with_the_lock():
    """`./course setup` (and so CI, which calls it) passes the lock to pip as constraints, dev extra included."""
    script = (ROOT / "course").read_text()
    assert "lock=requirements/ci.lock" in script
    assert re.search(r'pip install --quiet \$\{constraints\[@\]\+"\$\{constraints\[@\]\}"\} -e "\.\[dev\]"', script)
    assert "./course setup" in (ROOT / ".ci" / "run").read_text()


def test_the_package_ships_its_subpackages():
    """`packages = ["kvcourse"]` alone would leave kvcourse.course, .viz, ... out of a built wheel."""
    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(str(ROOT), include=include))
    assert {"kvcourse", "kvcourse.course", "kvcourse.viz", "kvcourse.toy", "kvcourse.bench"} <= found
    assert not {p for p in found if not p.startswith("kvcourse")}

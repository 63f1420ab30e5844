"""Each notebook has one source: its paired percent-format script. The two must say the same thing."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
IPYNBS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(notebook) -> list[tuple[str, str]]:
    """(cell type, source) of every cell: what a reader sees, outputs aside."""
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_every_notebook_has_its_text_source() -> None:
    scripts = {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py")}
    assert IPYNBS, "no notebooks found"
    assert {p.stem for p in IPYNBS} == scripts, (
        "each notebooks/NN_*.ipynb needs its notebooks/NN_*.py (jupytext percent format) and vice versa: "
        "run `jupytext --sync notebooks/*.ipynb`"
    )


@pytest.mark.parametrize("ipynb", IPYNBS, ids=lambda p: p.stem)
def test_notebook_matches_its_source(ipynb: Path) -> None:
    source = jupytext.read(ipynb.with_suffix(".py"))
    stored = nbformat.read(ipynb, as_version=4)
    assert _cells(stored) == _cells(source), (
        f"{ipynb.name} and {ipynb.with_suffix('.py').name} differ: edit the .py, then run "
        f"`jupytext --sync {ipynb.relative_to(NOTEBOOKS.parent)}` and re-execute it "
        "(CONTRIBUTING.md, 'Notebooks')"
    )

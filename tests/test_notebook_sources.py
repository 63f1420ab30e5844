"""Each notebook has one source: its paired percent-format script. The two must say the same thing."""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
IPYNBS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(notebook) -> list[tuple]:
    """(cell type, source, tags, jupyter metadata) of every cell: what a reader sees, outputs aside."""
    return [
        (
            cell.cell_type,
            cell.source.strip(),
            cell.metadata.get("tags", []),
            cell.metadata.get("jupyter", {}),
            cell.metadata.get("collapsed"),
        )
        for cell in notebook.cells
    ]


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


ANSWER = re.compile(r'^answer\("[^"]+", None\)\s*$', re.MULTILINE)


@pytest.mark.parametrize("ipynb", IPYNBS, ids=lambda p: p.stem)
def test_nbval_flags_are_tags_not_comments(ipynb: Path) -> None:
    """`# NBVAL_IGNORE_OUTPUT` would show on the site and in the learner's cell: nbval reads cell tags too."""
    flagged = [c.source.splitlines()[0] for c in nbformat.read(ipynb, as_version=4).cells if "NBVAL_" in c.source]
    assert not flagged, f"{ipynb.name}: use the cell tags nbval-ignore-output / nbval-skip instead of {flagged}"


@pytest.mark.parametrize("ipynb", IPYNBS, ids=lambda p: p.stem)
def test_each_prediction_is_answered_in_a_collapsed_output(ipynb: Path) -> None:
    """After an answer("x", None) cell, the first cell with output reveals the answer: hidden until asked."""
    code = [c for c in nbformat.read(ipynb, as_version=4).cells if c.cell_type == "code"]
    for i, cell in enumerate(code):
        if not ANSWER.search(cell.source) or (i + 1 < len(code) and ANSWER.search(code[i + 1].source)):
            continue
        reveal = next((c for c in code[i + 1 :] if not ANSWER.search(c.source) and c.outputs), None)
        if reveal is None:
            continue
        assert "hide-output" in reveal.metadata.get("tags", []), (
            f"{ipynb.name}: the cell after {cell.source.strip().splitlines()[-1]} shows the answer: tag it "
            "hide-output (the site collapses it) and set jupyter.outputs_hidden (JupyterLab collapses it)"
        )
        # JupyterLab keeps `collapsed` and `jupyter.outputs_hidden` equal: one without the other marks it modified.
        assert (
            reveal.metadata.get("jupyter", {}).get("outputs_hidden") is True
            and reveal.metadata.get("collapsed") is True
        )


@pytest.mark.parametrize("ipynb", IPYNBS, ids=lambda p: p.stem)
def test_colab_setup_cell_is_collapsed_on_the_site(ipynb: Path) -> None:
    first = next(c for c in nbformat.read(ipynb, as_version=4).cells if c.cell_type == "code")
    assert "In Google Colab" in first.source and "hide-input" in first.metadata.get("tags", [])


def test_stored_kernelspec_is_the_installed_one() -> None:
    """JupyterLab rewrites a display name that differs from the installed kernel's: the notebook shows modified."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        installed = KernelSpecManager().get_kernel_spec("python3").display_name
    except NoSuchKernel:
        pytest.skip("no python3 kernel installed here (ipykernel)")
    for ipynb in IPYNBS:
        stored = nbformat.read(ipynb, as_version=4).metadata.kernelspec
        assert stored.display_name == installed, (
            f"{ipynb.name} stores kernel display name {stored.display_name!r}, the installed one is {installed!r}"
        )


IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")
# What a learner should never read in a stored output: progress bars, logger lines, warnings with the kernel's paths.
NOISE = re.compile(r"\d+/\d+ \[[\d:<]+|it/s\]|s/it\]| - WARNING - |Warning: |/tmp/ipykernel_")


@pytest.mark.parametrize("ipynb", IPYNBS, ids=lambda p: p.stem)
def test_every_figure_has_a_caption(ipynb: Path) -> None:
    """A `# Figure: ...` line: the site's caption and alt text (scripts/build_site.py), a reader's summary here."""
    for cell in nbformat.read(ipynb, as_version=4).cells:
        if cell.cell_type == "code" and any(t in o.get("data", {}) for o in cell.outputs for t in IMAGE_TYPES):
            assert re.search(r"^# Figure: \S", cell.source, re.MULTILINE), (
                f"{ipynb.name}: the cell drawing a figure needs a '# Figure: what it shows' line:\n{cell.source[:200]}"
            )


@pytest.mark.parametrize("ipynb", IPYNBS, ids=lambda p: p.stem)
def test_stored_outputs_hold_no_progress_bars_logger_lines_or_warnings(ipynb: Path) -> None:
    """scripts/execute_notebooks.py runs with KVCOURSE_PROGRESS=0 and the sources silence what they emit."""
    noisy = [
        o["text"][:120]
        for c in nbformat.read(ipynb, as_version=4).cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "stream" and NOISE.search(o.get("text", ""))
    ]
    assert not noisy, f"{ipynb.name} stores output a learner should not read: {noisy[:3]}"

"""Rebuild notebooks from their .py sources and execute them against the reference solutions.

    python scripts/execute_notebooks.py notebooks/03_paged_allocator.py [...]   # default: all

For each notebook: read the percent-format source `notebooks/NN_*.py` (the one maintainers edit),
run every cell with KVCOURSE_SOLUTIONS=1 in the notebooks folder, and write `notebooks/NN_*.ipynb`
with those outputs (what nbval then checks). Pass either the .py or the .ipynb path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def execute(source: Path) -> Path:
    """Execute one notebook's source with the reference solutions and store it, outputs included."""
    os.environ["KVCOURSE_SOLUTIONS"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    notebook = jupytext.read(source)
    notebook.metadata["kernelspec"] = KERNELSPEC
    client = NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(source.parent)}},
    )
    client.execute()
    target = source.with_suffix(".ipynb")
    nbformat.write(notebook, target)
    print(f"executed {target.relative_to(ROOT)}")
    return target


if __name__ == "__main__":
    given = [Path(p).resolve() for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    for path in given:
        execute(path.with_suffix(".py"))

"""What every notebook builder shares: prose and code cells, and writing the notebook (outputs empty).

Each scripts/build_nb_NN.py lists its cells and calls write_notebook(); then
`KVCOURSE_SOLUTIONS=1 python scripts/execute_notebooks.py notebooks/NN_*.ipynb` stores the outputs.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def md(text: str) -> nbformat.NotebookNode:
    """A prose cell."""
    return new_markdown_cell(text.strip())


def code(text: str, hidden: bool = False, tags: list[str] | None = None) -> nbformat.NotebookNode:
    """A code cell; `hidden` folds its source in JupyterLab (drawing code, not the lesson)."""
    cell = new_code_cell(text.strip())
    if hidden:
        cell.metadata["jupyter"] = {"source_hidden": True}
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def write_notebook(filename: str, cells: list[nbformat.NotebookNode]) -> None:
    """Write notebooks/<filename> with the kernel metadata JupyterLab and nbval expect."""
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    notebook.metadata["language_info"] = {"name": "python"}
    nbformat.write(notebook, NOTEBOOKS / filename)
    print(f"wrote notebooks/{filename} ({len(cells)} cells)")

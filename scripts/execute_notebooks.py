"""Execute notebooks in place against the reference solutions, so their stored outputs are the reference's.

python scripts/execute_notebooks.py notebooks/03_paged_allocator.ipynb [...]   # default: all
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path) -> None:
    """Run every cell with KVCOURSE_SOLUTIONS=1 in the notebooks folder and save the outputs."""
    os.environ["KVCOURSE_SOLUTIONS"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    nbformat.write(notebook, path)
    print(f"executed {path.relative_to(ROOT)}")


if __name__ == "__main__":
    paths = [Path(p).resolve() for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for notebook_path in paths:
        execute(notebook_path)

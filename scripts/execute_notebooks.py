"""Rebuild notebooks from their .py sources and execute them against the reference solutions.

    python scripts/execute_notebooks.py notebooks/03_paged_allocator.py [...]   # default: all

For each notebook: read the percent-format source `notebooks/NN_*.py` (the one maintainers edit),
run every cell with KVCOURSE_SOLUTIONS=1 in the notebooks folder, and write `notebooks/NN_*.ipynb`
with those outputs (what nbval then checks). Pass either the .py or the .ipynb path.

Widgets are stored twice, for viewers without a kernel (the course's website, `./course book`):
ipywidgets' embedded state in the notebook's metadata (`widgets`, as JupyterLab's "Save Widget State"
writes it), and, for every block-table widget, each step of its run drawn as static HTML in its output's
metadata (scripts/widget_frames.py says how). The picture is drawn in Python, so without the frames a page
could show only the step on screen when the cell ran.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient
from widget_frames import store_frames  # scripts/, beside this file

ROOT = Path(__file__).resolve().parent.parent
# The display name ipykernel installs: another one makes JupyterLab rewrite it on opening (the notebook shows modified).
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}

# Run in the kernel after the notebook's own cells: every block-table widget still alive, by model id.
_COLLECT_FRAMES = """\
import gc as _gc, json as _json
from kvcourse.viz.widgets import BlockTableWidget as _BlockTableWidget
print(_json.dumps({
    _w.model_id: [_w.to_html(_i) for _i in range(len(_w.snapshots))]
    for _w in _gc.get_objects()
    if isinstance(_w, _BlockTableWidget) and _w.model_id
}))
"""


def _read_frames(cell: nbformat.NotebookNode) -> dict[str, list[str]]:
    """The collector cell's printed JSON (an error there is a broken widget module: say so)."""
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stdout")
    if not text.strip():
        raise RuntimeError(f"collecting the block-table widgets' frames printed nothing: {cell.outputs}")
    return json.loads(text)


def execute(source: Path) -> Path:
    """Execute one notebook's source with the reference solutions and store it, outputs included."""
    os.environ["KVCOURSE_SOLUTIONS"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["KVCOURSE_PROGRESS"] = "0"  # no tqdm bars in the stored outputs (the site and nbval show them raw)
    notebook = jupytext.read(source)
    notebook.metadata["kernelspec"] = KERNELSPEC
    collector = nbformat.v4.new_code_cell(_COLLECT_FRAMES)
    notebook.cells.append(collector)
    client = NotebookClient(
        notebook,
        timeout=900,
        kernel_name="python3",
        record_timing=False,
        store_widget_state=True,  # ipywidgets' embedded state into metadata.widgets (nbclient's default, stated)
        resources={"metadata": {"path": str(source.parent)}},
    )
    try:
        client.execute()
    finally:
        notebook.cells.remove(collector)
    stored = store_frames(notebook, _read_frames(collector))
    target = source.with_suffix(".ipynb")
    nbformat.write(notebook, target)
    print(f"executed {target.relative_to(ROOT)}" + (f" ({stored} block-table widget(s) with frames)" if stored else ""))
    return target


if __name__ == "__main__":
    given = [Path(p).resolve() for p in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    for path in given:
        execute(path.with_suffix(".py"))

"""Rebuild notebooks from their .py sources and execute them against the reference solutions.

    python scripts/execute_notebooks.py notebooks/03_paged_allocator.py [...]   # default: all

For each notebook: read the percent-format source `notebooks/NN_*.py` (the one maintainers edit),
run every cell with KVCOURSE_SOLUTIONS=1 in the notebooks folder, and write `notebooks/NN_*.ipynb`
with those outputs (what nbval then checks). Pass either the .py or the .ipynb path.

Widgets are stored twice, for viewers without a kernel (the course's website, `./course book`):
ipywidgets' embedded state in the notebook's metadata (`widgets`, as JupyterLab's "Save Widget State"
writes it), and, for every block-table widget, each step of its run drawn as static HTML in its output's
metadata (`kvcourse`: `steps`, and `frames_zlib`, the JSON list of frames zlib-compressed and base64-encoded,
as images are stored: a long run's frames are megabytes of HTML, and a few percent of that compressed). The
picture is drawn in Python, so without the frames a page could show only the step on screen when the cell ran.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import zlib
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FRAMES_KEY = "kvcourse"  # output metadata: {"steps": N, "frames_zlib": ...} (nbval does not compare metadata)

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


def _widget_outputs(notebook: nbformat.NotebookNode):
    """Every output that displays a widget, with that widget's model id."""
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view:
                yield output, view["model_id"]


def encode_frames(frames: list[str]) -> dict:
    """A widget's frames as stored in its output's metadata: the step count and the compressed list."""
    packed = zlib.compress(json.dumps(frames, ensure_ascii=False).encode(), 9)
    return {"steps": len(frames), "frames_zlib": base64.b64encode(packed).decode("ascii")}


def decode_frames(stored: dict) -> list[str]:
    """The frames back from `encode_frames`'s form (what the website's build reads)."""
    frames = json.loads(zlib.decompress(base64.b64decode(stored["frames_zlib"])).decode())
    if len(frames) != stored["steps"]:
        raise ValueError(f"stored frames say {stored['steps']} steps but hold {len(frames)}: re-execute the notebook.")
    return frames


def store_frames(notebook: nbformat.NotebookNode, frames: dict[str, list[str]]) -> int:
    """Put each block-table widget's frames into the metadata of the output that shows it; how many."""
    stored = 0
    for output, model_id in _widget_outputs(notebook):
        if model_id in frames:
            output.setdefault("metadata", {})[FRAMES_KEY] = encode_frames(frames[model_id])
            stored += 1
    return stored


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

"""A block-table widget's frames as the notebooks store them (scripts/execute_notebooks.py writes, build_site.py reads).

Every step of a recorded run, drawn as static HTML, kept in the metadata of the output that shows the
widget: `{"kvcourse": {"steps": N, "frames_zlib": base64(zlib(JSON list of HTML))}}`. Compressed as images
are stored (base64): a long run's frames are megabytes of HTML and a few percent of that compressed.
nbval does not compare output metadata, so the frames never make a notebook check fail.
"""

from __future__ import annotations

import base64
import json
import zlib

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
FRAMES_KEY = "kvcourse"


def encode_frames(frames: list[str]) -> dict:
    """A widget's frames as stored in its output's metadata: the step count and the compressed list."""
    packed = zlib.compress(json.dumps(frames, ensure_ascii=False).encode(), 9)
    return {"steps": len(frames), "frames_zlib": base64.b64encode(packed).decode("ascii")}


def decode_frames(stored: dict) -> list[str]:
    """The frames back from `encode_frames`'s form."""
    frames = json.loads(zlib.decompress(base64.b64decode(stored["frames_zlib"])).decode())
    if len(frames) != stored["steps"]:
        raise ValueError(f"stored frames say {stored['steps']} steps but hold {len(frames)}: re-execute the notebook.")
    return frames


def widget_outputs(notebook: dict):
    """Every output that displays a widget, with that widget's model id."""
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view:
                yield output, view["model_id"]


def store_frames(notebook: dict, frames: dict[str, list[str]]) -> int:
    """Put each block-table widget's frames into the metadata of the output that shows it; how many."""
    stored = 0
    for output, model_id in widget_outputs(notebook):
        if model_id in frames:
            output.setdefault("metadata", {})[FRAMES_KEY] = encode_frames(frames[model_id])
            stored += 1
    return stored

"""Notebook 03 as a learner meets it: JupyterLab in a real browser, run against the reference.

Starts JupyterLab (loopback, free port, random token, fresh settings) on a copy of the notebook
with its outputs cleared, opens it in headless Chromium, runs Run > Run All Cells, and checks in
the page: no error output, every block-table widget drawn live with the right number of blocks,
and stepping it (step button, slider) changes what it shows. Screenshots go to build/screenshots/.

Needs Debian's `chromium` at /usr/bin/chromium (.ci/run installs it); skips where it is absent.
KVCOURSE_BROWSER_NOTEBOOK=path/to/other.ipynb points the test at another notebook.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from browser_support import (
    CHROMIUM,
    ERROR_OUTPUT,
    JupyterLab,
    browser,
    count_code_cells,
    open_notebook,
    page_state,
    run_all_cells,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = Path(os.environ.get("KVCOURSE_BROWSER_NOTEBOOK", ROOT / "notebooks" / "03_paged_allocator.ipynb"))
SCREENSHOTS = ROOT / "build" / "screenshots"
VIEWPORT = {"width": 1400, "height": 1000}
WIDGET_REPR = re.compile(r"BlockTableWidget\((\d+) steps, (\d+) blocks of (\d+) tokens; step (\d+)\)")

# A live block-table widget: the ipywidgets HTML view holding the grid that kvcourse/widgets.py draws
# (the static text/html copy in the same output is not shown where the widget renders).
LIVE_WIDGET = ".jp-OutputArea-output:has(.widget-html-content .kv-widget)"


@dataclass(frozen=True)
class ExpectedWidget:
    """What the committed notebook (run against the reference) says one widget shows."""

    steps: int
    blocks: int
    block_size: int
    step: int


def expected_widgets(notebook: Path) -> list[ExpectedWidget]:
    """Every BlockTableWidget in the notebook's stored outputs, in order, from its text/plain repr."""
    found = []
    for cell in json.loads(notebook.read_text())["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("data", {}).get("text/plain", ""))
            found += [ExpectedWidget(*map(int, m.groups())) for m in WIDGET_REPR.finditer(text)]
    return found


_WIDGET_STATE_JS = """(output) => {
  const view = output.querySelector('.widget-html-content .kv-widget');
  const readout = output.querySelector('.widget-slider .widget-readout');
  const blocks = [...view.querySelectorAll('.kv-block')];
  return {
    step: view.dataset.step,
    numBlocks: view.dataset.numBlocks,
    readout: readout ? readout.textContent.trim() : null,
    blocks: blocks.length,
    grid: blocks.map(b => [b.dataset.blockId, b.dataset.state, b.dataset.owners, b.dataset.tokens].join(':')).join(' '),
    html: view.innerHTML,
  };
}"""


def widget_state(output) -> dict:
    """What one live widget shows right now: its step, readout, blocks and grid."""
    return output.evaluate(_WIDGET_STATE_JS)


def wait_for_step(output, step: int, what: str) -> dict:
    """Wait until the widget's picture and its slider readout both show `step`."""
    return wait_for(
        lambda: (lambda s: s if s["step"] == str(step) and s["readout"] == str(step) else None)(widget_state(output)),
        10,
        what,
        lambda: f"The widget shows {widget_state(output)['step']!r}, its readout {widget_state(output)['readout']!r}.",
    )


def check_widget(output, expected: ExpectedWidget, index: int) -> None:
    """Right number of blocks; the step button and the slider each change the picture."""
    name = f"block-table widget #{index + 1}"
    start = widget_state(output)
    assert start["blocks"] == expected.blocks and start["numBlocks"] == str(expected.blocks), (
        f"{name} draws {start['blocks']} blocks (data-num-blocks={start['numBlocks']!r}); "
        f"the notebook run against the reference has {expected.blocks}."
    )
    assert start["step"] == str(expected.step) and start["readout"] == str(expected.step), (
        f"{name} opens at step {start['step']!r} (slider readout {start['readout']!r}), not at step {expected.step}."
    )
    if expected.steps < 2:
        return
    # The slider, by keyboard on its handle as a learner could: End = last step, Home = step 0.
    handle = output.locator(".widget-slider .noUi-handle").first
    handle.focus()
    handle.press("End")
    last = wait_for_step(output, expected.steps - 1, f"{name}: the slider moving to the last step")
    handle.press("Home")
    first = wait_for_step(output, 0, f"{name}: the slider moving back to step 0")
    assert last["html"] != first["html"], f"{name}: the first and last steps draw the same picture."
    # The step buttons: forward until the blocks themselves change, then one step back.
    forward = output.locator("button.widget-button", has_text="step ▶").first
    current = first
    for step in range(1, expected.steps):
        before = current
        forward.click()
        current = wait_for_step(output, step, f"{name}: the 'step ▶' button moving to step {step}")
        assert current["html"] != before["html"], f"{name}: step {step} draws exactly what step {step - 1} drew."
        if current["grid"] != first["grid"]:
            break
    assert current["grid"] != first["grid"], f"{name}: stepping through the whole run never changes a single block."
    output.locator("button.widget-button", has_text="◀ step").first.click()
    wait_for_step(output, step - 1, f"{name}: the '◀ step' button moving back to step {step - 1}")
    handle.press("Home")
    wait_for_step(output, 0, f"{name}: the slider moving back to step 0")


def save_screenshot(page, output, name: str) -> Path:
    """The JupyterLab window scrolled to the widget, and the widget alone, under build/screenshots/."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    if output is not None:
        output.scroll_into_view_if_needed()
        output.screenshot(path=SCREENSHOTS / f"{name}_widget.png")
    page.screenshot(path=path)
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_notebook_03_runs_in_jupyterlab_with_a_live_block_table_widget() -> None:
    if not CHROMIUM.exists():
        pytest.skip(
            f"Debian's chromium is not installed at {CHROMIUM} (.ci/run installs it: apt-get install -y chromium)"
        )
    pytest.importorskip("playwright.sync_api", reason="Python playwright is not installed (pip install -e .)")
    if not NOTEBOOK.exists():
        pytest.skip(f"{NOTEBOOK.relative_to(ROOT) if NOTEBOOK.is_relative_to(ROOT) else NOTEBOOK} does not exist yet")
    expected = expected_widgets(NOTEBOOK)
    assert expected, (
        f"{NOTEBOOK.name} has no stored BlockTableWidget output: run it against the reference and store its "
        "outputs (scripts/execute_notebooks.py), so this test knows how many blocks the widget must draw."
    )
    stem = NOTEBOOK.stem
    with JupyterLab([NOTEBOOK], env={"KVCOURSE_SOLUTIONS": "1"}) as lab, browser() as chromium:
        page = chromium.new_page(viewport=VIEWPORT)
        output = None
        try:
            open_notebook(page, lab, NOTEBOOK.name)
            run_all_cells(page, lab, expected_cells=count_code_cells(NOTEBOOK), timeout_s=150)
            outputs = page.locator(LIVE_WIDGET)
            wait_for(
                lambda: outputs.count() >= len(expected),
                20,
                f"{len(expected)} live block-table widget(s) appearing",
                lambda: f"{outputs.count()} appeared. Error outputs: {page_state(page)['errors']}",
            )
            assert outputs.count() == len(expected), (
                f"the page shows {outputs.count()} live block-table widgets; the stored notebook has {len(expected)}."
            )
            for index, widget in enumerate(expected):
                check_widget(outputs.nth(index), widget, index)
            errors = page.locator(ERROR_OUTPUT)
            assert errors.count() == 0, "error output in the page:\n" + "\n---\n".join(errors.all_inner_texts())
            output = outputs.first
            # Back to the step the notebook opens the first widget at (at least 1: blocks in use).
            shown = max(1, expected[0].step)
            for step in range(1, shown + 1):
                output.locator("button.widget-button", has_text="step ▶").first.click()
                wait_for_step(output, step, f"the first widget moving to step {step} for the screenshot")
            save_screenshot(page, output, stem)
            (SCREENSHOTS / f"{stem}_failure.png").unlink(missing_ok=True)  # a stale one from an earlier run
        except BaseException:
            save_screenshot(page, None, f"{stem}_failure")
            raise
        finally:
            page.close()


def test_expected_widgets_reads_the_stored_repr(tmp_path: Path) -> None:
    notebook = tmp_path / "n.ipynb"
    outputs = [
        {
            "output_type": "execute_result",
            "data": {"text/plain": ["BlockTableWidget(7 steps, 12 blocks of 4 tokens; step 0)"]},
        }
    ]
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["w"], "outputs": outputs}]}))
    assert expected_widgets(notebook) == [ExpectedWidget(7, 12, 4, 0)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["00_setup_and_kv_cache.ipynb", "02_scheduler_cache_contract.ipynb"])
def test_opening_a_notebook_in_jupyterlab_leaves_it_unmodified(name: str) -> None:
    """JupyterLab marks a notebook modified (and autosave rewrites the tracked file) when it normalises what
    the file stores: a kernel display name other than the installed one, `collapsed` without
    `jupyter.outputs_hidden` or the reverse. Opened and left alone, the tab must stay clean."""
    if not CHROMIUM.exists():
        pytest.skip(
            f"Debian's chromium is not installed at {CHROMIUM} (.ci/run installs it: apt-get install -y chromium)"
        )
    pytest.importorskip("playwright.sync_api", reason="Python playwright is not installed (pip install -e .)")
    notebook = ROOT / "notebooks" / name
    with JupyterLab([notebook], env={"KVCOURSE_SOLUTIONS": "1"}) as lab, browser() as chromium:
        page = chromium.new_page(viewport=VIEWPORT)
        try:
            open_notebook(page, lab, name)
            page.wait_for_timeout(5000)  # the metadata is normalised as the notebook loads: seconds, not minutes
            dirty = page.locator(".lm-TabBar-tab.jp-mod-dirty")
            assert dirty.count() == 0, (
                f"{name} shows as modified right after opening, without an edit: the stored metadata differs from "
                "what JupyterLab writes (kernelspec display name? collapsed / jupyter.outputs_hidden?)"
            )
        except BaseException:
            save_screenshot(page, None, f"{notebook.stem}_opened_failure")
            raise
        finally:
            page.close()

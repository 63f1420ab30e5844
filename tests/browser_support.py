"""Drive a notebook in JupyterLab in a real (headless) Chromium, for tests/test_browser.py.

Nothing is installed at run time: Chromium is Debian's `chromium` (installed by .ci/run) and
Python `playwright` drives it through `executable_path`; no browser is downloaded.

    with JupyterLab([notebook], env={...}) as lab, browser() as chromium:
        page = chromium.new_page(viewport=...)
        open_notebook(page, lab, notebook.name)
        run_all_cells(page, lab, expected_cells=count_code_cells(notebook))

The server runs on a free loopback port with a random token, with fresh JUPYTER_* and
JUPYTERLAB_* directories (an old workspace would restore an old layout and may start two
kernels), and serves COPIES of the notebooks from a temporary root, so that autosave can never
write outputs back into the repository.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = Path(os.environ.get("KVCOURSE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# JupyterLab user settings written into the fresh JUPYTERLAB_SETTINGS_DIR.
LAB_SETTINGS = {
    # No news pop-up, no update check: it would cover the notebook and reach for the network.
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    # Attach every cell to the DOM, so that off-screen outputs can be inspected too.
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


class BrowserTestError(AssertionError):
    """A step of the browser test did not happen in time; the message says which and what was seen."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def count_code_cells(notebook: Path) -> int:
    """Code cells with some source: JupyterLab gives each of them an execution count when run."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(1 for c in cells if c["cell_type"] == "code" and "".join(c["source"]).strip())


def without_outputs(notebook: Path) -> dict:
    """The notebook's JSON with every code cell's outputs and execution count cleared."""
    data = json.loads(notebook.read_text())
    for cell in data["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    data.get("metadata", {}).pop("widgets", None)  # stored widget state of the committed run
    return data


class JupyterLab:
    """A JupyterLab server in a temporary root; a context manager that always shuts it down.

    `serve_dir` serves an existing folder in place instead of copies (a learner's checkout);
    `launcher` is the command that starts JupyterLab (default: this Python's `-m jupyterlab`, which
    also runs the kernel); the server options are appended to it.
    """

    def __init__(
        self,
        notebooks: list[Path] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 60,
        serve_dir: Path | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        self.notebooks = list(notebooks)
        self.serve_dir = serve_dir
        self.launcher = launcher or [sys.executable, "-m", "jupyterlab"]
        self.extra_env = env or {}
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.token = secrets.token_hex(24)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> JupyterLab:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvcourse-lab-")
        tmp = Path(self._tmp.name)
        self.root = Path(self.serve_dir) if self.serve_dir is not None else tmp / "root"
        self.root.mkdir(exist_ok=True)
        for notebook in self.notebooks:
            # Without stored outputs: every prompt, output and widget seen later comes from this run.
            (self.root / notebook.name).write_text(json.dumps(without_outputs(notebook), indent=1))
        dirs = {
            name: tmp / name.lower()
            for name in (
                "JUPYTER_RUNTIME_DIR",
                "JUPYTER_CONFIG_DIR",
                "JUPYTER_DATA_DIR",
                "JUPYTERLAB_SETTINGS_DIR",
                "JUPYTERLAB_WORKSPACES_DIR",
            )
        }
        for path in dirs.values():
            path.mkdir()
        for plugin, values in LAB_SETTINGS.items():
            target = dirs["JUPYTERLAB_SETTINGS_DIR"] / f"{plugin}.jupyterlab-settings"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(values))
        env = {key: value for key, value in os.environ.items() if not key.startswith(("JUPYTER", "JPY_"))}
        env.update({k: str(v) for k, v in dirs.items()})
        env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        env.update(self.extra_env)
        self.log_path = tmp / "jupyterlab.log"
        self._log = self.log_path.open("w")
        command = [
            *self.launcher,
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.open_browser=False",
            "--LabApp.expose_app_in_browser=True",
        ]
        # A new session, so that stopping the server also stops the kernels it started.
        self.process = subprocess.Popen(
            command, cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_until_up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrowserTestError(
                    f"JupyterLab exited with code {self.process.returncode} at start:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/api/status?token={self.token}", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise BrowserTestError(
            f"JupyterLab did not answer on {self.base_url} within {self.start_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def __exit__(self, *exc_info) -> None:
        try:
            if self.process is not None and self.process.poll() is None:
                try:
                    request = urllib.request.Request(f"{self.base_url}/api/shutdown?token={self.token}", method="POST")
                    urllib.request.urlopen(request, timeout=5).close()
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                try:
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait(timeout=10)
            if self.process is not None:
                # Anything the server left behind in its session (a kernel that did not stop).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, signal.SIGKILL)
        finally:
            if getattr(self, "_log", None) is not None:
                self._log.close()
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    # -- helpers -------------------------------------------------------------------------
    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log (kernel crashes and tracebacks land there)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"

    def notebook_url(self, name: str) -> str:
        """The URL that opens one notebook in JupyterLab, logged in by the token."""
        return f"{self.base_url}/lab/tree/{name}?token={self.token}&reset"


@contextlib.contextmanager
def browser() -> Iterator[object]:
    """Debian's Chromium, headless, with a fresh profile; always closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


# -- the page ------------------------------------------------------------------------------
# Error outputs as older JupyterLabs draw them (4.6 draws them as stderr: see _PAGE_STATE_JS).
ERROR_OUTPUT = '[data-mime-type="application/vnd.jupyter.error"]'

_PAGE_STATE_JS = """(errorSelector) => {
  // JupyterLab 4.6 draws an error output with the stderr MIME type, so read the notebook model too
  // (exposed by --LabApp.expose_app_in_browser): every output whose output_type is "error".
  const modelErrors = () => {
    const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const cells = widget && widget.content && widget.content.model ? widget.content.model.cells : null;
    const found = [];
    for (let i = 0; cells && i < cells.length; i++) {
      const outputs = cells.get(i).outputs;
      for (let j = 0; outputs && j < outputs.length; j++) {
        const out = outputs.get(j).toJSON();
        if (out.output_type === 'error') {
          const trace = (out.traceback || []).join('\\n').replace(/\\u001b\\[[0-9;]*m/g, '');
          found.push(`cell ${i + 1}: ${out.ename}: ${out.evalue}\\n${trace.slice(-2000)}`);
        }
      }
    }
    return found;
  };
  const modelCounts = () => {
    const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const cells = widget && widget.content && widget.content.model ? widget.content.model.cells : null;
    if (!cells) return null;
    let numbered = 0, running = 0;
    for (let i = 0; i < cells.length; i++) {
      const cell = cells.get(i);
      if (cell.type !== 'code') continue;
      if (cell.executionCount !== null && cell.executionCount !== undefined) numbered++;
      if (cell.executionState === 'running') running++;
    }
    return {numbered, running};
  };
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)') || document;
  const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim());
  // Execution counts from the model: a cell with hidden source (jupyter.source_hidden) has no prompt.
  const counts = modelCounts();
  const status = [...document.querySelectorAll('#jp-main-statusbar .jp-StatusBar-TextItem')].map(e => e.textContent);
  return {
    prompts,
    numbered: counts ? counts.numbered : prompts.filter(p => /^\\[\\d+\\]:$/.test(p)).length,
    running: Math.max(prompts.filter(p => p.includes('*')).length, counts ? counts.running : 0),
    errors: [...modelErrors(), ...[...panel.querySelectorAll(errorSelector)].map(e => e.innerText.slice(0, 2000))],
    status: status.join(' '),
  };
}"""


def page_state(page) -> dict:
    """Execution prompts, error outputs and the status bar text, read from the page."""
    return page.evaluate(_PAGE_STATE_JS, ERROR_OUTPUT)


def wait_for(predicate, timeout_s: float, what: str, describe=lambda: "", interval_s: float = 0.25):
    """Poll `predicate` until it returns something truthy; fail saying what did not happen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BrowserTestError(f"{what} did not happen within {timeout_s:.0f} s. {describe()}")
        time.sleep(interval_s)


def open_notebook(page, lab: JupyterLab, name: str, timeout_s: float = 60) -> None:
    """Open a notebook and wait until its kernel exists and is idle ("| Idle" in the status bar).

    The notebook toolbar's indicator turns idle before the kernel exists, and cells run then are
    silently dropped; the status bar's "<kernel> | Idle" appears only once the kernel answered.
    """
    page.goto(lab.notebook_url(name), timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=timeout_s * 1000)

    def kernel_idle() -> bool:
        # A notebook without kernelspec metadata asks which kernel to start: take the default.
        dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
        if dialog.count():
            dialog.locator("button.jp-mod-accept").first.click()
        return "| Idle" in page_state(page)["status"]

    wait_for(
        kernel_idle,
        timeout_s,
        "The kernel becoming idle (status bar '| Idle')",
        lambda: f"Status bar: {page_state(page)['status']!r}. Server log:\n{lab.log_tail()}",
    )
    # Fold the file browser away: more room for the notebook in the screenshot.
    current = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if current.count():
        current.first.click()


def run_all_cells(page, lab: JupyterLab, expected_cells: int, timeout_s: float = 90) -> dict:
    """Run > Run All Cells from the menu, then wait until every code cell ran; fail fast on an error."""
    page.locator(".lm-MenuBar-itemLabel").filter(has_text=re.compile(r"^Run$")).first.click()
    page.locator(".lm-Menu-itemLabel").filter(has_text=re.compile(r"^Run All Cells$")).first.click()
    # The kernel status goes busy almost at once; wait until every cell has a number and none is queued.
    deadline = time.monotonic() + timeout_s
    while True:
        state = page_state(page)
        if state["errors"]:
            raise BrowserTestError(
                "A cell raised an error while running all cells:\n" + "\n---\n".join(state["errors"])
            )
        if state["numbered"] >= expected_cells and not state["running"] and "| Idle" in state["status"]:
            return state
        if time.monotonic() > deadline:
            raise BrowserTestError(
                f"Run All Cells did not finish within {timeout_s:.0f} s: {state['numbered']} of {expected_cells} code "
                f"cells ran, {state['running']} still queued or running; status bar {state['status']!r}; "
                f"prompts {state['prompts']}.\nServer log:\n{lab.log_tail()}"
            )
        time.sleep(0.5)

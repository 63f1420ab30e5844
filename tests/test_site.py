"""The course's website (`./course book`) in a real browser: every page, as a reader meets it.

Builds the site from the committed notebooks (scripts/build_site.py, into a temporary folder), serves
it on a loopback port and opens every page in headless Chromium, with every request that leaves the
loopback server refused and recorded. Each notebook page must show its title, its stored figures as
loaded images, launch buttons (Colab, Binder) built from kvcourse.course.colab.REPOSITORY, previous/next
links in reading order, and its block-table widgets drawn (stepping through the recorded run where the
notebook stores its frames); no page may log a console error, fail a request, fetch anything from the
network or hold an internal link to a page or anchor that does not exist. Screenshots of the landing page
and of notebook 03's widget go to build/site-screenshots/ (CI keeps them).

Needs Debian's `chromium` (.ci/run installs it) and the dev extra (Sphinx, MyST-NB, the Book Theme);
skips, saying which is missing, without them.
"""

from __future__ import annotations

import contextlib
import functools
import html.parser
import http.server
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from browser_support import CHROMIUM, browser

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # the browser test skips without playwright
    PlaywrightTimeout = TimeoutError

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "build" / "site-screenshots"
VIEWPORT = {"width": 1400, "height": 1000}
WIDGET_REPR = re.compile(r"BlockTableWidget\((\d+) steps, (\d+) blocks of (\d+) tokens; step (\d+)\)")
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


def _load_build_site():
    """scripts/build_site.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_site = _load_build_site()


# -- what the committed notebooks say each page must show ------------------------------------------
@dataclass(frozen=True)
class ExpectedWidget:
    steps: int
    blocks: int
    step: int
    has_frames: bool


@dataclass(frozen=True)
class NotebookPage:
    path: Path
    title: str
    images: int
    widgets: tuple[ExpectedWidget, ...]

    @property
    def page(self) -> str:
        return f"notebooks/{self.path.stem}"


def expected_page(path: Path) -> NotebookPage:
    """Title, image outputs and block-table widgets of one committed notebook."""
    notebook = json.loads(path.read_text())
    images, widgets = 0, []
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            images += any(kind in data for kind in IMAGE_TYPES)
            text = "".join(data.get("text/plain", ""))
            frames = "kvcourse" in output.get("metadata", {})
            for match in WIDGET_REPR.finditer(text):
                steps, blocks, _, step = map(int, match.groups())
                widgets.append(ExpectedWidget(steps, blocks, step, frames))
    markdown = ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "markdown"]
    titles = [m.group(1).strip() for text in markdown if (m := re.search(r"^# (.+)$", text, re.MULTILINE))]
    assert titles, f"{path.name} has no '# title' heading"
    return NotebookPage(path, titles[0], images, tuple(widgets))


NOTEBOOKS = [expected_page(path) for path in build_site.discover_notebooks()]


def _first_words(section: str, count: int = 8) -> str:
    """The opening words of a README section as a page shows them (no Markdown marks)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", section.split("\n\n")[0])
    return " ".join(re.sub(r"[`*_]", "", text).split()[:count])


_README = (ROOT / "README.md").read_text()
README_SECTIONS = {
    name: (heading, _first_words(build_site.readme_section(_README, heading)))
    for heading, name in build_site.README_PAGES
}
ORDER = ["index", *(nb.page for nb in NOTEBOOKS), *(name for _, name in build_site.README_PAGES)]


# -- the site, served ---------------------------------------------------------------------------------
class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serve(folder: Path) -> Iterator[str]:
    """The built site on a free loopback port; the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _Ids(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs) -> None:
        self.ids.update(value for name, value in attrs if name in ("id", "name") and value)


@functools.cache
def anchors(page: Path) -> frozenset[str]:
    """Every id (and name) in one built page: what a #fragment may point at."""
    parser = _Ids()
    parser.feed(page.read_text(errors="replace"))
    return frozenset(parser.ids)


def broken_links(site: Path, base_url: str, hrefs: list[str]) -> list[str]:
    """Internal links of one page whose file or #anchor does not exist in the built site."""
    broken = []
    for href in hrefs:
        if not href.startswith(base_url):
            continue
        parts = urlsplit(href)
        target = site / unquote(parts.path).lstrip("/")
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            broken.append(f"{href} (no such file)")
        elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in anchors(target):
            broken.append(f"{href} (no #{parts.fragment} in {target.relative_to(site)})")
    return broken


# -- one page in the browser -----------------------------------------------------------------------------
@dataclass
class Visit:
    console_errors: list[str]
    failed: list[str]


def open_page(context, url: str):
    """Open a page, recording console errors, failed requests and any request to the outside."""
    page = context.new_page()
    visit = Visit([], [])
    page.on("console", lambda msg: msg.type == "error" and visit.console_errors.append(msg.text))
    page.on("pageerror", lambda error: visit.console_errors.append(f"uncaught: {error}"))
    page.on("requestfailed", lambda req: visit.failed.append(f"{req.url} ({req.failure})"))  # outside: refused
    page.on("response", lambda resp: resp.status >= 400 and visit.failed.append(f"{resp.url} (HTTP {resp.status})"))
    page.goto(url, wait_until="load")
    return page, visit


_IMAGES_JS = """() => [...document.querySelectorAll('article img, main img')].map(img => ({
  src: img.getAttribute('src'), complete: img.complete, width: img.naturalWidth,
  output: !!img.closest('.cell_output, .output')}))"""

_STEPPER_JS = """(el) => {
  const view = el.querySelector('.kv-stepper-frame .kv-widget') || el.querySelector('.kv-widget');
  return {
    ready: el.classList.contains('kv-stepper-ready'),
    step: el.dataset.step,
    widgetStep: view ? view.dataset.step : null,
    numBlocks: view ? view.dataset.numBlocks : null,
    blocks: view ? view.querySelectorAll('.kv-block').length : 0,
    readout: (el.querySelector('.kv-stepper-readout') || {}).textContent,
    slider: (el.querySelector('.kv-stepper-slider') || {}).value,
    grid: view ? [...view.querySelectorAll('.kv-block')].map(b => b.dataset.state + b.dataset.owners + b.dataset.tokens).join(' ') : '',
    html: view ? view.outerHTML : '',
    visible: view ? view.getBoundingClientRect().height > 0 : false,
  };
}"""


def wait_for_step(page, stepper, step: int, name: str) -> dict:
    """Wait until the stepper, its readout, its slider and the drawn widget all show `step`."""
    page.wait_for_function(
        """([el, step]) => el.dataset.step === String(step)
             && el.querySelector('.kv-stepper-frame .kv-widget').dataset.step === String(step)""",
        arg=[stepper.element_handle(), step],
        timeout=5000,
    )
    state = stepper.evaluate(_STEPPER_JS)
    assert state["readout"] == str(step) and state["slider"] == str(step), f"{name}: at step {step} shows {state}"
    return state


def go_to_step(page, stepper, step: int, name: str) -> None:
    """Click the step buttons until the stepper shows `step`."""
    current = int(stepper.evaluate("el => el.dataset.step"))
    button = stepper.locator(".kv-stepper-forward" if step > current else ".kv-stepper-back")
    for now in range(current, step, 1 if step > current else -1):
        button.click()
        wait_for_step(page, stepper, now + (1 if step > current else -1), f"{name} back to step {step}")


def check_widgets(page, notebook: NotebookPage) -> list:
    """Each block-table widget drawn with its blocks at the stored step; a recorded run steps. The widgets."""
    shown = page.locator(".kv-stepper, .kv-static-widget[data-kind='BlockTableWidget']")
    assert shown.count() == len(notebook.widgets), (
        f"{notebook.page}: {shown.count()} block-table widgets drawn, the notebook stores {len(notebook.widgets)}"
    )
    drawn = []
    for index, expected in enumerate(notebook.widgets):
        element, name = shown.nth(index), f"{notebook.page} widget #{index + 1}"
        element.scroll_into_view_if_needed()
        state = element.evaluate(_STEPPER_JS)
        assert state["visible"], f"{name} is not visible (a blank box)"
        assert state["blocks"] == expected.blocks and state["numBlocks"] == str(expected.blocks), (
            f"{name} draws {state['blocks']} blocks; the notebook's widget has {expected.blocks}"
        )
        assert state["widgetStep"] == str(expected.step), (
            f"{name} opens at step {state['widgetStep']}, not {expected.step}"
        )
        drawn.append(element)
        if not expected.has_frames:
            continue
        try:
            page.wait_for_function(
                "(el) => el.classList.contains('kv-stepper-ready')", arg=element.element_handle(), timeout=15000
            )
        except PlaywrightTimeout:
            raise AssertionError(
                f"{name}: the stepper never got ready within 15 s (book/_static/kv-stepper.js did not load its frames)"
            ) from None
        first = element.evaluate(_STEPPER_JS)
        assert first["step"] == str(expected.step), f"{name}: the stepper opens at {first['step']}, not {expected.step}"
        if expected.steps < 2:
            continue
        slider = element.locator(".kv-stepper-slider")
        slider.focus()
        slider.press("End")
        last = wait_for_step(page, element, expected.steps - 1, f"{name} slider End")
        slider.press("Home")
        start = wait_for_step(page, element, 0, f"{name} slider Home")
        assert last["html"] != start["html"], f"{name}: the first and last steps draw the same picture"
        forward = element.locator(".kv-stepper-forward")
        current = start
        for step in range(1, expected.steps):
            forward.click()
            current = wait_for_step(page, element, step, f"{name} 'step ▶'")
            if current["grid"] != start["grid"]:
                break
        assert current["grid"] != start["grid"], f"{name}: stepping through the run never changes a block"
        element.locator(".kv-stepper-back").click()
        wait_for_step(page, element, step - 1, f"{name} '◀ step'")
        go_to_step(page, element, expected.step, name)  # back where the notebook opens it (the screenshot)
    return drawn


def check_launch_buttons(page, notebook: NotebookPage) -> None:
    """Colab and Binder links for this notebook, from the one repository address."""
    from kvcourse.course.colab import REPOSITORY

    org_repo = REPOSITORY.removeprefix("https://github.com/").strip("/")
    path = f"notebooks/{notebook.path.name}"
    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
    colab = f"https://colab.research.google.com/github/{org_repo}/blob/main/{path}"
    binder = f"https://mybinder.org/v2/gh/{org_repo}/main?urlpath=lab/tree/{path}"
    assert colab in hrefs, f"{notebook.page}: no Colab launch link {colab}"
    assert binder in hrefs, f"{notebook.page}: no Binder launch link {binder}"


def check_prev_next(page, base_url: str, name: str) -> None:
    """Previous/next links follow the reading order: landing, notebooks 00.., teaching, serving."""
    index = ORDER.index(name)
    for selector, neighbour in (("a.left-prev", index - 1), ("a.right-next", index + 1)):
        link = page.locator(f".prev-next-area {selector}")
        if 0 <= neighbour < len(ORDER):
            assert link.count() == 1, f"{name}: no '{selector}' link to {ORDER[neighbour]}"
            href = urlsplit(link.first.evaluate("a => a.href")).path
            assert href == f"/{ORDER[neighbour]}.html", f"{name}: '{selector}' goes to {href}, not {ORDER[neighbour]}"
        else:
            assert link.count() == 0, f"{name}: a '{selector}' link past the ends of the book"


def _plain(text: str) -> str:
    """A title as text: one line, straight quotes (Sphinx curls them), no permalink sign."""
    for curly, straight in (("’", "'"), ("‘", "'"), ("“", '"'), ("”", '"')):
        text = text.replace(curly, straight)
    return " ".join(text.split()).rstrip("#¶ ")


# -- the test -------------------------------------------------------------------------------------------------
def _skip_without_tools() -> None:
    if not CHROMIUM.exists():
        pytest.skip(
            f"Debian's chromium is not installed at {CHROMIUM} (.ci/run installs it: apt-get install -y chromium)"
        )
    pytest.importorskip("playwright.sync_api", reason="Python playwright is not installed (pip install -e '.[dev]')")
    for module in ("sphinx", "myst_nb", "sphinx_book_theme"):
        pytest.importorskip(
            module, reason=f"{module} is not installed: the site needs the dev extra (pip install -e '.[dev]')"
        )


def _network_cut_off() -> list[str]:
    """`unshare -n --` where this process may run a command without any network (root, Linux), else []."""
    if not shutil.which("unshare"):
        return []
    probe = subprocess.run(["unshare", "-n", "--", "true"], capture_output=True, check=False)
    return ["unshare", "-n", "--"] if probe.returncode == 0 else []


OFFLINE = _network_cut_off()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The whole site, built as `./course book` builds it, into a temporary folder, with no network if possible."""
    _skip_without_tools()
    out = tmp_path_factory.mktemp("site") / "site"
    command = [*OFFLINE, sys.executable, str(ROOT / "scripts" / "build_site.py"), "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, (
        f"the site's build failed{' offline' if OFFLINE else ''}:\n{result.stdout}{result.stderr}"
    )
    return out


def test_the_build_runs_without_network_and_leaves_no_outside_assets(site: Path) -> None:
    if not OFFLINE:
        pytest.skip("cannot cut this process off the network (unshare -n needs root): built with it")
    assert (site / "index.html").exists() and build_site.external_assets(site) == []


def test_the_download_button_gives_the_notebook_as_committed(site: Path) -> None:
    for path in build_site.discover_notebooks():
        assert (site / "_sources" / "notebooks" / path.name).read_bytes() == path.read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_page_of_the_site_in_chromium(site: Path) -> None:
    assert build_site.external_assets(site) == []
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    outside: list[str] = []
    with serve(site) as base_url, browser() as chromium:
        context = chromium.new_context(viewport=VIEWPORT)

        def refuse_outside(route) -> None:
            outside.append(route.request.url)
            route.abort()

        context.route(re.compile(r"^(?!" + re.escape(base_url) + ")"), refuse_outside)
        by_page = {nb.page: nb for nb in NOTEBOOKS}
        for name in [*ORDER, "search", "genindex"]:
            page, visit = open_page(context, f"{base_url}{name}.html")
            try:
                heading = page.locator("article h1, main h1").first.inner_text()
                notebook = by_page.get(name)
                if notebook is not None:
                    assert _plain(notebook.title) in _plain(heading), (
                        f"{name}: the page's title is {heading!r}, not the notebook's {notebook.title!r}"
                    )
                    images = page.evaluate(_IMAGES_JS)
                    outputs = [img for img in images if img["output"]]
                    assert len(outputs) >= notebook.images, (
                        f"{name}: {len(outputs)} output images on the page, the notebook stores {notebook.images}"
                    )
                    unloaded = [img["src"] for img in images if not (img["complete"] and img["width"] > 0)]
                    assert not unloaded, f"{name}: images that did not load: {unloaded}"
                    check_launch_buttons(page, notebook)
                    widgets = check_widgets(page, notebook)
                    if name.startswith("notebooks/03_") and widgets:
                        widgets[0].scroll_into_view_if_needed()
                        widgets[0].screenshot(path=SCREENSHOTS / "03_widget.png")
                        page.screenshot(path=SCREENSHOTS / "03_page.png")
                if name in ORDER:
                    check_prev_next(page, base_url, name)
                if name in README_SECTIONS:  # the README's section, as the README says it today
                    heading, first_words = README_SECTIONS[name]
                    assert _plain(heading) in _plain(page.locator("article h1").first.inner_text())
                    assert first_words in _plain(page.locator("article").first.inner_text()), (
                        f"{name}: the page does not start as the README's '{heading}' section does: {first_words!r}"
                    )
                if name == "index":
                    table = page.locator("table a[href*='notebooks/']")
                    assert table.count() >= len(NOTEBOOKS), (
                        "the landing page's curriculum table does not link every notebook"
                    )
                    assert page.locator("form[action*='search'], .search-button, button[aria-label*='earch']").count()
                    page.screenshot(path=SCREENSHOTS / "landing.png")
                hrefs = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
                problems += [f"{name}: broken link {b}" for b in broken_links(site, base_url, hrefs)]
                problems += [f"{name}: console error: {e}" for e in visit.console_errors]
                problems += [f"{name}: failed request: {f}" for f in visit.failed if f.startswith(base_url)]
            finally:
                page.close()
        # The search box works offline: a course term finds the notebook that teaches it.
        page, visit = open_page(context, f"{base_url}search.html?q=allocate_slots")
        try:
            page.wait_for_selector("#search-results li a", timeout=20000)
            found = page.eval_on_selector_all("#search-results li a", "els => els.map(a => a.getAttribute('href'))")
            assert any("03_paged_allocator" in href for href in found), f"searching 'allocate_slots' found {found}"
            problems += [f"search: console error: {e}" for e in visit.console_errors]
        finally:
            page.close()
        context.close()
    assert not outside, f"pages reached for the network: {sorted(set(outside))[:10]}"
    assert not problems, "\n".join(problems)
    assert (SCREENSHOTS / "landing.png").exists()
    assert (SCREENSHOTS / "03_widget.png").exists(), "notebook 03's page drew no block-table widget"


# -- the pieces, without a browser ----------------------------------------------------------------------------
def test_readme_sections_become_pages_and_relative_links_point_at_the_repository() -> None:
    from kvcourse.course.colab import REPOSITORY

    readme = (
        "# T\n\nIntro.\n\n## Teaching a class\n\nSee [the guide](CONTRIBUTING.md) and [x](https://a.b/c).\n\n## Next\n"
    )
    body = build_site.readme_section(readme, "Teaching a class")
    assert body.startswith("See") and "## Next" not in body
    fixed = build_site.repository_links(body)
    assert f"[the guide]({REPOSITORY}/blob/main/CONTRIBUTING.md)" in fixed and "(https://a.b/c)" in fixed
    assert build_site.readme_intro(readme) == "# T\n\nIntro.\n"
    with pytest.raises(build_site.SiteError, match="no '## Serve it' section"):
        build_site.readme_section(readme, "Serve it")


def test_curriculum_rows_link_to_the_notebook_pages() -> None:
    table = "| notebook | you build |\n|---|---|\n| 03 A paged KV-cache allocator | free-block queue |\n"
    linked = build_site.link_curriculum(table, [Path("notebooks/03_paged_allocator.ipynb")])
    assert "| [03 A paged KV-cache allocator](notebooks/03_paged_allocator.ipynb) |" in linked


def test_notebooks_are_discovered_in_order_with_any_new_one() -> None:
    found = [p.name for p in build_site.discover_notebooks()]
    assert found == sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) and found[0].startswith(
        "00_"
    )


def test_external_assets_are_found(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text(
        '<script src="https://cdn.example/x.js"></script><a href="https://ok.example">ok</a>'
    )
    (tmp_path / "b.css").write_text("@font-face { src: url(https://fonts.example/f.woff2); }")
    (tmp_path / "c.html").write_text(
        '<link rel="stylesheet" href="_static/local.css"><script src="_static/x.js"></script>'
    )
    found = build_site.external_assets(tmp_path)
    assert len(found) == 2 and found[0].startswith("a.html") and found[1].startswith("b.css")


def test_a_widget_output_becomes_a_stepper_with_its_frames(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import nbformat
    from widget_frames import encode_frames, store_frames

    frames = [f'<div class="kv-widget" data-step="{i}">{i}</div>' for i in range(3)]
    view = {"model_id": "m1", "version_major": 2, "version_minor": 0}
    output = nbformat.v4.new_output(
        "display_data",
        data={build_site.WIDGET_VIEW: view, "text/html": frames[1], "text/plain": "BlockTableWidget(...)"},
    )
    other = nbformat.v4.new_output("display_data", data={build_site.WIDGET_VIEW: {**view, "model_id": "m2"}})
    state = {"m2": {"model_name": "HTMLModel", "state": {"value": "<b>live table</b>"}}}
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("w", outputs=[output, other])])
    notebook.metadata["widgets"] = {build_site.WIDGET_STATE: {"state": state}}
    assert store_frames(notebook, {"m1": frames}) == 1
    assert output.metadata["kvcourse"] == encode_frames(frames)
    assert build_site.render_widgets(notebook) == 1
    stepper = output.data["text/html"]
    assert build_site.WIDGET_VIEW not in output.data and "widgets" not in notebook.metadata
    assert 'data-step="1"' in stepper and frames[1] in stepper and 'max="2"' in stepper
    assert other.data["text/html"] == (
        '<div class="kv-static-widget" data-model-id="m2" data-kind=""><b>live table</b></div>'
    )


# -- publishing -------------------------------------------------------------------------------------------------
WORKFLOW = ROOT / ".github" / "workflows" / "pages.yml"


def test_the_pages_workflow_builds_the_site_and_deploys_it_on_pushes_to_main() -> None:
    """Parsed, not run (GitHub's runners are not reachable from here): the triggers, rights and steps Pages needs."""
    import yaml

    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert triggers["push"]["branches"] == ["main"]
    assert workflow["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    build, deploy = workflow["jobs"]["build"], workflow["jobs"]["deploy"]
    runs = [step["run"] for step in build["steps"] if "run" in step]
    uses = {step["uses"].split("@")[0]: step for step in build["steps"] if "uses" in step}
    assert any("scripts/build_site.py" in run for run in runs), "the workflow does not run the site's build"
    out = build_site.OUT.relative_to(ROOT).as_posix()
    assert any(f"--out {out}" in run for run in runs) and uses["actions/upload-pages-artifact"]["with"]["path"] == out
    install = next(run for run in runs if "pip install" in run)
    assert "-c requirements/ci.lock" in install
    lock = {line.split("==")[0].lower() for line in (ROOT / "requirements" / "ci.lock").read_text().splitlines()}
    packages = [
        word
        for word in install.split()
        if re.fullmatch(r"[a-z][a-z0-9-]+", word) and word not in ("python", "pip", "install")
    ]
    assert packages and all(name in lock for name in packages), (
        f"the workflow installs packages the lock does not pin: {packages}"
    )
    assert deploy["needs"] == "build" and deploy["environment"]["name"] == "github-pages"
    assert [step["uses"].split("@")[0] for step in deploy["steps"]] == ["actions/deploy-pages"]


def test_the_pages_workflow_passes_actionlint() -> None:
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed (it is not a course dependency): the workflow is YAML-checked above")
    result = subprocess.run([actionlint, "-no-color", "-oneline", str(WORKFLOW)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_launch_buttons_follow_the_one_repository_address(monkeypatch) -> None:
    """book/conf.py takes the address from kvcourse.course.colab.REPOSITORY: change it there, every link follows."""
    import runpy

    import kvcourse.course.colab as colab

    monkeypatch.setattr(colab, "REPOSITORY", "https://github.com/another-org/another-course")
    conf = runpy.run_path(str(ROOT / "book" / "conf.py"))
    options = conf["html_theme_options"]
    assert options["repository_url"] == "https://github.com/another-org/another-course"
    assert options["launch_buttons"]["colab_url"] and options["launch_buttons"]["binderhub_url"]
    assert conf["nb_execution_mode"] == "off", "the site must show the stored outputs, never run the notebooks"


def test_the_build_never_deletes_a_folder_it_did_not_make(tmp_path: Path) -> None:
    precious = tmp_path / "my-notes"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(build_site.SiteError, match="not a site this script built"):
        build_site.build(out=precious, stage_dir=tmp_path / "src", doctrees=tmp_path / "doctrees")
    assert (precious / "notes.txt").read_text() == "keep me" and not (tmp_path / "src").exists()
    with pytest.raises(build_site.SiteError, match="not a site this script built"):
        build_site.stage(precious)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_a_notebook_without_a_title_is_refused_in_words(tmp_path: Path) -> None:
    import nbformat

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no heading here")])
    with pytest.raises(build_site.SiteError, match="has no '# title' heading"):
        build_site.notebook_title(notebook, tmp_path / "07_x.ipynb")


def test_unreadable_frames_are_refused_in_words(tmp_path: Path) -> None:
    import nbformat

    view = {"model_id": "m1", "version_major": 2, "version_minor": 0}
    output = nbformat.v4.new_output("display_data", data={build_site.WIDGET_VIEW: view, "text/plain": "W"})
    output.metadata["kvcourse"] = {"steps": 3, "frames_zlib": "bm90IHpsaWI="}  # base64 of 'not zlib'
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_markdown_cell("# 07 · A title"), nbformat.v4.new_code_cell("w", outputs=[output])]
    )
    path = tmp_path / "07_unreadable.ipynb"
    nbformat.write(notebook, path)
    with pytest.raises(build_site.SiteError, match=r"stored frames cannot be read.*re-execute it"):
        build_site.stage_notebook(path, tmp_path / "out.ipynb")


def test_broken_links_finds_a_missing_page_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text('<h2 id="here">x</h2>')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "index.html").write_text("<p>index</p>")
    base = "http://127.0.0.1:1/"
    hrefs = [
        f"{base}a.html#here",
        f"{base}sub/",
        "https://elsewhere.example/x",
        f"{base}gone.html",
        f"{base}a.html#nowhere",
    ]
    assert broken_links(tmp_path, base, hrefs) == [
        f"{base}gone.html (no such file)",
        f"{base}a.html#nowhere (no #nowhere in a.html)",
    ]


def test_a_figure_line_becomes_the_caption_and_the_alt_text() -> None:
    notebook = nbformat.v4.new_notebook()
    drawn = nbformat.v4.new_code_cell("# Figure: hit rate against capacity\nplot()")
    drawn.outputs = [nbformat.v4.new_output("display_data", data={"image/png": "iVBOR"})]
    text_only = nbformat.v4.new_code_cell("# Figure: not a figure\nprint(1)")
    notebook.cells = [drawn, text_only]
    assert build_site.caption_figures(notebook) == 1
    assert drawn.metadata["mystnb"] == {
        "figure": {"caption": "hit rate against capacity"},
        "image": {"alt": "hit rate against capacity"},
    }
    assert "mystnb" not in text_only.metadata


def test_the_site_wraps_long_lines_and_has_a_copy_button() -> None:
    css = (ROOT / "book" / "_static" / "kv-site.css").read_text()
    assert re.search(r"div\.cell_output pre[^{]*\{[^}]*white-space: pre-wrap", css)
    assert "sphinx_copybutton" in (ROOT / "book" / "conf.py").read_text()

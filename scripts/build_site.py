"""Build the course's website from the committed notebooks' stored outputs (`./course book`), never running them.

    python scripts/build_site.py [--out build/site]

Sphinx with MyST-NB and the Sphinx Book Theme (the stack of Jupyter Book 1; book/conf.py). This script
stages the sources in build/site-src/: the landing page (book/index.md, with the README's opening and its
curriculum table filled in), every `notebooks/NN_*.ipynb` in order, and the README's "Teaching a class" and
"Serve it" sections as pages, cut from the README at each build so they cannot drift. A block-table
widget becomes a frame sequence the reader steps through (the frames scripts/execute_notebooks.py
stored); any other widget shows the state stored with the notebook. Then it runs Sphinx and fails if a
page loads a script, style or font from the network: everything comes from the installed packages.
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from widget_frames import FRAMES_KEY, WIDGET_STATE, WIDGET_VIEW, decode_frames  # noqa: E402

from kvcourse.course.colab import PLACEHOLDER_REPOSITORY, REPOSITORY  # noqa: E402

BOOK = ROOT / "book"
OUT = ROOT / "build" / "site"
STAGE = ROOT / "build" / "site-src"
DOCTREES = ROOT / "build" / "site-doctrees"
SITE_MARK = ".buildinfo"  # Sphinx writes it into every HTML build
STAGE_MARK = ".kvcourse-site-sources"
# README sections that become pages: (heading, page name).
README_PAGES = (("Teaching a class", "teaching"), ("Serve it", "serve"))
# What a page may not load from elsewhere: <script src>, <link href> (styles, fonts, icons), CSS url()/@import.
EXTERNAL_ASSET = re.compile(
    r"""<script[^>]*\ssrc=["'](?:https?:)?//[^"']+|<link[^>]*\shref=["'](?:https?:)?//[^"']+|"""
    r"""url\(\s*["']?(?:https?:)?//[^)]+|@import\s+["'](?:https?:)?//[^"']+""",
    re.IGNORECASE,
)


class SiteError(RuntimeError):
    """The site cannot be built as asked; the message says why and what to do."""


# -- README pieces --------------------------------------------------------------------------------
def readme_section(readme: str, heading: str) -> str:
    """The body of the README's `## heading` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(heading)}\s*$\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL)
    if not match:
        raise SiteError(f"README.md has no '## {heading}' section: the site takes that page from it.")
    return match.group(1).strip() + "\n"


def readme_intro(readme: str) -> str:
    """The README's title and opening paragraphs: what the course is and who it is for."""
    match = re.search(r"^# .*?$\n(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    if not match:
        raise SiteError("README.md has no title and opening paragraphs before its first '## ' section.")
    return match.group(0).strip() + "\n"


def repository_links(markdown: str) -> str:
    """Relative links (to the repository's files) point at the repository, so none is broken on the site."""

    def fix(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):
            return match.group(0)
        return f"{match.group(1)}({REPOSITORY}/blob/main/{target})"

    return re.sub(r"(\]\s*)\(([^)\s]+)\)", fix, markdown)


def link_curriculum(table: str, notebooks: list[Path]) -> str:
    """The curriculum table's first column ('00 Setup ...') links to that notebook's page."""
    by_number = {path.name[:2]: path for path in notebooks}

    def fix(match: re.Match) -> str:
        number, title = match.group(1), match.group(2).strip()
        path = by_number.get(number)
        if path is None:
            return match.group(0)
        return f"| [{number} {title}](notebooks/{path.name}) |"

    return re.sub(r"^\| (\d\d) ([^|]+)\|", fix, table, flags=re.MULTILINE)


# -- notebooks ------------------------------------------------------------------------------------
def discover_notebooks(folder: Path = ROOT / "notebooks") -> list[Path]:
    """Every lesson notebook, in order: NN_*.ipynb (a new one is picked up without editing anything)."""
    found = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise SiteError(f"no notebooks/NN_*.ipynb in {folder}: execute them first (scripts/execute_notebooks.py).")
    return found


def _text(value) -> str:
    """A notebook field that may be a string or a list of lines."""
    return "".join(value) if isinstance(value, list) else str(value)


def stepper_html(stored: dict, shown_html: str, model_id: str) -> str:
    """A frame sequence with step buttons, a slider and play, opening at the step the notebook shows.

    The page carries the opening frame as HTML (it shows without scripts) and every frame as the notebook
    stores them, compressed (book/_static/kv-stepper.js inflates them in the browser): a long run's
    frames are megabytes of HTML.
    """
    frames = decode_frames(stored)
    step = frames.index(shown_html) if shown_html in frames else 0
    last = len(frames) - 1
    return (
        f'<div class="kv-stepper" data-model-id="{model_id}" data-steps="{len(frames)}" data-step="{step}">'
        '<div class="kv-stepper-controls">'
        '<button type="button" class="kv-stepper-play" disabled>▶ play</button>'
        '<button type="button" class="kv-stepper-back" disabled>◀ step</button>'
        f'<input type="range" class="kv-stepper-slider" min="0" max="{last}" value="{step}" aria-label="step" disabled>'
        '<button type="button" class="kv-stepper-forward" disabled>step ▶</button>'
        f'<span>step <output class="kv-stepper-readout">{step}</output> of 0–{last}</span></div>'
        f'<div class="kv-stepper-frame">{frames[step]}</div>'
        f'<script type="application/octet-stream" class="kv-stepper-frames">{stored["frames_zlib"]}</script>'
        '<div class="kv-stepper-note">The block-table widget as the notebook recorded it (run against the '
        "reference solutions): step through the run here; in the notebook the same widget runs live.</div></div>"
    )


def static_widget_html(state: dict, model_id: str) -> str:
    """What a widget shows, from ipywidgets' embedded state: HTML and labels drawn, containers walked."""
    model = state.get(model_id)
    if model is None:
        return ""
    values = model.get("state", {})
    name = model.get("model_name", "")
    if name in ("HTMLModel", "HTMLMathModel"):
        return str(values.get("value", ""))
    if name in ("LabelModel", "TextModel", "TextareaModel"):
        return f"<p>{html.escape(str(values.get('value', '')))}</p>"
    children = [c.removeprefix("IPY_MODEL_") for c in values.get("children", [])]
    return "".join(static_widget_html(state, child) for child in children)


def render_widgets(notebook: nbformat.NotebookNode) -> int:
    """Replace every widget output by its static rendering; how many block-table widgets step."""
    state = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    steppers = 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            view = data.get(WIDGET_VIEW)
            if not view:
                continue
            model_id = view["model_id"]
            shown = _text(data.get("text/html", ""))
            stored = output.get("metadata", {}).get(FRAMES_KEY)
            if stored:
                rendered = stepper_html(stored, shown, model_id)
                steppers += 1
            else:
                body = shown or static_widget_html(state, model_id)
                kind = re.match(r"\w*", _text(data.get("text/plain", ""))).group(0)  # 'BlockTableWidget', 'HTML'
                rendered = f'<div class="kv-static-widget" data-model-id="{model_id}" data-kind="{kind}">{body}</div>'
            del data[WIDGET_VIEW]
            data["text/html"] = rendered
            output.get("metadata", {}).pop(FRAMES_KEY, None)
    notebook.metadata.pop("widgets", None)  # drawn above: no widget manager on the page
    return steppers


def notebook_title(notebook: nbformat.NotebookNode, path: Path) -> str:
    """The notebook's first '# ' heading (its page title)."""
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^# (.+)$", _text(cell.source), re.MULTILINE)
            if match:
                return match.group(1).strip()
    raise SiteError(f"{path.name} has no '# title' heading in a markdown cell: the page needs a title.")


FIGURE_CAPTION = re.compile(r"^# Figure: (.+)$", re.MULTILINE)
IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def caption_figures(notebook: nbformat.NotebookNode) -> int:
    """A cell's `# Figure: ...` line becomes its figure's caption and its image's alt text; how many."""
    captioned = 0
    for cell in notebook.cells:
        match = FIGURE_CAPTION.search(cell.source) if cell.cell_type == "code" else None
        if not match or not any(t in o.get("data", {}) for o in cell.get("outputs", []) for t in IMAGE_TYPES):
            continue
        caption = match.group(1).strip()
        cell.metadata["mystnb"] = {"figure": {"caption": caption}, "image": {"alt": caption}}
        captioned += 1
    return captioned


def stage_notebook(path: Path, target: Path) -> str:
    """Copy one notebook into the staging folder with its widgets drawn; return its title."""
    notebook = nbformat.read(path, as_version=4)
    title = notebook_title(notebook, path)
    try:
        render_widgets(notebook)
        caption_figures(notebook)
    except (ValueError, KeyError, zlib.error) as error:
        raise SiteError(
            f"{path.name}: a block-table widget's stored frames cannot be read ({error!r}); "
            f"re-execute it: python scripts/execute_notebooks.py {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
        ) from error
    nbformat.write(notebook, target)
    return title


# -- the book -------------------------------------------------------------------------------------
def toctree(caption: str, entries: list[str]) -> str:
    """A MyST toctree (the sidebar and the previous/next order), hidden on the page itself."""
    lines = "\n".join(entries)
    return f"```{{toctree}}\n:caption: {caption}\n:hidden:\n:maxdepth: 1\n\n{lines}\n```\n"


def clear(folder: Path, mark: str) -> None:
    """Empty a folder this script made before (it holds `mark`); refuse any other non-empty folder."""
    if not folder.exists():
        return
    if not folder.is_dir() or (any(folder.iterdir()) and not (folder / mark).exists()):
        raise SiteError(
            f"{folder} exists and is not a site this script built (no {mark} in it): it is left alone. "
            "Choose a new or empty folder with --out (its sources are staged beside it, in OUT-src)."
        )
    shutil.rmtree(folder)


def stage(stage_dir: Path = STAGE) -> list[tuple[str, str]]:
    """Write every source of the site into `stage_dir`; return (page, title) in reading order."""
    readme = (ROOT / "README.md").read_text()
    notebooks = discover_notebooks()
    clear(stage_dir, STAGE_MARK)
    (stage_dir / "notebooks").mkdir(parents=True)
    (stage_dir / STAGE_MARK).write_text("staged by scripts/build_site.py: rebuilt from scratch on every build\n")
    pages = [("index", "kvcourse")]
    for path in notebooks:
        pages.append((f"notebooks/{path.stem}", stage_notebook(path, stage_dir / "notebooks" / path.name)))
    for heading, name in README_PAGES:
        body = repository_links(readme_section(readme, heading))
        (stage_dir / f"{name}.md").write_text(f"# {heading}\n\n{body}")
        pages.append((name, heading))
    curriculum = link_curriculum(repository_links(readme_section(readme, "Curriculum")), notebooks)
    index = (BOOK / "index.md").read_text()
    fills = {
        "intro": repository_links(readme_intro(readme)),
        "repository": f"[{REPOSITORY.removeprefix('https://')}]({REPOSITORY})",
        "curriculum": curriculum,
        "toctree": toctree("Notebooks", [f"notebooks/{p.stem}" for p in notebooks])
        + "\n"
        + toctree("Teaching and serving", [name for _, name in README_PAGES]),
    }
    for key, value in fills.items():
        marker = f"<!-- kvcourse: {key} -->"
        if marker not in index:
            raise SiteError(f"book/index.md lost its '{marker}' marker: the build fills it in.")
        index = index.replace(marker, value)
    (stage_dir / "index.md").write_text(index)
    return pages


def external_assets(site: Path) -> list[str]:
    """Every script, style or font a built page or stylesheet would fetch from the network."""
    found = []
    for path in sorted([*site.rglob("*.html"), *site.rglob("*.css")]):
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(site)}: {m.group(0)[:120]}" for m in EXTERNAL_ASSET.finditer(text)]
    return found


def build(out: Path = OUT, stage_dir: Path = STAGE, doctrees: Path = DOCTREES, jobs: str = "auto") -> Path:
    """Stage, run Sphinx (warnings shown, not fatal), check nothing loads from the network; the index page."""
    clear(out, SITE_MARK)  # before staging: a refused folder stops the build before anything is written
    pages = stage(stage_dir)
    # The configuration (and _static/) stays in book/, so conf.py reads this checkout's REPOSITORY.
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", jobs, "-c", str(BOOK), "-d", str(doctrees)]
    result = subprocess.run([*command, str(stage_dir), str(out)], cwd=ROOT, check=False)
    if result.returncode != 0:
        raise SiteError(f"Sphinx failed (exit {result.returncode}); its messages are above.")
    missing = [page for page, _ in pages if not (out / f"{page}.html").exists()]
    if missing:
        raise SiteError(f"the build wrote no page for {missing}.")
    fetched = external_assets(out)
    if fetched:
        raise SiteError(
            "the site would load scripts, styles or fonts from the network:\n  " + "\n  ".join(fetched[:20])
        )
    for path in discover_notebooks():  # the page's download button gives the notebook as committed
        shutil.copy2(path, out / "_sources" / "notebooks" / path.name)
    (out / ".nojekyll").write_text("")  # GitHub Pages: serve _static/ as it is
    return out / "index.html"


def placeholder_warning(repository: str = REPOSITORY) -> str | None:
    """Say so (stderr) while the repository the site links to is the placeholder; the warning, or None."""
    if repository.rstrip("/") != PLACEHOLDER_REPOSITORY:
        return None
    warning = (
        f"course book: WARNING: the Colab, Binder and repository links point at the placeholder {repository}: "
        "set REPOSITORY in kvcourse/course/colab.py to the course's public repository (README, 'Open in Colab')."
    )
    print(warning, file=sys.stderr)
    return warning


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=OUT,
        help=f"where the site goes (default {OUT.relative_to(ROOT)}; its sources are staged beside it, in OUT-src)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    out = args.out.resolve()
    placeholder_warning()
    try:
        index = build(out, stage_dir=out.with_name(f"{out.name}-src"), doctrees=out.with_name(f"{out.name}-doctrees"))
    except SiteError as error:
        print(f"course book: {error}", file=sys.stderr)
        return 1
    print(f"built {index} in {time.monotonic() - started:.1f} s (open it in a browser)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

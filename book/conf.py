"""Sphinx configuration of the course's website (`./course book`; scripts/build_site.py stages the sources).

The site is Jupyter Book 1's stack used directly: Sphinx, MyST-NB (notebooks as pages, their stored
outputs shown, never executed) and the Sphinx Book Theme (sidebar, previous/next, search, launch buttons).
Every script, style and font comes from these installed packages, so the build needs no network.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcourse.course.colab import REPOSITORY  # noqa: E402  (the one address: Colab table, notebooks, site)

project = "kvcourse"
author = "the kvcourse authors"
html_title = "kvcourse"
root_doc = "index"
extensions = ["myst_nb", "sphinx_copybutton"]  # a copy button on every code cell (pinned in requirements/ci.lock)
# Copy a code cell's input only, never its output, and without the prompts of a shell session.
copybutton_selector = "div.cell_input pre, div.highlight-bash pre, div.highlight-python pre, div.highlight-default pre"
copybutton_prompt_text = "$ "

# The committed notebooks already hold the reference's outputs: show them as they are.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
suppress_warnings = ["misc.highlighting_failure"]

html_theme = "sphinx_book_theme"
html_static_path = ["_static"]
html_css_files = ["kv-site.css"]
html_js_files = ["kv-stepper.js"]
html_favicon = "_static/favicon.svg"  # four KV blocks: three held, one free
html_last_updated_fmt = None
html_show_sourcelink = False
# Light unless the reader picks another (an empty default makes the theme log an error on a first visit).
html_context = {"default_mode": "light"}
html_theme_options = {
    "repository_url": REPOSITORY,
    "repository_branch": "main",
    "path_to_docs": "",  # pages are named as in the repository (notebooks/NN_*.ipynb)
    "use_repository_button": True,
    "use_download_button": True,
    "launch_buttons": {
        "colab_url": "https://colab.research.google.com",
        "binderhub_url": "https://mybinder.org",
        "notebook_interface": "jupyterlab",
    },
    "show_navbar_depth": 1,
    "home_page_in_toc": True,
}

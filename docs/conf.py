"""Sphinx configuration of the fedjax_dg documentation (`make docs`)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))

project = "fedjax_dg"
author = "the fedjax_dg authors"
copyright = "the fedjax_dg authors, Apache-2.0"

extensions = [
    "myst_nb",                 # markdown (MyST) and the colab/ notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",     # Google-style docstrings
    "fedjax_dg_docs",          # reference/generated/: config, algorithms, CLI
]

# The notebooks are shown as stored, never executed here (`make
# test-notebooks` executes them).
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = [
    "_build", "_ext", "bench-logs", "results",
]
suppress_warnings = []

autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_mock_imports = []
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = "fedjax_dg"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    # The book theme's own top bar only: no second search field above it.
    "navbar_persistent": [],
    "navbar_end": [],
}
html_static_path = ["_static"]
html_css_files = ["fedjax_dg.css"]
default_role = "code"  # `name` in docstrings reads as code, as in the markdown pages
# Curly quotes and ellipses, but no dashes: "--set" stays two hyphens.
smartquotes_action = "qe"

# mpicoll's documentation site: Sphinx, with MyST-Parser for the Markdown pages and
# autodoc (+ napoleon for the "Args:/Returns:/Raises:" docstrings) for the API page.
#
# Why Sphinx + MyST + sphinx-book-theme: it is what the JAX ecosystem builds its docs
# with (JAX, Flax, Optax and mpi4jax are Sphinx sites; JAX's and Flax's use
# sphinx-book-theme), so a reader who knows jax.readthedocs.io finds the same layout,
# search and API pages here, and the API reference is generated from the docstrings
# that `help(mpicoll.allreduce)` shows, not written twice.  Markdown (MyST) keeps the
# pages in the README's own format, so sections move between the two unchanged.
#
# Built by `make docs` (warnings are errors: -W --keep-going) into docs/_build/html,
# with the project venv's Python: autodoc imports mpicoll, which initializes MPI as a
# singleton process (mpi4py), as `python -c "import mpicoll"` does.
#
# Two checks beyond Sphinx's own, both warnings (so errors under -W):
#   * every name in mpicoll.__all__ is documented on the API page (a new public name
#     without an entry there fails the build: _ext/mpicoll_docs.py);
#   * the benchmark tables are generated from result files under docs/ (cpu_bench-*.json,
#     dispatch-*.json, jax_vocabulary-*.json, gpu_bench-*.json: the bench-table
#     directive and the bench-value role), not typed.

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
# The checkout's mpicoll (the editable install points here too; a plain clone without
# `pip install -e .` still finds the Python package, though it needs the built extension).
sys.path.insert(0, os.path.dirname(HERE))

import mpicoll  # noqa: E402  (fails loudly here rather than as 40 autodoc warnings)

project = "mpicoll"
author = "the mpicoll developers"
copyright = "the mpicoll developers"
release = mpicoll.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",  # a [source] link beside every API entry: where it is defined
    "mpicoll_docs",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "README.md", "requirements.txt", "Thumbs.db", ".DS_Store"]

# MyST: heading anchors for links such as [Dispatch](design.md#dispatch-device-order-or-runtime-tokens),
# ::: fences for admonitions, and the `{eval-rst}` escape for autodoc on the API page.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4

# autodoc: signatures as written, members in source order, the docstrings as they are.
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# No network at build time (CI and GPU nodes are offline): no intersphinx inventories.
intersphinx_mapping = {}

html_theme = "sphinx_book_theme"
html_title = f"mpicoll {release}"
html_static_path = ["_static"]
html_css_files = ["mpicoll.css"]
# One search box: the theme's sidebar field goes, the header's search button stays.
html_sidebars = {"**": ["navbar-logo.html", "icon-links.html", "sbt-sidebar-nav.html"]}
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_last_updated_fmt = None
pygments_style = "sphinx"

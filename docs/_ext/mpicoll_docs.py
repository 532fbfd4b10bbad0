"""Sphinx extension for mpicoll's site (docs/conf.py loads it).

* ``gpu-bench-table``: a table generated from a GPU benchmark result file
  (``docs/gpu_bench-<ranks>.json``, written by ``benchmarks/gpu_bench.py``), so the
  figures on the performance and GPU pages are the file's, never typed by hand.
* A completeness check: every name in ``mpicoll.__all__`` must be documented on the
  API page (as ``mpicoll.<name>``, by autodoc or a ``py:data`` entry); a missing one is
  a warning, which ``make docs`` (``-W``) turns into a failed build.
* Docstrings: a starred shape ("(size, *s)") escaped for reST, and each "Raises:"
  entry checked to be one napoleon reads (a warning names the docstring otherwise).
"""

import json
import os
import re

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

# Columns of the table: (impl in the JSON, column title).
_COLUMNS = [
    ("staging-floor", "staging floor"),
    ("mpicoll-loop", "mpicoll loop"),
    ("mpi4jax-loop", "mpi4jax loop"),
    ("mpicoll-python", "mpicoll python"),
    ("mpi4jax-python", "mpi4jax python"),
    ("mpicoll-eager", "mpicoll eager"),
    ("mpicoll-loop-unpipelined", "mpicoll loop, unpipelined"),
]


def _size(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _us(value):
    if value is None:
        return "–"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _table(header, rows):
    table = nodes.table()
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)

    def row(cells):
        r = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph(text=cell)
            r += entry
        return r

    head = nodes.thead()
    head += row(header)
    group += head
    body = nodes.tbody()
    for cells in rows:
        body += row(cells)
    group += body
    return table


class GpuBenchTable(SphinxDirective):
    """``gpu-bench-table`` with the JSON file as argument (relative to this page).

    Options: ``:ops:`` (space-separated collectives; default all, in file order),
    ``:bytes:`` (space-separated sizes in bytes; default all).
    """

    required_arguments = 1
    option_spec = {"ops": directives.unchanged, "bytes": directives.unchanged}

    def run(self):
        rel, path = self.env.relfn2path(self.arguments[0], self.env.docname)
        self.env.note_dependency(rel)
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, ValueError) as error:
            raise self.error(f"gpu-bench-table: cannot read {rel}: {error}")
        header = result["header"]
        times = {}
        order = []
        for r in result["rows"]:
            key = (r["op"], r["bytes"])
            if key not in times:
                times[key] = {}
                order.append(key)
            if not r.get("correct", True):
                raise self.error(f"gpu-bench-table: {rel} has an incorrect result: {r}")
            times[key][r["impl"]] = r["us_per_call"]
        ops = self.options.get("ops", "").split() or None
        sizes = [int(b) for b in self.options.get("bytes", "").split()] or None
        keys = [k for k in order if (ops is None or k[0] in ops) and (sizes is None or k[1] in sizes)]
        if ops:
            keys.sort(key=lambda k: (ops.index(k[0]), k[1]))
        if not keys:
            raise self.error(f"gpu-bench-table: no rows of {rel} match the options")
        columns = [(impl, title) for impl, title in _COLUMNS
                   if any(impl in times[k] for k in keys)]
        table_header = ["op", "per rank"] + [title for _, title in columns] + [
            "mpicoll loop / floor", "mpi4jax loop / mpicoll loop"]
        rows = []
        for key in keys:
            t = times[key]
            cells = [key[0], _size(key[1])] + [_us(t.get(impl)) for impl, _ in columns]
            loop, floor, other = t.get("mpicoll-loop"), t.get("staging-floor"), t.get("mpi4jax-loop")
            cells.append(f"{loop / floor:.2f}" if loop and floor else "–")
            cells.append(f"{other / loop:.1f}" if loop and other else "–")
            rows.append(cells)
        mpi = header.get("mpi", "").replace("\x00", "").split(",")[0]
        caption = (f"{header.get('ranks')} rank(s) on one {header.get('device')}, {mpi}, "
                   f"jax {header.get('jax')}, transport {header.get('transport')} "
                   f"(chunks of {_size(header.get('chunk_bytes', 0))}), mpi4jax "
                   f"{header.get('mpi4jax')}; µs per call, generated from {os.path.basename(rel)}")
        para = nodes.paragraph()
        para += nodes.emphasis(text=caption)
        return [para, _table(table_header, rows)]


def _indent(line):
    return len(line) - len(line.lstrip())


def _escape_stars(lines):
    """Escape a '*' that opens no emphasis ('(size, *s)'), outside literal blocks."""
    out, literal_indent = [], None
    for line in lines:
        if literal_indent is not None:
            if line.strip() and _indent(line) <= literal_indent:
                literal_indent = None
            else:
                out.append(line)
                continue
        if line.rstrip().endswith("::"):
            literal_indent = _indent(line)
        if "*" in line and "**" not in line and line.count("*") % 2 == 1 or re.search(r"[(,] \*|\(\*", line):
            line = re.sub(r"(?<![\\*])\*(?=[\w(.])", r"\\*", line)
        out.append(line)
    return out


def tidy_docstring(app, what, name, obj, options, lines):
    """Shapes such as "(size, *s)" in mpicoll's docstrings, as valid reStructuredText.

    The docstrings are written for help() as much as for this site (Google-style
    Args/Returns/Raises/Note sections, which napoleon reads); the one habit that
    is not valid reST is a shape with a starred name, whose '*' would open an
    emphasis.  This escapes such stars before napoleon runs; the text is left as
    written.
    """
    if name.startswith("mpicoll"):
        _check_sections(name, lines)
        lines[:] = _escape_stars(list(lines))


_RAISES_ENTRY = re.compile(r"^[A-Za-z_][\w.]*(, [A-Za-z_][\w.]*)*: \S")


def _check_sections(name, lines):
    """Sections napoleon reads as the docstring means them; a warning (an error under -W)
    names the docstring otherwise.

    * Each "Raises:" entry is "SomeError, OtherError: text", continued 4 spaces deeper:
      napoleon takes every line at the entries' indentation for a new entry, so prose
      there, or a continuation not indented, renders as bogus exception names.
    * The first line of "Returns:" has no colon: napoleon would take what precedes it
      for the return type.
    """
    section, section_indent, entry_indent, first = None, 0, None, False
    for line in lines:
        if not line.strip():
            continue
        text, indent = line.strip(), _indent(line)
        if section is not None and indent <= section_indent:
            section = None
        if section is None:
            if text in ("Raises:", "Returns:"):
                section, section_indent, entry_indent, first = text, indent, None, True
            continue
        if section == "Returns:" and first and ":" in re.sub(r"`[^`]*`", "", text):
            logger.warning(f"{name}: the first line of Returns has a colon, which napoleon "
                           f"reads as 'type: description': {text!r}")
        if section == "Raises:":
            entry_indent = indent if entry_indent is None else entry_indent
            if indent == entry_indent and not _RAISES_ENTRY.match(text):
                logger.warning(f"{name}: a Raises entry must read 'SomeError, OtherError: "
                               f"text' with its continuation lines indented further, got "
                               f"{text!r}")
        first = False


def check_public_names(app, env):
    """Every name of mpicoll.__all__ has an entry on the API page."""
    import mpicoll

    objects = env.get_domain("py").objects
    missing = [name for name in mpicoll.__all__ if f"mpicoll.{name}" not in objects]
    for name in missing:
        logger.warning(f"mpicoll.{name} is in mpicoll.__all__ but not documented on the "
                       f"API page (docs/api.md): add it there")


def setup(app):
    app.add_directive("gpu-bench-table", GpuBenchTable)
    app.connect("env-check-consistency", check_public_names)
    # Before napoleon (priority 500), which then reads the Args/Returns sections.
    app.connect("autodoc-process-docstring", tidy_docstring, priority=400)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

"""Sphinx extension for mpicoll's site (docs/conf.py loads it).

* ``bench-table`` and the ``bench-value`` role: tables and figures generated from a
  benchmark's result file committed under docs/ (``cpu_bench-<ranks>.json`` from
  ``benchmarks/bench.py``, ``jax_vocabulary-<L>dev.json`` from
  ``benchmarks/jax_vocabulary.py``, ``dispatch-<ranks>.json`` from
  ``benchmarks/dispatch.py``, ``gpu_bench-<ranks>.json`` from
  ``benchmarks/gpu_bench.py``, ``global_mesh-<P>proc.json`` from
  ``benchmarks/global_mesh_collectives.py``), so the figures on the site are the file's, never
  typed by hand.  Each format is read into one shape (rows of op, size,
  implementation, µs per call); the caption comes from the file's header.
* A completeness check: every name in ``mpicoll.__all__`` must be documented on the
  API page (as ``mpicoll.<name>``, by autodoc or a ``py:data`` entry); a missing one is
  a warning, which ``make docs`` (``-W``) turns into a failed build.
* Docstrings: a starred shape ("(size, *s)") escaped for reST, and each "Raises:"
  entry checked to be one napoleon reads (a warning names the docstring otherwise).
"""

import json
import os
import re
from dataclasses import dataclass, field

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective, SphinxRole

logger = logging.getLogger(__name__)


# --- Benchmark result files ----------------------------------------------------------

@dataclass
class Results:
    """One result file, whatever wrote it: {(op, bytes): {impl: (status, µs or note)}}."""

    name: str
    kind: str
    caption: str  # the run: machine, MPI, versions, date, load; what a cell is
    unit: str  # what a cell is, for a table of a run already captioned on the page
    cells: dict = field(default_factory=dict)  # (op, bytes) -> {impl: (status, value)}
    order: list = field(default_factory=list)  # (op, bytes) in file order

    def add(self, op, nbytes, impl, us=None, status="ok", note=""):
        key = (op, nbytes)
        if key not in self.cells:
            self.cells[key] = {}
            self.order.append(key)
        self.cells[key][impl] = (status, us if status == "ok" else note)

    def us(self, op, nbytes, impl):
        status, value = self.cells.get((op, nbytes), {}).get(impl, (None, None))
        return value if status == "ok" else None


@dataclass
class Format:
    """How one benchmark's file reads and what its tables show by default."""

    columns: list  # [(impl, column title)], in the table's order
    size_title: str = "per rank"
    ratio_to: str = None  # impl: each other cell gets "(x×)" of it
    ratios: list = field(default_factory=list)  # extra columns "a / b"


FORMATS = {
    # benchmarks/bench.py's bench.json: every collective on CPU, µs = time_per_call_s.
    # Its pytree case's rows are "allreduce_pytree" with implementations "<impl>/fused"
    # (one call for 100 leaves) and "<impl>/per-leaf" (100 calls).
    "cpu": Format(columns=[(i, i) for i in (
        "c-floor", "mpicoll-jit", "mpicoll-eager", "mpi4py", "mpi4jax-jit", "mpi4jax-eager",
        "jax-gloo", "c-floor/fused", "c-floor/per-leaf", "mpicoll-jit/fused",
        "mpicoll-jit/per-leaf", "mpicoll-eager/fused", "mpicoll-eager/per-leaf",
        "mpi4py/per-leaf")], ratio_to="c-floor"),
    # benchmarks/gpu_bench.py's file.
    "gpu": Format(columns=[("staging-floor", "staging floor"),
                           ("mpicoll-loop", "mpicoll loop"),
                           ("mpi4jax-loop", "mpi4jax loop"),
                           ("mpicoll-python", "mpicoll python"),
                           ("mpi4jax-python", "mpi4jax python"),
                           ("mpicoll-eager", "mpicoll eager"),
                           ("mpicoll-loop-unpipelined", "mpicoll loop, unpipelined")],
                  ratios=["mpicoll-loop / staging-floor", "mpi4jax-loop / mpicoll-loop"]),
    # benchmarks/jax_vocabulary.py's file: a global-mesh psum; its rows are the columns.
    "vocabulary": Format(columns=[("mpicoll", "mpicoll (global mesh)"),
                                  ("jax+gloo", "JAX + gloo"),
                                  ("jit, XLA's psum", "plain jit, XLA all-reduce (16 B)"),
                                  ("local psum", "the program alone (local psum)"),
                                  ("mpicoll.allreduce", "mpicoll.allreduce in the loop"),
                                  ("MPI floor", "C MPI_Allreduce (floor)")],
                         size_title="per device", ratios=["jax+gloo / mpicoll"]),
    # benchmarks/dispatch.py's file: a jitted step from a Python loop, with and without
    # a collective; the eager allreduce beside mpi4py's.
    "global_mesh": Format(columns=[(f"L={n}", f"L = {n}") for n in (1, 2, 4, 8)]
                          + [(f"gloo L={n}", f"gloo, L = {n}") for n in (1, 2, 4, 8)]
                          + [("MPI floor", "C MPI floor")],
                          size_title="per process", ratio_to="L=1"),
    "dispatch": Format(columns=[("step", "without collective"),
                                ("+ allreduce", "+ allreduce, device order"),
                                ("+ allreduce, tokens", "+ allreduce, tokens mode"),
                                ("+ allreduce, JAX's tokens", "tokens mode, JAX token handling"),
                                ("mpi4py", "mpi4py Allreduce"),
                                ("mpicoll eager", "mpicoll.allreduce eager"),
                                ("JAX eager, no MPI", "jit(x + 1) eager, completed")],
                       size_title="per array", ratio_to="step"),
}


def _size(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text):
    """"4", "16B", "16 B", "4MiB", "4 MiB" -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r}")
    shift = {None: 0, "B": 0, "KiB": 10, "MiB": 20, "GiB": 30}[match.group(2)]
    return int(match.group(1)) << shift


def _us(value):
    if value is None:
        return "–"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(value):
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _mpi(text):
    return " ".join((text or "").replace("\x00", "").split(",")[0].replace("Version:", "").split())


def _read_cpu(name, data):
    m, args = data["machine"], data.get("args", {})
    mpi4jax = m.get("mpi4jax") or f"not available ({m.get('mpi4jax_unavailable_reason')})"
    load = (f"load average {m['load_average_start'][0]:.1f} at the start, "
            f"{m['load_average_end'][0]:.1f} at the end")
    runs = (f"{args['repeats']} timed runs" if args.get("repeats") else
            "5 timed runs (--quick)" if args.get("quick") else
            "15 timed runs (9 at 4 MiB, 5 at 64 MiB)")
    caption = (f"{m['ranks']} ranks on one {m['cores']}-core machine ({m['cpu']}), "
               f"{_mpi(m['mpi_library'])}, jax {m['jax']}, mpi4py {m['mpi4py']}, mpi4jax "
               f"{mpi4jax}; {m['date'][:10]}, {load}; µs per call: median of {runs} of "
               f"~{args.get('target_ms', 20):g} ms, the slowest rank's time; (×): to the "
               f"c-floor; transparent huge pages {m.get('transparent_hugepages')}"
               + (f", GLIBC_TUNABLES={m['glibc_tunables']}" if m.get("glibc_tunables") else "")
               + (f"; the whole run took {data['wall_time_s'] / 60:.1f} min"
                  if data.get("wall_time_s") else ""))
    results = Results(name, "cpu", caption, "µs per call, (×): to the c-floor")
    for r in data["rows"]:
        if r["status"] == "ok" and not r.get("correct", True):
            raise ValueError(f"an incorrect result: {r['op']} {r['impl']} {r['bytes']}")
        results.add(r["op"], r["bytes"], r["impl"],
                    r["time_per_call_s"] * 1e6 if r["status"] == "ok" else None,
                    r["status"], r["status"])
    return results


def _read_gpu(name, data):
    h = data["header"]
    caption = (f"{h.get('ranks')} rank(s) on one {h.get('device')}, {_mpi(h.get('mpi'))}, "
               f"jax {h.get('jax')}, transport {h.get('transport')} "
               f"(chunks of {_size(h.get('chunk_bytes', 0))}), mpi4jax "
               f"{h.get('mpi4jax')}; µs per call")
    results = Results(name, "gpu", caption, "µs per call")
    for r in data["rows"]:
        if not r.get("correct", True):
            raise ValueError(f"an incorrect result: {r}")
        results.add(r["op"], r["bytes"], r["impl"], r["us_per_call"])
    return results


def _read_vocabulary(name, data):
    cores = f"one {data['cores']}-core machine" if data.get("cores") else "one machine"
    runs = f"median of {data['repeats']} repeats" if data.get("repeats") else "median"
    load = data.get("load_average")
    load = f", load average {load[0]:.1f}–{load[1]:.1f}" if load else ""
    caption = (f"a global-mesh psum, {data['processes']} processes × {data['local_devices']} "
               f"device(s) on {cores}, {_mpi(data['mpi'])}, jax {data['jax']}; "
               f"{data['when'][:10]}{load}; µs per psum, {runs} of the slowest rank, a loop "
               f"of dependent psums in one jitted program")
    if data.get("gloo_error"):
        caption += f"; JAX + gloo failed: {data['gloo_error'].splitlines()[0]}"
    results = Results(name, "vocabulary", caption, "µs per psum")
    for impl, by_size in data["medians_us"].items():
        for label, us in by_size.items():
            results.add("psum", parse_size(label), impl, us)
    return results


def _read_dispatch(name, data):
    load = data["load_average"]
    caption = (f"{data['processes']} ranks on one {data['cores']}-core machine, "
               f"{_mpi(data['mpi'])}, jax {data['jax']}; {data['when'][:10]}, load average "
               f"{load[0]:.1f}–{load[1]:.1f}; µs per call from a Python loop, median of "
               f"{data['runs']} runs × {data['calls']} calls of the slowest rank, the rows "
               f"interleaved; (×): to the step without collective")
    results = Results(name, "dispatch", caption, "µs per call, (×): to the step alone")
    for r in data["rows"]:
        results.add(r["op"], r["bytes"], r["impl"], r["us"])
    return results


def _read_global_mesh(name, data):
    runs = data["runs"]
    first = runs[min(runs, key=int)]
    caption = (f"jax.lax collectives over a global mesh (\"hosts\", \"local\"), "
               f"{data['processes']} processes × L devices on one {data['cores']}-core "
               f"machine, {_mpi(data['mpi'])}, jax {data['jax']}; {first['when'][:10]}; "
               f"µs per call, median of {first['repeats']} repeats of the slowest rank, a "
               f"loop of {first['inner']} dependent calls (per call: 200 dispatches of a "
               f"16 B program); the same bytes per process at every L")
    if "sizes" in first:
        smallest = min(first["sizes"].values(), key=lambda size: size["asked"])["asked"]
        moved = ", ".join(
            f"{run['sizes'][label]['per_process']} B at L = {local}"
            for local, run in sorted(runs.items(), key=lambda item: int(item[0]))
            for label, size in run["sizes"].items()
            if size["asked"] == smallest and "per call" not in label and "per device" not in label)
        caption += (f" ({smallest} B: rounded up to one element per participant, {moved}); "
                    f"gloo: JAX's own collectives after jax.distributed, loops of "
                    f"{first['gloo_inner']} calls, median of {first['gloo_repeats']}; C MPI "
                    f"floor: the direct MPI collective over the processes, the same bytes")
    caption += "; (×): to L = 1"
    results = Results(name, "global_mesh", caption, "µs per call")
    floor = set()  # the C floor of each row, once (every run measures it)
    for local in sorted(runs, key=int):
        run = runs[local]
        if "rows" not in run:  # written before the gloo and floor columns
            for op, us in run["us_per_call"].items():
                results.add(op, 16 if "per call" in op else run["bytes_per_process"],
                            f"L={local}", us)
            continue
        for row in run["rows"]:
            key = (row["op"], run["sizes"][row["size"]]["asked"])
            if row["impl"] == "MPI floor":
                if key in floor:
                    continue
                floor.add(key)
            impl = {"mpicoll": f"L={local}", "gloo": f"gloo L={local}"}.get(row["impl"],
                                                                               row["impl"])
            results.add(*key, impl, row["us"])
    return results


def read_results(path):
    """A result file as Results; ValueError if it is none of the known formats."""
    with open(path) as f:
        data = json.load(f)
    name = os.path.basename(path)
    if data.get("benchmark") == "dispatch":
        return _read_dispatch(name, data)
    if data.get("benchmark") == "global_mesh":
        return _read_global_mesh(name, data)
    for key, reader in (("machine", _read_cpu), ("header", _read_gpu),
                        ("medians_us", _read_vocabulary)):
        if key in data:
            return reader(name, data)
    raise ValueError("not a result file of bench.py, gpu_bench.py, jax_vocabulary.py or "
                     "dispatch.py")


def _load(env, docname, relative, error):
    rel, path = env.relfn2path(relative, docname)
    env.note_dependency(rel)
    try:
        return read_results(path)
    except (OSError, ValueError, KeyError) as e:
        raise error(f"cannot read {rel}: {type(e).__name__}: {e}")


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


class BenchTable(SphinxDirective):
    """``bench-table`` with a result file as argument (relative to this page).

    Rows: (op, size), columns: implementations; the format's defaults can be changed:
    ``:ops:`` (in this order, space- or "|"-separated; default all, in file order),
    ``:bytes:`` (sizes, "4 1KiB 4MiB"; default all), ``:columns:`` (implementations,
    in this order, "|"-separated), ``:ratio-to:`` (an implementation; each other cell
    gets "(x×)" of it; "none" for none), ``:ratios:`` (extra columns "a / b",
    "|"-separated; "none").  A cell the file has no measurement for says why (n/a,
    not available, failed) or is "–".
    """

    required_arguments = 1
    option_spec = {"ops": directives.unchanged, "bytes": directives.unchanged,
                   "columns": directives.unchanged, "ratio-to": directives.unchanged,
                   "ratios": directives.unchanged}

    def _list(self, option, separator=None):
        value = self.options.get(option)
        if value is None:
            return None
        items = [v.strip() for v in value.split(separator) if v.strip()]
        return [] if items == ["none"] else items

    def run(self):
        results = _load(self.env, self.env.docname, self.arguments[0], self.error)
        fmt = FORMATS[results.kind]
        ops = self._list("ops", "|" if "|" in self.options.get("ops", "") else None)
        sizes = [parse_size(b) for b in self._list("bytes") or []] or None
        keys = [k for k in results.order
                if (ops is None or k[0] in ops) and (sizes is None or k[1] in sizes)]
        if ops:
            keys.sort(key=lambda k: (ops.index(k[0]), k[1]))
        if not keys:
            raise self.error(f"bench-table: no rows of {results.name} match the options")
        titles = dict(fmt.columns)
        wanted = self._list("columns", "|")
        unknown = [c for c in wanted or [] if c not in titles]
        if unknown:
            raise self.error(f"bench-table: unknown columns {unknown} (known: {list(titles)})")
        columns = [c for c in (wanted or [c for c, _ in fmt.columns])
                   if any(c in results.cells[k] for k in keys)]
        ratio_to = self.options.get("ratio-to", fmt.ratio_to)
        ratio_to = None if ratio_to == "none" else ratio_to
        ratios = self._list("ratios", "|")
        ratios = [r.split(" / ") for r in (fmt.ratios if ratios is None else ratios)]
        unknown = [c for pair in ratios for c in pair if c not in titles] + [
            r for r in ratios if len(r) != 2]
        if unknown:
            raise self.error(f"bench-table: unknown ratio {unknown}: 'a / b' of {list(titles)}")
        header = (["op", fmt.size_title] + [titles[c] for c in columns]
                  + [f"{titles[a]} / {titles[b]}" for a, b in ratios])
        rows = []
        for key in keys:
            cells = [key[0], _size(key[1])]
            base = results.us(*key, ratio_to) if ratio_to else None
            for impl in columns:
                status, value = results.cells[key].get(impl, ("–", "–"))
                if status != "ok":
                    cells.append(value)
                    continue
                text = _us(value)
                if base and impl != ratio_to:
                    text += f" ({_ratio(value / base)}×)"
                cells.append(text)
            for a, b in ratios:
                ua, ub = results.us(*key, a), results.us(*key, b)
                cells.append(_ratio(ua / ub) if ua and ub else "–")
            rows.append(cells)
        # The run is described once per page, at its first table.
        captioned = self.env.temp_data.setdefault("bench_captioned", set())
        caption = (results.caption if results.name not in captioned else
                   f"the same run as above, {results.unit}")
        captioned.add(results.name)
        para = nodes.paragraph()
        para += nodes.emphasis(text=f"{caption}; generated from {results.name}")
        return [para, _table(header, rows)]


class BenchValue(SphinxRole):
    """``{bench-value}`FILE OP SIZE IMPL``` -> µs per call as the tables print it;
    ``IMPL / OTHER`` -> their ratio, "1.37×".  With "|" between the four parts, an op
    may have spaces: ``FILE | step of 1 array | 4 | step``."""

    def run(self):
        parts = ([p.strip() for p in self.text.split("|")] if "|" in self.text
                 else self.text.split(None, 3))
        if len(parts) != 4:
            return self._fail("expected 'FILE OP SIZE IMPL' or 'FILE OP SIZE IMPL / OTHER'")
        relative, op, size, impl = parts
        try:
            results = _load(self.env, self.env.docname, relative, ValueError)
            nbytes = parse_size(size)
        except ValueError as e:
            return self._fail(str(e))
        names = impl.split(" / ")
        values = [results.us(op, nbytes, name) for name in names]
        if None in values:
            return self._fail(f"{results.name} has no measurement of {op} {_size(nbytes)} "
                              f"{names[values.index(None)]}")
        text = _us(values[0]) if len(values) == 1 else f"{_ratio(values[0] / values[1])}×"
        return [nodes.inline(self.rawtext, text, classes=["bench-value"])], []

    def _fail(self, message):
        msg = self.inliner.reporter.error(f"bench-value {self.text!r}: {message}",
                                          line=self.lineno)
        return [self.inliner.problematic(self.rawtext, self.rawtext, msg)], [msg]


# --- Docstrings and the API page --------------------------------------------------

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
    app.add_directive("bench-table", BenchTable)
    app.add_role("bench-value", BenchValue())
    app.connect("env-check-consistency", check_public_names)
    # Before napoleon (priority 500), which then reads the Args/Returns sections.
    app.connect("autodoc-process-docstring", tidy_docstring, priority=400)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

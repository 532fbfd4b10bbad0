"""The documentation site (docs/): it builds clean, its programs run, a browser renders it.

* Every ```python block on the site and in README.md is a complete program (no
  fragments) and runs under `mpiexec -n 2` (conftest.run_mpiexec), exiting 0: no
  snippet can drift from the library.  These need only the Markdown files.  (Where a
  program's result matters, a test beside the feature also checks what it computes:
  test_transforms.py for the README's data-parallel program, test_lax_over_ranks.py
  for its jax.lax one, test_ranks_axis.py for docs/autodiff.md's typed one.)
* What the prose names exists: each repository path and each dotted name
  `mpicoll.x.y` in README.md, docs/*.md and the comments and docstrings of mpicoll's
  sources (Python and C++), and no page shows one machine's checkout.
* The site builds with the command `make docs` runs (sphinx-build -W --keep-going:
  warnings are errors), when Sphinx is importable (`make docs` installs the pinned
  tools of docs/requirements.txt into the venv); otherwise skipped, saying so.
* Headless Chromium (Debian's `chromium` package) opens the built index, the API
  entry of `allreduce` and the search page for "allreduce", and the tests check
  what each renders (the search results are made by the page's JavaScript).  It
  also lays out every page at 1280 px and at a phone's 390 px: no code block cut
  off or wider than the page, a contents panel on every page over 80 lines, one
  search box.  Skipped where no Chromium is installed.

All of it launches processes of its own, so only the serial run takes part.
"""

import html
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_mpiexec, serial_only

pytestmark = serial_only

DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
RANKS = 2
PROGRAM_TIMEOUT = 300  # s; two ranks compiling on a 2-core CI machine
BUILD_TIMEOUT = 600
BROWSER_TIMEOUT = 90
HAVE_SPHINX = all(importlib.util.find_spec(name) is not None
                  for name in ("sphinx", "myst_parser", "sphinx_book_theme"))
CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _programs():
    found = []
    for page in PAGES + [REPO / "README.md"]:
        text = page.read_text()
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(pytest.param(match.group(1), id=f"{page.name}:{line}"))
    return found


PROGRAMS = _programs()


def test_the_site_has_programs():
    assert len(PROGRAMS) >= 10, [p.id for p in PROGRAMS]
    assert sum(p.id.startswith("README.md:") for p in PROGRAMS) >= 2, [p.id for p in PROGRAMS]


@pytest.mark.parametrize("source", PROGRAMS)
def test_program_is_complete(source):
    """A reader can save any block and run it: it imports what it uses."""
    first = source.lstrip().splitlines()[0]
    assert first.startswith(("import ", "from ")), f"a fragment, not a program: {first!r}"
    compile(source, "<docs>", "exec")


@pytest.mark.slow  # about 60 s for all of them: CI's first variant runs them
@pytest.mark.parametrize("source", PROGRAMS)
def test_program_runs_at_two_ranks(source, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(source)
    job = run_mpiexec(RANKS, [sys.executable, script], timeout=PROGRAM_TIMEOUT)
    assert job.returncode == 0, f"exit {job.returncode}\n{job.output[-4000:]}"


# --- Docstrings --------------------------------------------------------------------

# Public functions whose docstrings are still being rewritten as contracts elsewhere
# (failures.py, comm.py); remove a name once its docstring has Returns and an example.
_CONTRACTS_PENDING = set()


def _public_functions():
    import mpicoll
    import mpicoll.distributed
    import mpicoll.mpi4jax

    found = [(f"mpicoll.{name}", getattr(mpicoll, name)) for name in mpicoll.__all__]
    found += [(f"mpicoll.mpi4jax.{name}", getattr(mpicoll.mpi4jax, name))
              for name in mpicoll.mpi4jax.__all__]
    found += [(f"mpicoll.distributed.{name}", getattr(mpicoll.distributed, name))
              for name in ("initialize", "is_initialized")]
    return [(name, obj) for name, obj in found if callable(obj)]


def test_every_public_function_has_a_contract():
    """What help() shows: a summary line, every argument, what it returns, an example
    (the API page is generated from the same text; the docs extension checks that
    napoleon reads its Returns and Raises as written)."""
    import inspect

    missing = []
    for name, function in _public_functions():
        if name in _CONTRACTS_PENDING:
            continue
        doc = inspect.getdoc(function) or ""
        lacks = [part for part in ("Returns:", "Example") if part not in doc]
        arguments = [p for p in inspect.signature(function).parameters
                     if p not in ("args", "kwargs")]
        if arguments and "Args:" not in doc:
            lacks.append("Args:")
        lacks += [f"argument {p}" for p in arguments if f"\n    {p}: " not in doc
                  and not (p == "jax_arguments" and "jax_arguments:" in doc)]
        if lacks:
            missing.append(f"{name}: {', '.join(lacks)}")
    assert not missing, "\n".join(missing)


# --- References ------------------------------------------------------------------
# What the prose names must exist: README.md, the pages and the comments and
# docstrings of mpicoll's sources (Python and C++).  A module moved or renamed
# leaves no stale name behind.

# A relative path: words joined by slashes, not inside a URL or an absolute path.
_PATH = re.compile(r"(?<![\w/.~$-])((?:\.\./)*[A-Za-z_][\w.-]*(?:/[\w.-]+)+/?)")
# Checked where it names a file (by its extension), ends with a slash or starts at the
# top of the repository; other slashed words ("on/off", "jax/tests/multiprocess") are not.
_FILE = re.compile(r"\.(py|h|cc|c|def|md|sh|sbatch|json|txt|toml|cfg|pth|svg|png)$")
_TOP_DIRS = ("mpicoll", "tests", "benchmarks", "examples", "launch", "docs", "tools")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # DIR/merged.json
_DOTTED = re.compile(r"(?<![\w/.-])mpicoll(?:\.[A-Za-z_]\w*)+")
# The rest of a word after a match: a pattern or placeholder (rank*.json,
# results/<name>.json, mpicoll.{name}) names no one thing, and is not checked.
_WORD_REST = re.compile(r"[^\s`'\"()\[\],;:|]*")
_PATTERN = re.compile(r"[*<>{}$%]")
# Another machine's checkout in prose (the pages show paths relative to the repository).
_MACHINE_PATH = re.compile(r"/(?:work|home|Users|root)/\w")

_C_PROSE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def _python_prose(path):
    """(first line, text) of each comment and docstring of a Python file."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    found = [(token.start[0], token.string)
             for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


def _c_prose(path):
    """(first line, text) of each comment of a C++ source (string literals skipped)."""
    source = path.read_text()
    return [(source.count("\n", 0, match.start()) + 1, match.group())
            for match in _C_PROSE.finditer(source) if match.group().startswith("/")]


def _prose():
    """(file, first line, text) of everything a reader of the project reads as prose."""
    for page in [REPO / "README.md", *PAGES]:
        yield page, 1, page.read_text()
    for path in sorted((REPO / "mpicoll").rglob("*.py")):
        for line, text in _python_prose(path):
            yield path, line, text
    for path in sorted((REPO / "mpicoll" / "csrc").rglob("*")):
        if path.suffix in (".h", ".cc", ".def"):
            for line, text in _c_prose(path):
                yield path, line, text


def _references(pattern):
    """('file:line', match) of pattern in the prose, leaving out patterns and placeholders."""
    for where, first, text in _prose():
        for match in pattern.finditer(text):
            if _PATTERN.search(_WORD_REST.match(text, match.end()).group()):
                continue
            line = first + text.count("\n", 0, match.start())
            yield f"{where.relative_to(REPO)}:{line}", match


def _output_dirs():
    """The directories the project's commands write and git ignores (docs/_build/, ...)."""
    lines = (REPO / ".gitignore").read_text().splitlines()
    return [line.strip("/") for line in lines if line.endswith("/") and "*" not in line]


def _path_exists(where, path):
    if path.startswith("../"):
        return (where.parent / path).exists()
    # Internals are named from the package's private folder (runtime/comm.py).
    roots = [REPO, REPO / "mpicoll", REPO / "mpicoll" / "_src", REPO / "mpicoll" / "csrc"]
    roots += [parent for parent in where.parents if parent == REPO or REPO in parent.parents]
    return (any((root / path).exists() for root in roots)
            or any(path == out or path.startswith(out + "/") for out in _output_dirs()))


def test_the_paths_the_prose_names_exist():
    """Each path in README.md, docs/*.md and mpicoll's comments and docstrings
    (mpicoll/..., tests/..., ops/collectives.py, engine/call.h, ../examples/demo.py; relative
    to the repository, to mpicoll/, mpicoll/_src/ or mpicoll/csrc/, or to the file's own
    folders) is a
    file or directory of the repository, or under an output directory it ignores."""
    where = {}
    for place, match in _references(_PATH):
        path = match.group(1).rstrip(".")  # a sentence's full stop
        parts = path.strip("/").split("/")
        if not (_FILE.search(path) or path.endswith("/") or parts[0] in _TOP_DIRS):
            continue
        if any(_PLACEHOLDER.match(part) for part in parts):
            continue
        if not _path_exists(REPO / place.split(":")[0], path.rstrip("/")):
            where.setdefault(path, []).append(place)
    assert not where, "paths that do not exist:\n" + "\n".join(
        f"  {path}: {', '.join(places)}" for path, places in sorted(where.items()))


def _resolves(dotted):
    """The longest importable module of dotted, then attributes for the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


# Names in files another change is rewriting; remove one once its file says it right.
_NAMES_PENDING = set()


def test_the_modules_the_prose_names_exist():
    """Each dotted name mpicoll.x.y in the same prose is a module or an attribute."""
    where = {}
    for place, match in _references(_DOTTED):
        if match.group() not in _NAMES_PENDING and not _resolves(match.group()):
            where.setdefault(match.group(), []).append(place)
    assert not where, "names that resolve to nothing:\n" + "\n".join(
        f"  {name}: {', '.join(places)}" for name, places in sorted(where.items()))


def test_the_design_map_names_every_source_file():
    """docs/design.md's map of the tree names every module, header, unit and table
    under mpicoll/ (a newcomer finds each file's concern there); a file added
    without its line fails here."""
    design = (DOCS / "design.md").read_text()
    sources = [path for path in (REPO / "mpicoll").rglob("*")
               if path.suffix in (".py", ".h", ".cc", ".def") and path.name != "__init__.py"
               and "__pycache__" not in path.parts]
    assert len(sources) > 50, len(sources)
    unnamed = sorted(str(path.relative_to(REPO)) for path in sources if path.name not in design)
    assert not unnamed, f"not in docs/design.md's map: {unnamed}"


def test_the_pages_name_no_machine_paths():
    """README.md and docs/*.md show paths relative to the repository, not one
    machine's checkout."""
    found = [f"{page.name}:{page.read_text().count(chr(10), 0, match.start()) + 1}"
             for page in [REPO / "README.md", *PAGES]
             for match in _MACHINE_PATH.finditer(page.read_text())]
    assert not found, f"machine paths in the pages: {found}"


# --- The build -------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built as `make docs` builds it, into a temporary directory."""
    if not HAVE_SPHINX:
        pytest.skip("Sphinx, myst-parser or sphinx-book-theme is not installed in this "
                    "venv: `make docs` installs them (docs/requirements.txt)")
    out = tmp_path_factory.mktemp("docs")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
               "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    build = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT)
    assert build.returncode == 0, (f"sphinx-build exit {build.returncode}:\n"
                                   f"{build.stdout[-3000:]}\n{build.stderr[-6000:]}")
    return out / "html"


def test_site_builds_without_warnings(site):
    for page in PAGES:
        assert (site / page.with_suffix(".html").name).is_file(), page.name
    assert (site / "search.html").is_file() and (site / "searchindex.js").is_file()
    for image in ("bench-allreduce.png", "allreduce-model.svg"):
        assert (site / "_images" / image).is_file(), image


def test_api_page_documents_every_public_name(site):
    import mpicoll
    import mpicoll.distributed  # noqa: F401
    import mpicoll.mpi4jax

    api = (site / "api.html").read_text()
    for name in mpicoll.__all__:
        assert f'id="mpicoll.{name}"' in api, name
    assert 'id="mpicoll.distributed.initialize"' in api
    for name in mpicoll.mpi4jax.__all__:
        assert f'id="mpicoll.mpi4jax.{name}"' in api, name


def test_gpu_tables_come_from_the_result_files(site):
    gpus = (site / "gpus.html").read_text()
    assert gpus.count("generated from gpu_bench-2.json") >= 2
    assert "generated from gpu_bench-1.json" in gpus


def _html_cells(part):
    return [[html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
             for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.S)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", part, re.S)]


def _generated_tables(page, name):
    """[(header, body rows)] of the tables on a built page captioned "generated from name"."""
    found = []
    for match in re.finditer(rf"generated from {re.escape(name)}</em></p>.*?</table>", page, re.S):
        table = match.group(0)
        head, body = table.split("</thead>")
        found.append((_html_cells(head)[0], _html_cells(body)))
    return found


def _close(shown, value):
    """A table's cell ("1,234", "2.13", "12.3") shows `value` to its printed precision."""
    text = shown.replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - value) <= 0.5 * 10 ** -decimals + 1e-9


def _bytes(label):
    number, unit = label.split()
    return int(number) << {"B": 0, "KiB": 10, "MiB": 20}[unit]


# docs/<file>: (the page generated from it, the least number of measured cells it shows).
_CPU_RESULTS = {"cpu_bench-2.json": ("performance.html", 100),
                "dispatch-2.json": ("performance.html", 6),
                "jax_vocabulary-1dev.json": ("jax-vocabulary.html", 8),
                "jax_vocabulary-2dev.json": ("jax-vocabulary.html", 8)}


@pytest.mark.parametrize("name", sorted(_CPU_RESULTS))
def test_cpu_tables_come_from_the_result_files(site, name):
    """Every time in the CPU tables is the result file's (benchmarks/bench.py's bench.json,
    jax_vocabulary.py's, dispatch.py's; copied to docs/ after a run), and each "(x×)" its
    ratio."""
    import json

    page, least = _CPU_RESULTS[name]
    data = json.loads((DOCS / name).read_text())
    if "machine" in data:  # bench.py: {(op, bytes, impl): µs}; columns titled by impl
        times = {(r["op"], r["bytes"], r["impl"]): r["time_per_call_s"] * 1e6
                 for r in data["rows"] if r["status"] == "ok"}
        assert data["all_correct"]
        title = {impl: impl for _, _, impl in times}
    else:  # columns titled as the docs extension says
        sys.path.insert(0, str(DOCS / "_ext"))
        import mpicoll_docs
        if "medians_us" in data:  # jax_vocabulary.py: {row: {"16 B": µs}}; a psum per row
            times = {("psum", _bytes(label), impl): us for impl, sizes in
                     data["medians_us"].items() for label, us in sizes.items()}
        else:  # dispatch.py: rows of (op, bytes, impl, us)
            times = {(r["op"], r["bytes"], r["impl"]): r["us"] for r in data["rows"]}
        kind = "dispatch" if data.get("benchmark") == "dispatch" else "vocabulary"
        title = {impl: t for impl, t in mpicoll_docs.FORMATS[kind].columns}
    impl_of = {t: impl for impl, t in title.items()}
    tables = _generated_tables((site / page).read_text(), name)
    assert tables, f"no table on {page} is generated from {name}"
    checked = 0
    for header, rows in tables:
        assert header[:2] in (["op", "per rank"], ["op", "per device"], ["op", "per array"])
        for row in rows:
            op, nbytes = row[0], _bytes(row[1])
            base = None
            for column, cell in zip(header[2:], row[2:]):
                if column not in impl_of:  # a ratio column "a / b"
                    a, b = (times.get((op, nbytes, impl_of[t])) for t in column.split(" / "))
                    assert cell == "–" if None in (a, b) else _close(cell, a / b), (row, column)
                    continue
                value = times.get((op, nbytes, impl_of[column]))
                if value is None:
                    assert cell in ("–", "n/a", "not available", "failed"), (row, column, cell)
                    continue
                shown = re.fullmatch(r"([\d,.]+)(?: \(([\d.]+)×\))?", cell)
                assert shown and _close(shown.group(1), value), (op, nbytes, column, cell, value)
                if shown.group(2):  # the ratio to the first column's implementation (c-floor)
                    base = base or times[(op, nbytes, impl_of[header[2]])]
                    assert _close(shown.group(2), value / base), (op, nbytes, column, cell)
                checked += 1
    assert checked >= least, f"{checked} measured cells from {name}"


# --- In a browser ------------------------------------------------------------------

def _dom(url, profile):
    """The DOM after the page's scripts ran (--virtual-time-budget lets them finish)."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
               f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", url]
    result = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT)
    assert result.returncode == 0, f"{url}: chromium exit {result.returncode}\n{result.stderr[-2000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def browser(site, tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no headless Chromium here (Debian: apt-get install chromium)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    return lambda page: _dom(f"file://{site / page}", profile)


# Every page at a desktop (1280 px) and a phone (390 px) width, in one browser: a
# page of this test's own loads each into a frame of that width (file:// pages may
# read each other with --allow-file-access-from-files) and writes what it measured.
_LAYOUT_PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
const pages = PAGES, widths = [1280, 390], found = [];
function measure(frame, page, width) {
  const d = frame.contentDocument, w = frame.contentWindow;
  const visible = e => e.offsetParent !== null && e.getBoundingClientRect().width > 0;
  const code = Array.from(d.querySelectorAll("pre"));
  found.push({page, width,
    code_cut: code.filter(p => p.scrollWidth > p.clientWidth + 1
      && !["auto", "scroll"].includes(w.getComputedStyle(p).overflowX)).length,
    code_scrolls: code.filter(p => p.scrollWidth > p.clientWidth + 1).length,
    // code whose lines fit the program-code limit (PROGRAM_LINE) yet wrapped
    short_code_wrapped: code.filter(p => {
      const style = w.getComputedStyle(p), lines = p.textContent.replace(/\\n$/, "").split("\\n");
      const height = p.clientHeight - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom);
      const line = parseFloat(style.lineHeight) || 1.5 * parseFloat(style.fontSize);
      return Math.max(...lines.map(l => l.length)) <= PROGRAM_LINE
        && height > lines.length * line + line / 2; }).length,
    // tables wider than their container: it scrolls, and its background draws the
    // edge shadows that say so
    tables_without_sign: Array.from(d.querySelectorAll("table")).filter(t => {
      const box = t.parentElement, style = w.getComputedStyle(box);
      return box.scrollWidth > box.clientWidth + 1
        && !(["auto", "scroll"].includes(style.overflowX)
             && style.backgroundImage.includes("radial-gradient")); }).length,
    contents: Array.from(d.querySelectorAll("nav.page-toc a, #pst-page-toc-nav a")).length,
    search: Array.from(d.querySelectorAll("button.search-button__button, input[type=search]"))
      .filter(visible).length});
}
function next(i) {
  if (i === pages.length * widths.length) {
    document.getElementById("out").textContent = "RESULT " + JSON.stringify(found);
    return;
  }
  const page = pages[Math.floor(i / widths.length)], width = widths[i % widths.length];
  const frame = document.createElement("iframe");
  frame.style.width = width + "px"; frame.style.height = "800px";
  frame.onload = () => { measure(frame, page, width); frame.remove(); next(i + 1); };
  frame.src = SITE + page;
  document.body.appendChild(frame);
}
next(0);
</script></body></html>"""


@pytest.fixture(scope="module")
def layouts(site, browser, tmp_path_factory):
    """What each page shows at 1280 and 390 px: {(page, width): measurements}."""
    import json
    pages = [page.with_suffix(".html").name for page in PAGES]
    wrapper = tmp_path_factory.mktemp("layout") / "layout.html"
    wrapper.write_text(_LAYOUT_PAGE.replace("PAGES", json.dumps(pages))
                       .replace("SITE", json.dumps(f"file://{site}/"))
                       .replace("PROGRAM_LINE", str(PROGRAM_LINE)))
    profile = tmp_path_factory.mktemp("chromium-layout")
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
               "--allow-file-access-from-files", "--window-size=1400,1000",
               f"--user-data-dir={profile}", "--virtual-time-budget=60000", "--dump-dom",
               f"file://{wrapper}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=BROWSER_TIMEOUT * 2)
    found = re.search(r"RESULT (\[.*\])", html.unescape(result.stdout))
    assert found, f"no measurements: {result.stdout[-1500:]} {result.stderr[-1500:]}"
    return {(m["page"], m["width"]): m for m in json.loads(found.group(1))}


# The longest line of program code in the pages (Python and shell blocks): at a
# desktop width (1280 px) such a block never wraps (mpicoll.css).
PROGRAM_LINE = 94


def test_program_code_in_the_pages_fits_a_desktop_line():
    long = []
    for page in [*PAGES, REPO / "README.md"]:
        text = page.read_text()
        for block in re.finditer(r"```(python|py|sh|bash)\n(.*?)```", text, re.S):
            first = text[:block.start()].count("\n") + 2
            long += [f"{page.name}:{first + i} ({len(line)} characters)"
                     for i, line in enumerate(block[2].split("\n")) if len(line) > PROGRAM_LINE]
    assert not long, f"program code lines over {PROGRAM_LINE} characters: {long}"


def test_program_code_does_not_wrap_at_desktop_width_and_wide_tables_show_they_scroll(layouts):
    wrapped = {key: m["short_code_wrapped"] for key, m in layouts.items()
               if key[1] == 1280 and m["short_code_wrapped"]}
    assert not wrapped, f"code blocks of short lines wrapped at 1280 px (page, width): {wrapped}"
    unsigned = {key: m["tables_without_sign"] for key, m in layouts.items()
                if m["tables_without_sign"]}
    assert not unsigned, f"tables cut with no sign that they scroll (page, width): {unsigned}"


def test_code_wraps_or_scrolls_on_every_page_at_desktop_and_phone_widths(layouts):
    cut = {key: m["code_cut"] for key, m in layouts.items() if m["code_cut"]}
    assert not cut, f"code blocks cut off at the right edge (page, width): {cut}"
    scrolling = {key: m["code_scrolls"] for key, m in layouts.items() if m["code_scrolls"]}
    assert not scrolling, f"code blocks wider than the page (mpicoll.css wraps them): {scrolling}"


def test_long_pages_have_a_contents_panel_and_every_page_one_search(layouts):
    long_pages = {page.with_suffix(".html").name for page in PAGES
                  if page.read_text().count("\n") > 80}
    without = sorted(page for (page, width), m in layouts.items()
                     if width == 1280 and page in long_pages and m["contents"] < 2)
    assert not without, f"pages over 80 lines without a contents panel: {without}"
    searches = {page: m["search"] for (page, width), m in layouts.items()
                if width == 1280 and m["search"] != 1}
    assert not searches, f"pages without exactly one search box: {searches}"


def test_troubleshooting_starts_from_the_symptoms():
    text = (DOCS / "troubleshooting.md").read_text()
    for symptom in ("## My job hangs", "## Ranks disagree", "## Wrong numbers",
                    "## MPI not found"):
        assert symptom in text
    assert "troubleshooting" in (DOCS / "index.md").read_text().split("```{toctree}")[1]


def test_index_renders(browser):
    dom = browser("index.html")
    assert "<title>" in dom and "mpicoll" in dom
    text = re.sub(r"<[^>]+>", "", dom)  # highlighting splits code into spans
    assert "Two commands" in text and "make demo" in text and "A complete program" in text
    assert 'href="api.html"' in dom and 'href="install.html"' in dom  # the navigation
    assert 'bd-sidebar' in dom  # the theme's layout, not a bare page


def test_allreduce_api_entry_renders(browser):
    dom = browser("api.html#mpicoll.allreduce")
    entry = dom[dom.index('id="mpicoll.allreduce"'):dom.index('id="mpicoll.bcast"')]
    assert "MPI_Allreduce" in entry
    assert "Parameters" in entry and "Returns" in entry and "Raises" in entry
    assert "Example (2 ranks)" in entry


def test_search_finds_allreduce(browser):
    dom = browser("search.html?q=allreduce")
    found = re.search(r"Search finished, found (\d+) page", dom)
    assert found and int(found.group(1)) >= 1, dom[-3000:]
    results = dom[dom.index('id="search-results"'):]
    assert 'href="api.html#mpicoll.allreduce"' in results  # the API entry among the hits

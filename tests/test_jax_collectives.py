"""JAX's own CPU collectives (the ones XLA's partitioner inserts into a plain `jit`) on
mpicoll's MPI, through mpicoll's MPI ABI library for jaxlib's MPItrampoline
(mpicoll/csrc/mpiabi/, over_ranks/jax_transport.py, _mpicoll_jax_mpi.py).

Jobs: tests/programs/plain_jit.py (every kind of collective the partitioner makes,
a training step, explicit sharding; against numpy, with the compiled programs'
collectives and the job's listeners checked) in both import orders, at 2 and 3
ranks, and with the opt-out.  In process: the library has every name the
installed jaxlib resolves, a function it does not provide names itself and ends
the process, and the reasons JAX's collectives stay on gloo.
"""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _mpicoll_jax_mpi
from conftest import REPO, run_mpiexec, serial_only

PROGRAM = Path(__file__).parent / "programs" / "plain_jit.py"
sys.path.insert(0, str(REPO / "tools"))
import mpiabi_names  # noqa: E402


@serial_only
@pytest.mark.parametrize("ranks,order", [(2, "jax-first"), (2, "mpicoll-first"),
                                         (3, "jax-first")])
def test_a_plain_jit_programs_collectives_run_on_the_jobs_mpi(ranks, order):
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, order], timeout=240,
                         cwd=PROGRAM.parent)
    assert result.returncode == 0, result.summary()
    assert f"ALL OK ({ranks} ranks, mpi)" in result.stdout, result.summary()


@serial_only
def test_two_devices_per_process_stay_on_gloo_and_compute_the_same():
    # XLA's MPI collectives refuse them (over_ranks/jax_transport.py): gloo, chosen
    # and said so, with the same answers.
    result = run_mpiexec(2, [sys.executable, PROGRAM, "mpicoll-first", "gloo", 2], timeout=300,
                         cwd=PROGRAM.parent)
    assert result.returncode == 0, result.summary()
    assert "ALL OK (2 ranks x 2 devices, gloo)" in result.stdout, result.summary()


@serial_only
def test_the_opt_out_keeps_gloo():
    result = run_mpiexec(2, [sys.executable, PROGRAM, "jax-first", "gloo"], timeout=240,
                         cwd=PROGRAM.parent, env={"MPICOLL_JAX_COLLECTIVES": "gloo"})
    assert result.returncode == 0, result.summary()
    assert "ALL OK (2 ranks, gloo)" in result.stdout, result.summary()


def test_the_library_has_every_name_the_installed_jaxlib_resolves():
    wanted = mpiabi_names.names_in(mpiabi_names.installed_libjax_common())
    table = mpiabi_names.read_table()
    assert len(wanted) > 600 and wanted <= table, sorted(wanted - table)[:20]
    # Only a checked jaxlib gets the library at start-up (a missing name would end
    # every process at `import jax`): a new one is checked, then added.
    assert _mpicoll_jax_mpi.jaxlib_version() in _mpicoll_jax_mpi.VERIFIED_JAXLIB, (
        f"jaxlib {_mpicoll_jax_mpi.jaxlib_version()}: run tools/mpiabi_names.py against it and "
        "add it to _mpicoll_jax_mpi.VERIFIED_JAXLIB once its names are all in names.def")
    library = ctypes.CDLL(_mpicoll_jax_mpi.library_path())
    missing = [f"{prefix}_{name}" for prefix, name, _ in table
               if not hasattr(library, f"{prefix}_{name}")]
    assert not missing, missing[:20]
    for name in ("mpiwrapper_version_major", "mpiabi_version_minor",
                 "mpiwrapper_export_fortran_constants_", "mpicoll_mpiabi_connect"):
        assert hasattr(library, name), name
    assert ctypes.c_int.in_dll(library, "mpiabi_version_major").value == 2
    assert ctypes.c_int.in_dll(library, "mpiabi_version_minor").value == 9
    # MPI's fixed values where XLA relies on them; handles distinct.
    value = {name: ctypes.c_int.in_dll(library, f"MPIABI_{name}").value
             for name in ("SUCCESS", "THREAD_FUNNELED", "THREAD_MULTIPLE", "PROC_NULL",
                          "ANY_SOURCE", "UNDEFINED")}
    assert value == {"SUCCESS": 0, "THREAD_FUNNELED": 1, "THREAD_MULTIPLE": 3,
                     "PROC_NULL": -1, "ANY_SOURCE": -2, "UNDEFINED": -32766}, value
    handles = [ctypes.c_uint64.in_dll(library, f"MPIABI_{name}").value
               for name in ("COMM_WORLD", "COMM_SELF", "FLOAT", "DOUBLE", "INT32_T", "SUM",
                            "MAX", "BYTE")]
    assert len(set(handles)) == len(handles) and 0 not in handles, handles


def test_a_function_the_library_does_not_provide_names_itself_and_ends_the_process():
    code = ("import ctypes, _mpicoll_jax_mpi; "
            "ctypes.CDLL(_mpicoll_jax_mpi.library_path()).MPIABI_Send()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode != 0, run
    assert "JAX's CPU collectives called MPI_Send, which mpicoll's MPI ABI library does " \
        "not provide" in run.stderr, run.stderr


def test_a_call_before_mpicoll_connects_says_what_to_do(capfd):
    library = ctypes.CDLL(_mpicoll_jax_mpi.library_path())
    provided = ctypes.c_int(-1)
    code = library.MPIABI_Init_thread(None, None, 1, ctypes.byref(provided))
    text = ctypes.create_string_buffer(1024)
    length = ctypes.c_int()
    library.MPIABI_Error_string(code, text, ctypes.byref(length))
    assert code != 0 and "mpicoll.distributed.initialize()" in text.value.decode()
    assert "XLA called MPI_Init_thread" in capfd.readouterr().err


@pytest.mark.parametrize("environment,wanted", [
    ({"PMI_RANK": "0"}, True),
    ({"OMPI_COMM_WORLD_RANK": "1"}, True),
    ({}, False),                                             # not an MPI rank
    ({"PMI_RANK": "0", "MPITRAMPOLINE_LIB": "/theirs.so"}, False),  # the user's library
    ({"PMI_RANK": "0", "MPICOLL_JAX_COLLECTIVES": "gloo"}, False),  # the opt-out
])
def test_the_start_up_hook_points_the_trampoline_at_mpicoll_only_where_asked(environment,
                                                                             wanted):
    assert _mpicoll_jax_mpi.wanted(environment) is wanted
    line = (REPO / _mpicoll_jax_mpi.PTH).read_text().splitlines()[-1]
    seen = {}
    exec(line.replace("os.environ", "seen_environment").replace(
        '__import__("_mpicoll_jax_mpi").prepare()', "seen.setdefault('prepared', True)"),
        {"os": os, "seen_environment": environment, "seen": seen})
    assert seen.get("prepared", False) is wanted  # the .pth line says what wanted() says


def test_the_reasons_jaxs_collectives_stay_on_gloo(monkeypatch):
    from mpicoll._src.over_ranks import jax_transport
    from mpicoll._src.primitive import device_order
    from mpicoll._src.runtime import settings

    import _mpicoll_jax_mpi as hook

    monkeypatch.setattr(hook, "jaxlib_version", lambda: "9.9.9")
    assert "jaxlib 9.9.9 is not one mpicoll's MPI ABI library was checked against" in \
        jax_transport._problem_here()
    assert hook.prepare({}) is None  # nor is the trampoline pointed at it
    monkeypatch.undo()
    monkeypatch.delenv("MPITRAMPOLINE_LIB", raising=False)
    assert "MPITRAMPOLINE_LIB was not set" in jax_transport._problem_here()
    monkeypatch.setenv("MPITRAMPOLINE_LIB", "/elsewhere/libmpiwrapper.so")
    assert "another library" in jax_transport._problem_here()
    monkeypatch.setattr(device_order, "cpu_devices_asked", lambda: 2)
    assert "2 CPU devices per process" in jax_transport._problem_here()
    with settings.override(jax_collectives="gloo"):
        assert jax_transport._problem_here() == "MPICOLL_JAX_COLLECTIVES=gloo"

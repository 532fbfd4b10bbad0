"""JAX's own CPU collectives (the ones XLA's partitioner inserts into a plain `jit`) on
mpicoll's MPI, through mpicoll's MPI ABI library for jaxlib's MPItrampoline
(mpicoll/csrc/mpiabi/, over_ranks/jax_transport.py, _mpicoll_jax_mpi.py).

Jobs: tests/programs/plain_jit.py (every kind of collective the partitioner makes,
a training step, explicit sharding, 2-D meshes; against numpy, with the compiled
programs' collectives and the job's listeners checked) in both import orders, at
2 x 1, 2 x 2 and 3 x 2 (processes x devices: XLA's groups of devices,
mpiabi/xla_groups.h), and with the opt-out; tests/programs/plain_jit_faults.py
(the watch over XLA's calls: a mismatch, a rank that leaves, raises or sticks,
the flight records).  In process: the library has every name the installed jaxlib
resolves, a function it does not provide names itself and ends the process, and
the reasons JAX's collectives stay on gloo.
"""

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import _mpicoll_jax_mpi
from conftest import REPO, mpicoll_command, run_mpiexec, serial_only

PROGRAM = Path(__file__).parent / "programs" / "plain_jit.py"
sys.path.insert(0, str(REPO / "tools"))
import mpiabi_names  # noqa: E402


@serial_only
@pytest.mark.parametrize("ranks,order,local", [
    (2, "jax-first", 1), (2, "mpicoll-first", 1), (2, "mpicoll-first", 2),
    # (3 x 2: the odd count and groups that mix devices unevenly; CI's first variant)
    pytest.param(3, "jax-first", 2, marks=pytest.mark.slow)])
def test_a_plain_jit_programs_collectives_run_on_the_jobs_mpi(ranks, order, local):
    # local > 1: XLA's groups of devices over processes (mpiabi/xla_groups.h), also
    # groups that mix a process's own devices with another's (the 2-D mesh cases).
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, order, "mpi", local], timeout=240,
                         cwd=PROGRAM.parent)
    assert result.returncode == 0, result.summary()
    devices = f" x {local} devices" if local > 1 else ""
    assert f"ALL OK ({ranks} ranks{devices}, mpi)" in result.stdout, result.summary()


@serial_only
def test_the_opt_out_keeps_gloo():
    result = run_mpiexec(2, [sys.executable, PROGRAM, "jax-first", "gloo"], timeout=240,
                         cwd=PROGRAM.parent, env={"MPICOLL_JAX_COLLECTIVES": "gloo"})
    assert result.returncode == 0, result.summary()
    assert "ALL OK (2 ranks, gloo)" in result.stdout, result.summary()


FAULTS = Path(__file__).parent / "programs" / "plain_jit_faults.py"
DIVERGED = "mpicoll: the ranks' collectives cannot match: "
XLAS_SUM = "all-reduce(float32[3], op=sum), inserted by XLA"


XLAS_COMM = "XLA's communicator 1 (group led by device 0)"


def _faults(case, *arguments, ranks=2, timeout="120", local=1):
    return run_mpiexec(ranks, [sys.executable, FAULTS, case, *arguments], timeout=180,
                       cwd=FAULTS.parent, env={"MPICOLL_TIMEOUT": timeout,
                                               "MPICOLL_STALL_REPORT": "100",
                                               "LOCAL_DEVICES": str(local)})


@serial_only
@pytest.mark.parametrize("local", [1, 2])
def test_a_shape_one_rank_alone_has_is_raised_on_every_rank_in_xlas_terms(local):
    # The first-run check across ranks (watch/guard.h) covers XLA's all-reduce; with
    # 2 devices per process, the one its group's leader makes over the processes.
    result = _faults("new-shape", local=local)
    assert result.returncode == 0, result.summary()
    devices = ", 4 devices" if local == 2 else ""
    for rank in (0, 1):
        line = next(line for line in result.stdout.splitlines()
                    if line.startswith(f"rank {rank}: raised"))
        assert "JaxRuntimeError" in line and "ranks called different collectives" in line, line
        assert f"rank 0: all-reduce(float32[4], op=sum{devices}), inserted by XLA" in line, line
        assert f"rank 1: all-reduce(float32[5], op=sum{devices}), inserted by XLA" in line, line
    assert result.stdout.count("finished") == 2 and "WRONG" not in result.stdout


@serial_only
@pytest.mark.parametrize("case,ranks,local,verdict", [
    ("skip-finish", 2, 1, "rank 1 has finished its script without reaching the collective "
                          f"rank 0 waits in on {XLAS_COMM}"),
    pytest.param("skip-finish", 3, 1, "rank 2 has finished its script without reaching the "
                 "collective", marks=pytest.mark.slow),
    ("skip-finish", 2, 2, "rank 1 has finished its script without reaching the collective"),
    ("exit-mid", 2, 1, "rank 1 exits with code 7 while rank 0 waits for it"),
])
def test_a_rank_that_leaves_a_plain_jit_step_is_named_in_seconds(case, ranks, local, verdict):
    result = _faults(case, ranks=ranks, local=local)
    assert result.returncode != 0 and result.seconds < 30, result.summary()
    assert result.output.count(DIVERGED) == 1 and verdict in result.output, result.summary()
    call = XLAS_SUM.replace("op=sum)", "op=sum, 4 devices)") if local == 2 else XLAS_SUM
    assert f"rank 0 ({os.uname().nodename}): in {call}" in result.output, result.summary()
    assert "WRONG" not in result.output


@serial_only
def test_an_exception_or_a_stuck_rank_ends_a_plain_jit_job():
    raised = _faults("raise")
    assert raised.returncode != 0 and raised.seconds < 30, raised.summary()
    assert "uncaught exception on rank 1 of 2; aborting the job" in raised.output
    stuck = _faults("stuck", timeout="4")
    assert stuck.returncode != 0 and stuck.seconds < 40, stuck.summary()
    assert re.search(rf"waiting \d+\.\d s in {re.escape(XLAS_SUM)}", stuck.output), \
        stuck.summary()  # the stall report
    assert "time.sleep(600)" in stuck.output  # where rank 1 is
    assert re.search(r"XLA's own collectives\) has waited \d+\.\d s in all-reduce "
                     r"\(MPICOLL_TIMEOUT=4\)", stuck.output), stuck.summary()


@serial_only
def test_a_program_on_some_of_each_processs_devices_is_named_not_hung():
    # The limit of XLA's MPI path (docs/jax-vocabulary.md): said at the stall
    # report's time, the job ended at MPICOLL_TIMEOUT.
    result = run_mpiexec(2, [sys.executable, FAULTS, "some-devices"], timeout=120,
                         cwd=FAULTS.parent, env={"MPICOLL_TIMEOUT": "5",
                                                 "MPICOLL_STALL_REPORT": "2",
                                                 "LOCAL_DEVICES": "2"})
    assert result.returncode != 0 and result.seconds < 40, result.summary()
    said = "1 of this process's 2 CPU devices have waited"
    assert said in result.output and "a program with collectives on some of a process's " \
        "devices only" in result.output, result.summary()
    assert "aborting the job (MPICOLL_TIMEOUT)" in result.output, result.summary()


@serial_only
def test_xlas_collectives_are_in_the_flight_records_and_the_timeline(tmp_path):
    import json

    from mpicoll._src.observe import records

    result = _faults("traced", str(tmp_path))
    assert result.returncode == 0 and "WRONG" not in result.output, result.summary()
    events = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert set(threads.values()) == {"XLA's own collectives"}, threads
    assert all(tid >= records.XLA_SLOT for tid in threads), threads
    calls = [e["name"] for e in events if e.get("ph") == "X"]
    assert calls.count("all-reduce(float32[3])") == 3, calls
    assert {"send(uint8[8])", "recv(uint8[8])", "all-gather(float32[8])"} <= set(calls), calls
    status, flight = mpicoll_command("flight", tmp_path)
    assert status == 0 and "the ranks agree" in flight, flight
    assert f"{XLAS_COMM} (ranks 0,1)" in flight, flight


def test_the_records_name_xlas_slot_as_the_extension_does():
    from mpicoll._src.observe import records
    from mpicoll._src.runtime import native

    assert native.extension.build_info()["xla_slot"] == records.XLA_SLOT


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
    from mpicoll._src.runtime import native, settings

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
    monkeypatch.setattr(native, "SERIALIZED", True)
    assert "MPI_THREAD_SERIALIZED" in jax_transport._problem_here()
    monkeypatch.setattr(native, "SERIALIZED", False)
    with settings.override(jax_collectives="gloo"):
        assert jax_transport._problem_here() == "MPICOLL_JAX_COLLECTIVES=gloo"

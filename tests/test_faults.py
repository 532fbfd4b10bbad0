"""Never hang, never fail silently: what a 2-rank job does when something goes wrong.

Each test launches tests/programs/faults.py under `mpiexec -n 2` (serial suite
only) and checks the job's exit status, how long it took to end after the
failure started (the program prints that moment), its stderr, and that no rank
process outlived the job.  A hang fails the test at the subprocess timeout
(JOB_TIMEOUT) instead of hanging the suite.

The last test runs in every suite: an MPI error inside a collective (MPI_Bcast
with a root MPI itself rejects, bypassing mpicoll's Python checks) comes back
as an exception naming the op, rank, communicator and MPI's error string.
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from conftest import RANK, WORLD, assert_in_step, run_mpiexec, serial_only
from mpicoll._src.primitive import spec
from mpicoll._src.runtime import comm as comm_layer

PROGRAMS = Path(__file__).parent / "programs"
PROGRAM = PROGRAMS / "faults.py"
JOB_TIMEOUT = 120  # s: far above every bound below; reaching it means a hang
FAIL_FAST = 10  # s from the failure to the end of the job
# mpicoll's settings as if unset, whatever the environment of the test run says.
DEFAULTS = {"MPICOLL_ABORT_ON_ERROR": "", "MPICOLL_CHECK": "", "MPICOLL_TIMEOUT": ""}


def _events(run):
    """{(rank, name): wall-clock time} from the program's `event RANK NAME TIME` lines."""
    return {(int(rank), name): float(t)
            for rank, name, t in re.findall(r"^event (\d+) (\S+) ([\d.]+)$", run.log, re.M)}


def _pids(run):
    return [int(pid) for pid in re.findall(r"^pid \d+ (\d+)$", run.log, re.M)]


def _alive(pid):
    """True if pid is still one of this program's rank processes (not a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if PROGRAM.stem.encode() not in f.read():
                return False  # gone, and the pid reused by something else
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def launch(*args, env=None, prefix=(), timeout=JOB_TIMEOUT):
    """Run faults.py under mpiexec -n 2.

    Returns the MPIRun with `.log` added: what the ranks printed, read from
    their own files (rank 0's lines, then rank 1's).
    """
    with tempfile.TemporaryDirectory() as logs:
        run = run_mpiexec(2, [sys.executable, *prefix, *args],
                          env={**DEFAULTS, **(env or {}), "FAULTS_LOG": logs}, timeout=timeout)
        run.log = "".join(p.read_text() for p in sorted(Path(logs).glob("rank-*.log")))
    return run


def assert_job_ended_fast(run, event, within=FAIL_FAST, ranks_started=2):
    """Non-zero exit, at most `within` s after `event`, and no rank process left behind."""
    summary = run.summary()
    assert len(_pids(run)) == ranks_started, summary
    events = _events(run)
    assert event in events, summary
    took = run.ended - events[event]
    assert run.returncode != 0, summary
    assert took < within, f"the job ended {took:.1f} s after {event}\n{summary}"
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in _pids(run)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in _pids(run) if _alive(pid)]
    assert not left, f"rank processes {left} outlived the job\n{summary}"
    print(f"job ended {took:.2f} s after {event}, exit {run.returncode}, total {run.seconds:.1f} s")
    return took


# ---------------------------------------------------------------------------
# An exception on one rank while the other waits in a collective.

LAUNCH_FORMS = {
    # (prefix before the program, environment): abort on error is on by default at
    # 2 ranks, and `python -m mpicoll` turns it on whatever MPICOLL_ABORT_ON_ERROR says.
    "script": ((), {}),
    "python-m-mpicoll-script": (("-m", "mpicoll"), {"MPICOLL_ABORT_ON_ERROR": "0"}),
    "python-m-mpicoll-module": (("-m", "mpicoll", "-m"), {"MPICOLL_ABORT_ON_ERROR": "0"}),
}


@serial_only
@pytest.mark.parametrize("form", LAUNCH_FORMS)
def test_exception_on_one_rank_aborts_the_job(form):
    prefix, env = LAUNCH_FORMS[form]
    program = PROGRAM.stem if form.endswith("module") else PROGRAM
    if form.endswith("module"):
        path = [str(PROGRAMS), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**env, "PYTHONPATH": os.pathsep.join(path)}
    run = launch(program, "raise", env=env, prefix=prefix)
    assert_job_ended_fast(run, (1, "raise"))
    assert "uncaught exception on rank 1 of 2; aborting the job" in run.stderr, run.summary()
    assert "RuntimeError: deliberate failure on rank 1" in run.stderr, run.summary()
    assert "returned (it must not)" not in run.log, run.summary()


# An MPI_Abort that never returns and never ends the job (as Open MPI 4.1's once did in
# CI, waiting for its launcher): LD_PRELOAD puts this one before the MPI library's.
_HANGING_ABORT = """
#include <unistd.h>
int MPI_Abort(void* comm, int code) { (void)comm; (void)code; for (;;) pause(); }
"""


@serial_only
@pytest.mark.slow  # 15 s, most of it the 10 s backstop: CI's first variant runs it
def test_a_rank_whose_mpi_abort_hangs_ends_itself(tmp_path):
    source = tmp_path / "hanging_abort.c"
    source.write_text(_HANGING_ABORT)
    shim = tmp_path / "hanging_abort.so"
    built = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(source)],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    run = launch(PROGRAM, "raise", env={"LD_PRELOAD": str(shim)})
    # The backstop (csrc/watch/guard.h, AbortJob): 10 s after the abort began.
    took = assert_job_ended_fast(run, (1, "raise"), within=10 + FAIL_FAST)
    assert took > 9, f"ended {took:.1f} s after the failure: MPI_Abort did not hang?\n" \
        + run.summary()
    assert "MPI_Abort did not end this process in 10 s: it exits" in run.stderr, run.summary()
    assert "RuntimeError: deliberate failure on rank 1" in run.stderr, run.summary()


@serial_only
def test_exception_in_a_thread_aborts_the_job():
    run = launch(PROGRAM, "raise-in-thread")
    assert_job_ended_fast(run, (1, "raise"))
    assert "uncaught exception on rank 1 of 2 in thread worker; aborting the job" in run.stderr, \
        run.summary()
    assert "RuntimeError: deliberate failure in a thread of rank 1" in run.stderr, run.summary()
    assert "returned (it must not)" not in run.log, run.summary()


@serial_only
def test_exception_without_abort_on_error_ends_the_job_in_seconds():
    """MPICOLL_ABORT_ON_ERROR=0: the failed rank exits, and tells the others where its
    script ended: the one waiting for it ends the job within a second or two, long
    before MPICOLL_TIMEOUT (csrc/watch/watchdog.h)."""
    timeout = 60
    run = launch(PROGRAM, "raise",
                 env={"MPICOLL_ABORT_ON_ERROR": "0", "MPICOLL_TIMEOUT": str(timeout)})
    assert_job_ended_fast(run, (0, "wait"), within=5 + FAIL_FAST)
    # Python's own report of the exception (no abort hook), then rank 0's watchdog.
    assert "RuntimeError: deliberate failure on rank 1" in run.stderr, run.summary()
    assert "uncaught exception on rank" not in run.stderr, run.summary()
    assert re.search(r"rank 1 has finished its script without reaching the collective rank 0 "
                     r"waits in on MPI_COMM_WORLD", run.stderr), run.summary()
    assert re.search(r"rank 1 \(.*\): finished its script at .*faults\.py:\d+ \(an uncaught "
                     r"RuntimeError\)", run.stderr), run.summary()


# ---------------------------------------------------------------------------
# Check mode: mismatched calls raise a clear error on every rank.

@serial_only
@pytest.mark.parametrize("check_mode", ["every-call", "first-run"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_check_mode_reports_mismatched_calls_on_every_rank(mode, check_mode):
    """Every rank raises JaxRuntimeError listing each rank's call, the first time
    and again when JAX runs its cached program (first-run is the default)."""
    run = launch(PROGRAM, "check", mode, check_mode)
    assert run.returncode == 0, run.summary()
    events = _events(run)
    for rank in (0, 1):
        for case, (mine, theirs) in {
            "shape": ("allreduce(float32[4], op=sum)", "allreduce(float32[5], op=sum)"),
            "op": ("allreduce(float32[4], op=sum)", "bcast(float32[4], root=0)"),
        }.items():
            for attempt in ("", " again"):
                line = re.search(rf"^rank {rank} {case}{attempt} caught (.*)$", run.log, re.M)
                assert line, run.summary()
                text = line.group(1)
                assert text.startswith("JaxRuntimeError: "), text
                assert "mpicoll: ranks called different collectives on " \
                       "MPI_COMM_WORLD (this is" in text, text
                assert f"(this is rank {rank})" in text, text
                # Each rank's call with its sequence number (and, every-call, its site).
                assert re.search(rf"rank 0: {re.escape(mine)}, sequence \d+.* \| +rank 1: "
                                 rf"{re.escape(theirs)}, sequence \d+", text), text
            assert f"rank {rank} in step after {case}: True" in run.log, run.summary()
    # Each mismatch was reported within FAIL_FAST s of the call (the next case's
    # event, or the end of the job, follows the report).
    assert events[(0, "op")] - events[(0, "shape")] < FAIL_FAST, events
    assert run.ended - events[(0, "op")] < FAIL_FAST, events


@serial_only
def test_check_mode_error_left_uncaught_aborts_the_job():
    run = launch(PROGRAM, "check-uncaught")
    assert_job_ended_fast(run, (0, "shape"))
    assert re.search(r"uncaught exception on rank [01] of 2; aborting the job", run.stderr)
    assert "rank 0: allreduce(float32[4], op=sum)" in run.stderr, run.summary()
    assert "rank 1: allreduce(float32[5], op=sum)" in run.stderr, run.summary()
    assert "returned (it must not)" not in run.log, run.summary()


# ---------------------------------------------------------------------------
# MPICOLL_TIMEOUT: a rank that never joins.

def assert_aborted_by_timeout(scenario, message, timeout=2):
    """Rank 1 never joins: the job ends once rank 0 has waited `timeout` s, saying `message`."""
    run = launch(PROGRAM, scenario, env={"MPICOLL_TIMEOUT": str(timeout)})
    took = assert_job_ended_fast(run, (0, "wait"), within=timeout + FAIL_FAST)
    assert took >= timeout, f"aborted after {took:.1f} s, before MPICOLL_TIMEOUT={timeout}"
    assert re.search(message.format(timeout=timeout), run.stderr), run.summary()
    assert "returned (it must not)" not in run.log, run.summary()


@serial_only
def test_timeout_aborts_a_collective_that_never_completes():
    assert_aborted_by_timeout(
        "hang", r"mpicoll: rank 0 \(rank 0 of solver, local device 0\) "
        r"has waited [\d.]+ s in allreduce \(MPICOLL_TIMEOUT={timeout}\); aborting the job")


@serial_only
def test_timeout_covers_the_collective_setup_at_a_communicators_first_use():
    """The per-device MPI_Comm_dup at first use is collective: watched like a collective,
    and named as the collective the program called there."""
    assert_aborted_by_timeout(
        "first-use", r"mpicoll: rank 0 has waited [\d.]+ s in allreduce \(called at "
        r".*faults\.py:\d+ \(first_use\)\), the first collective on fresh \(its setup, "
        r"MPI_Comm_dup, MPICOLL_TIMEOUT={timeout}\): another rank has not reached its first "
        r"collective there")


@serial_only
def test_timeout_aborts_a_recv_whose_message_never_comes():
    assert_aborted_by_timeout(
        "recv-never-sent", r"mpicoll: rank 0 \(rank 0 of MPI_COMM_WORLD, local "
        r"device 0\) has waited [\d.]+ s in recv \(MPICOLL_TIMEOUT={timeout}\); aborting the job")


# ---------------------------------------------------------------------------
# A rank killed by SIGKILL in the middle of a loop of jitted collectives.

@serial_only
def test_sigkilled_rank_ends_the_job():
    run = launch(PROGRAM, "sigkill")
    assert_job_ended_fast(run, (1, "sigkill"), within=30)
    assert "loop finished (it must not)" not in run.log, run.summary()
    # The launcher says why: MPICH "Killed (signal 9)", Open MPI "exited on signal 9".
    assert "signal 9" in run.output, run.summary()


# ---------------------------------------------------------------------------
# The suite's own backstop: a job that hangs is killed whole at its timeout.

@serial_only
def test_run_mpiexec_kills_a_hung_job_at_its_timeout():
    """Without MPICOLL_TIMEOUT the "hang" job never ends by itself: run_mpiexec must
    fail the test at its timeout and leave no rank process behind."""
    with tempfile.TemporaryDirectory() as logs:
        start = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match="did not finish in 8 s"):
            run_mpiexec(2, [sys.executable, PROGRAM, "hang"],
                        env={**DEFAULTS, "FAULTS_LOG": logs}, timeout=8)
        took = time.monotonic() - start
        log = "".join(p.read_text() for p in sorted(Path(logs).glob("rank-*.log")))
    pids = [int(pid) for pid in re.findall(r"^pid \d+ (\d+)$", log, re.M)]
    assert 8 <= took < 8 + FAIL_FAST, took
    assert len(pids) == 2, log  # both ranks had started: there was something to kill
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "rank processes survived the kill"


# ---------------------------------------------------------------------------
# An error returned by MPI (every suite, in-process).

def test_mpi_error_is_raised_naming_op_rank_comm_and_mpi_error():
    """Bind bcast directly (no Python checks) with a root MPI rejects: every rank's
    MPI_Bcast returns MPI_ERR_ROOT locally, before any communication."""
    solver = WORLD.Dup()
    solver.Set_name("solver")
    try:
        info = comm_layer.resolve(solver, "test")
        bad = jax.jit(lambda x: spec.SPECS["bcast"].primitive.bind(
            x, comm=info.slot, size=info.size, root=info.size + 3, op=-1, transpose_sums=False,
            ordered=True, alias=True))
        with pytest.raises(Exception) as caught:
            bad(jnp.ones(3)).block_until_ready()
        assert_in_step(11)
    finally:
        solver.Free()
    message = str(caught.value)
    assert f"mpicoll.bcast failed on rank {RANK} of communicator mpicoll:solver:device0: " \
        in message, message
    assert re.search(r"root", message, re.I), message  # MPI's own error string

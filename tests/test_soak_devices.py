"""Soak over ranks x local devices: realistic data-parallel steps, hundreds of
them, every collective kind and leaf size in one program, each step checked
against numpy (tests/programs/soak_devices.py), under shard_map over
mpicoll.mesh("dev"), pmap with mpicoll's axis_name collectives (and XLA's own
pmean over the devices beside them), and a global mesh after
mpicoll.distributed.initialize(); a plain jit over a 2-D mesh, its collectives
on the job's MPI (tests/programs/plain_jit_soak.py); also with a busy process on
the cores.  And a device that arrives late at every meeting is waited for, not
reported as a divergence (tests/programs/slow_device.py).  Before the progress
threads of docs/design.md the shard_map step at 2 x 2 hung in about half of its
runs.  `make soak-devices` runs the longer matrix (16 MiB leaves, 1,000 steps).
Launched from the serial run only.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_mpiexec, serial_only

PROGRAM = Path(__file__).parent / "programs" / "soak_devices.py"

pytestmark = serial_only


@pytest.mark.parametrize("ranks,devices,mode,steps", [
    (2, 2, "shard_map", 200), (2, 2, "pmap", 300), (2, 2, "global", 200),
    (2, 4, "shard_map", 150), (2, 4, "pmap", 150), (3, 2, "global", 100)])
def test_training_steps_over_ranks_and_devices_never_hang(ranks, devices, mode, steps):
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, devices, mode, steps], timeout=240)
    assert result.returncode == 0, result.summary()
    assert f"SOAK OK ({ranks} ranks x {devices} devices, {mode}, {steps} steps" in \
        result.stdout, result.summary()


# Meeting turns start on XLA's thread where a process has two cores per local
# device (runtime/comm.py); on a smaller machine the test variable allows it, and
# SOAK_JITTER makes some of them go past the bound.
FAST_WAY_JITTERED = {"SOAK_JITTER": "1", "MPICOLL_TEST_MEETING_HERE": "1"}


def _turns(result):
    """(on XLA's thread, handed off, queued): the job's meeting turns, as printed."""
    found = re.search(r"turns: (\d+) on XLA's thread, (\d+) handed off, (\d+) queued",
                      result.stdout)
    assert found, result.summary()
    return tuple(int(n) for n in found.groups())


@pytest.mark.parametrize("ranks,devices,mode", [(2, 2, "shard_map"), (3, 2, "global")])
def test_meetings_ended_on_xlas_thread_and_handed_off_alternate_and_never_hang(
        ranks, devices, mode):
    # SOAK_JITTER: one participant naps 0-3 ms before some steps' collectives, so
    # its rank's meeting turns go past the bound on XLA's thread (1 ms) and are
    # handed to the progress threads, while the other steps' turns end on XLA's
    # thread: both ways within one job, and within one step.
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, devices, mode, 150],
                         env=FAST_WAY_JITTERED, timeout=240)
    assert result.returncode == 0, result.summary()
    assert f"SOAK OK ({ranks} ranks x {devices} devices, {mode}, 150 steps" in \
        result.stdout, result.summary()
    here, handed_off, _ = _turns(result)
    assert here > 0 and handed_off > 0, result.summary()


@pytest.mark.parametrize("ranks,devices,steps", [(2, 2, 300), (2, 4, 150), (3, 2, 100)])
def test_sharded_array_steps_never_hang(ranks, devices, steps):
    # Arrays laid out over each process's devices: XLA's own all-reduces over the
    # devices and mpicoll's per-device calls over the ranks in one program.
    result = run_mpiexec(ranks, [sys.executable, PROGRAM.parent / "soak_sharded.py", devices,
                                 steps], timeout=240)
    assert result.returncode == 0, result.summary()
    assert f"SOAK SHARDED OK ({ranks} ranks x {devices} devices, {steps} steps" in \
        result.stdout, result.summary()


@pytest.mark.parametrize("ranks,devices,steps", [(2, 2, 300), (3, 2, 100)])
def test_plain_jit_steps_on_the_jobs_mpi_never_hang(ranks, devices, steps):
    # A plain jit over a 2-D mesh: XLA's all-reduce, all-gather, collective-permute
    # and all-to-all in groups of devices over processes (csrc/mpiabi/xla_groups.h).
    result = run_mpiexec(ranks, [sys.executable, PROGRAM.parent / "plain_jit_soak.py", devices,
                                 steps], timeout=240)
    assert result.returncode == 0, result.summary()
    assert f"PLAIN JIT SOAK OK ({ranks} ranks x {devices} devices, {steps} steps" in \
        result.stdout, result.summary()


def test_training_steps_under_load():
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        result = run_mpiexec(2, [sys.executable, PROGRAM, 2, "shard_map", 200], timeout=240,
                             env=FAST_WAY_JITTERED)
        sharded = run_mpiexec(2, [sys.executable, PROGRAM.parent / "soak_sharded.py", 2, 200],
                              timeout=240)
        plain = run_mpiexec(2, [sys.executable, PROGRAM.parent / "plain_jit_soak.py", 2, 200],
                            timeout=240)
    finally:
        hog.kill()
        hog.wait()
    assert result.returncode == 0, result.summary()
    assert "SOAK OK (2 ranks x 2 devices, shard_map, 200 steps" in result.stdout, result.summary()
    assert sharded.returncode == 0, sharded.summary()
    assert "SOAK SHARDED OK (2 ranks x 2 devices, 200 steps" in sharded.stdout, sharded.summary()
    assert plain.returncode == 0, plain.summary()
    assert "PLAIN JIT SOAK OK (2 ranks x 2 devices, 200 steps" in plain.stdout, plain.summary()


@pytest.mark.parametrize("devices", [2, 4])
def test_a_late_device_is_waited_for_not_reported_as_a_divergence(devices):
    # One device of one rank arrives 2 s late at every step's meetings while the
    # others wait in the meeting or in MPI on other devices' communicators: the
    # watchdog (probing from 0.5 s) must see one collective, not a divergence.
    result = run_mpiexec(2, [sys.executable, PROGRAM.parent / "slow_device.py", devices, 2],
                         timeout=180)
    assert result.returncode == 0, result.summary()
    assert f"SLOW DEVICE OK (2 ranks x {devices} devices)" in result.stdout, result.summary()
    assert "mpicoll:" not in result.stderr, result.summary()


def test_a_device_that_never_arrives_is_reported_as_devices_that_did_not_meet(tmp_path):
    # The late device sleeps past MPICOLL_TIMEOUT: the job ends with the library's
    # wait named (not a divergence), and the flight records say the local devices of
    # rank 1 did not meet, not that a rank skipped a collective.
    result = run_mpiexec(2, [sys.executable, PROGRAM.parent / "slow_device.py", 2, 600],
                         env={"MPICOLL_TIMEOUT": "6", "MPICOLL_FLIGHT_DIR": str(tmp_path)},
                         timeout=180)
    assert result.returncode != 0, result.summary()
    # Whichever timeout fires first ends the job: the waiting device's ("... to meet,
    # which did not come") or rank 0's leader's, in MPI for rank 1 (both at 6 s; the
    # watchdog looks every 0.1 s, so the time it prints may be 6.1 s).
    assert re.search(r"has waited 6\.\d s in allreduce", result.stderr), result.summary()
    assert "diverge" not in result.stderr, result.summary()
    analysed = subprocess.run([sys.executable, "-m", "mpicoll", "flight", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
    assert analysed.returncode == 1, analysed.stdout + analysed.stderr
    assert "MPI_COMM_WORLD, rank 1: its local devices 0, 1 did not meet\n" \
        "  local device 0 waits in meeting 1" in analysed.stdout, analysed.stdout
    assert "  local device 1 has not arrived (none in its records)" in analysed.stdout, \
        analysed.stdout
    assert analysed.stdout.endswith("the ranks did not skip a collective: the local devices "
                                    "of rank 1 did not meet (above)\n"), analysed.stdout

"""mpicoll.distributed.initialize(): jax.distributed brought up from MPI.

Jobs (tests/programs/distributed.py) at 1 and 2 ranks with 1 and 2 devices per
rank: JAX's multi-process API and mpicoll's collectives beside it, against numpy.
In process: what initialize() refuses, before any MPI call.
"""

import subprocess
import sys
from pathlib import Path

import jax
import pytest

import mpicoll.distributed
from conftest import run_mpiexec, serial_only

PROGRAM = Path(__file__).parent / "programs" / "distributed.py"
GLOBAL_MESH = Path(__file__).parent / "programs" / "global_mesh.py"


@serial_only
@pytest.mark.parametrize("ranks,devices", [(2, 1), (2, 2), (1, 2)])
def test_jax_multiprocess_api_and_mpicoll_after_initialize(ranks, devices):
    # JAX's runtime catches SIGTERM: run_mpiexec kills the job's whole session on timeout.
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, devices], timeout=180)
    assert result.returncode == 0, result.summary()
    assert f"ALL OK ({ranks} ranks x {devices} devices)" in result.stdout, result.summary()


@serial_only
# 3 ranks: in-process tests.  2 x 2 (15 s on 2 cores: the devices' programs compiled
# twice, the reference and the job) runs in CI's first variant and the jax 0.12 run;
# 2 x 4 took 39 s for the same mechanism (test_soak_devices.py runs 2 x 4).
@pytest.mark.parametrize("ranks,devices", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_a_global_mesh_program_runs_its_collectives_on_mpicoll(ranks, devices, tmp_path):
    # The same program in one process over ranks x devices first: the reference.
    reference = tmp_path / "reference.npz"
    made = subprocess.run([sys.executable, GLOBAL_MESH, str(devices), str(reference),
                           "--reference", str(ranks)], cwd=GLOBAL_MESH.parent,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    result = run_mpiexec(ranks, [sys.executable, GLOBAL_MESH, devices, reference], timeout=300)
    assert result.returncode == 0, result.summary()
    assert f"ALL OK ({ranks} ranks x {devices} devices, global mesh)" in result.stdout, \
        result.summary()


@serial_only
@pytest.mark.parametrize("ranks,devices", [(2, 2), (3, 1)])
def test_multihost_utils_run_on_mpi_with_jaxs_results_and_errors(ranks, devices):
    program = GLOBAL_MESH.parent / "multihost_utils.py"
    result = run_mpiexec(ranks, [sys.executable, program, devices], timeout=180)
    assert result.returncode == 0, result.summary()
    assert f"ALL OK ({ranks} ranks x {devices} devices, multihost_utils)" in result.stdout, \
        result.summary()


def test_initialize_refuses_when_jax_has_started():
    jax.devices()  # this process's backends are up
    with pytest.raises(RuntimeError, match="JAX has already started its backends"):
        mpicoll.distributed.initialize()
    assert not mpicoll.distributed.is_initialized()


def test_initialize_refuses_after_jax_distributed_initialize(monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="jax.distributed is already initialized"):
        mpicoll.distributed.initialize()

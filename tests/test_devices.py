"""Collectives inside pmap/shard_map over several local devices per rank.

Each case launches tests/programs/devices.py under `mpiexec -n RANKS` with
DEVICES fake CPU devices per rank (the program checks every op per device and
globally, against lax over one axis of all participants, and repeats a
concurrent-device collective 50 times).  Launched from the serial run only.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

PROGRAM = Path(__file__).parent / "programs" / "devices.py"

pytestmark = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1,
                                reason="launches its own mpiexec; runs in the serial suite")


def mpiexec_command(ranks):
    """mpiexec of the MPI mpi4py uses, with what Open MPI needs in containers and CI."""
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    vendor, _ = MPI.get_vendor()
    if vendor == "Open MPI":
        return [mpiexec, "--oversubscribe", "-n", str(ranks)]
    return [mpiexec, "-n", str(ranks)]


def run_mpi(program_args, ranks, timeout=300):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("XLA_FLAGS", None)
    command = mpiexec_command(ranks) + [sys.executable, *map(str, program_args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_over_ranks_and_local_devices(ranks, devices):
    result = run_mpi([PROGRAM, devices], ranks)
    summary = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, summary
    assert f"ALL OK ({ranks} ranks x {devices} devices)" in result.stdout, summary

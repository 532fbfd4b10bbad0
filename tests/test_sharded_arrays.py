"""mpicoll's collectives on arrays laid out over several local devices:
every collective, the v-forms, point-to-point and mpicoll.mpi4jax, on arrays sharded
on a dimension, another, replicated, and over a 2 x 2 local mesh with one axis
replicated; eagerly, in jit (explicit axes, in/out shardings), under jax.set_mesh,
with Auto axes, under grad and vmap; values against numpy on every rank's data and
result layouts against the documented ones (tests/programs/sharded_arrays.py).
Launched from the serial run only.
"""

import sys
from pathlib import Path

import pytest

from conftest import run_mpiexec, serial_only

PROGRAM = Path(__file__).parent / "programs" / "sharded_arrays.py"

pytestmark = serial_only


@pytest.mark.parametrize("ranks,devices", [(2, 2), (2, 4), (3, 2)])
def test_collectives_of_arrays_over_local_devices(ranks, devices):
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, devices], timeout=240)
    assert result.returncode == 0, result.summary()
    assert f"SHARDED OK ({ranks} ranks x {devices} devices)" in result.stdout, result.summary()
    assert "RET_CHECK" not in result.output, result.summary()  # no XLA internal error

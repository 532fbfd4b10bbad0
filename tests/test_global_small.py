"""The global allreduce's local combine in mpicoll's handler (small arrays).

Each case launches tests/programs/global_small.py under `mpiexec -n RANKS` with
L fake CPU devices per rank: every op below and above LOCAL_COMBINE_BYTES
against numpy on the gathered inputs, under pmap, shard_map (with and without
check_vma) and vmap, gradients against the lax composition, the composition
inside mpicoll.overlap(), 200 successive calls, and (2 ranks) check mode's
mismatch error; and a device that never arrives ends the job at
MPICOLL_TIMEOUT.  Launched from the serial run
only.
"""

import re
import sys
import time
from pathlib import Path

import pytest

from conftest import run_mpiexec, serial_only

PROGRAM = Path(__file__).parent / "programs" / "global_small.py"

pytestmark = serial_only


# 3 devices: the local reduction's slices are uneven (one is empty for 2 elements).
# One device per rank has no local combine: the suite's multi-rank runs cover it.
@pytest.mark.parametrize("ranks,devices", [(1, 2), (2, 2), (2, 3)])
def test_global_allreduce_small_and_large(ranks, devices):
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, devices])
    assert result.returncode == 0, result.summary()
    assert f"ALL OK ({ranks} ranks x {devices} devices)" in result.stdout, result.summary()


def test_a_device_that_never_arrives_ends_the_job_at_the_timeout():
    timeout = 3
    started = time.monotonic()
    result = run_mpiexec(1, [sys.executable, PROGRAM, 2, "stray"], timeout=120,
                         env={"MPICOLL_TIMEOUT": str(timeout), "MPICOLL_ABORT_ON_ERROR": "0"})
    took = time.monotonic() - started
    assert result.returncode != 0, result.summary()
    assert "stray call returned" not in result.stdout, result.summary()
    assert re.search(r"its local device \d has waited [\d.]+ s in allreduce\(\S+\) on \S+ for this "
                     r"process's other local devices to meet", result.stderr), result.summary()
    assert took >= timeout, result.summary()

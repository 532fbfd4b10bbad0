"""Collectives inside pmap/shard_map over several local devices per rank.

Each case launches tests/programs/devices.py under `mpiexec -n RANKS` with
DEVICES fake CPU devices per rank (the program checks every op per device and
globally, against lax over one axis of all participants, and repeats a
concurrent-device collective 50 times).  Launched from the serial run only.
"""

import sys
from pathlib import Path

import pytest

from conftest import run_mpiexec, serial_only

PROGRAM = Path(__file__).parent / "programs" / "devices.py"

pytestmark = serial_only


# Two and four devices (threads sharing a rank), and an odd rank count with
# several devices.  One device per rank (the plain path) is what the suite's own
# multi-rank runs check (2x1 took 10 s here for nothing more); 3x4 (12
# participants on CI's 2 cores) took 20 s for what 2x4 and 3x2 already cover.
@pytest.mark.parametrize("ranks,devices", [(2, 2), (2, 4), (3, 2)])
def test_collectives_over_ranks_and_local_devices(ranks, devices):
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, devices])
    assert result.returncode == 0, result.summary()
    assert f"ALL OK ({ranks} ranks x {devices} devices)" in result.stdout, result.summary()

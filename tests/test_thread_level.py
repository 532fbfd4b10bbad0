"""The thread-level modes: MPI_THREAD_MULTIPLE (default) and serialized (one device per process).

The serialized mode is chosen before MPI starts, so its tests launch jobs of
their own (tests/programs/serialized.py; only in the serial suite, see
conftest.run_mpiexec).  The default mode is checked in every run.
"""

import re
import sys

import pytest
from mpi4py import MPI

import mpicoll
from conftest import REPO, run_mpiexec

PROGRAM = REPO / "tests" / "programs" / "serialized.py"
TIMEOUT = 300


def test_default_mode_is_multiple():
    assert mpicoll.thread_mode() == "multiple"
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("chosen_by", ["environment", "mpi4py.rc"])
def test_serialized_mode_runs_collectives_and_user_mpi_calls(ranks, chosen_by):
    if chosen_by == "environment":
        argv, env = [PROGRAM, "1"], {"MPI4PY_RC_THREAD_LEVEL": "serialized"}
    else:
        argv, env = [PROGRAM, "1", "--rc"], {}
    result = run_mpiexec(ranks, [sys.executable, *argv], env=env, timeout=TIMEOUT)
    assert result.returncode == 0, result.summary()
    for rank in range(ranks):
        assert f"rank {rank}: ALL OK" in result.stdout, result.summary()
        assert f"rank {rank}: level {MPI.THREAD_SERIALIZED} mode serialized" in result.stdout
    if ranks > 1:
        assert result.stdout.count("rejected: JaxRuntimeError") == ranks, result.summary()


def test_serialized_mode_refuses_several_local_devices_on_every_rank():
    result = run_mpiexec(2, [sys.executable, PROGRAM, "2"],
                         env={"MPI4PY_RC_THREAD_LEVEL": "serialized"}, timeout=TIMEOUT)
    assert result.returncode == 0, result.summary()
    # Two ranks' lines can arrive merged on one (the launcher forwards their output
    # in pieces): each refusal runs to the next one or to the end of its line.
    refusals = re.findall(r"REFUSED: (.*?)(?=REFUSED: |\n|$)", result.stdout)
    assert len(refusals) == 2 and refusals[0] == refusals[1], result.summary()
    assert "mpicoll allows one local device per process, but JAX has 2 here" in refusals[0]


def _import_outcome(code, env):
    result = run_mpiexec(1, [sys.executable, "-c", code], env=env, timeout=TIMEOUT)
    return result.returncode, result.output


@pytest.mark.parametrize("level", ["funneled", "single"])
def test_level_below_serialized_is_an_import_error(level):
    rc, output = _import_outcome("import mpicoll", {"MPI4PY_RC_THREAD_LEVEL": level})
    assert rc != 0
    assert f"but MPI provides MPI_THREAD_{level.upper()}" in output, output

"""Ranks whose layouts cannot match (different local device counts) get one error,
in those words, on every rank, before any collective runs (runtime/comm.py: the
ranks compare their counts when a communicator is set up)."""

import sys
from pathlib import Path

import pytest

from conftest import run_mpiexec

PROGRAM = Path(__file__).parent / "programs" / "layouts.py"


@pytest.mark.parametrize("counts, case, words", [
    ("2,1", "mesh", "rank 0 has 2 local devices, rank 1 has 1"),
    ("1,2,1", "eager", "ranks 0,2 have 1 local device, rank 1 has 2"),
])
def test_different_local_device_counts_are_named_on_every_rank(counts, case, words):
    ranks = len(counts.split(","))
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, counts, case], timeout=120,
                         env={"MPICOLL_TIMEOUT": "60", "MPICOLL_STALL_REPORT": "30"})
    assert result.returncode == 0, result.summary()
    caller = "allreduce"
    for rank in range(ranks):
        assert (f"rank {rank}: raised RuntimeError: mpicoll.{caller}: the ranks' layouts "
                f"cannot match: {words}. Every rank of a communicator needs the same number "
                "of local devices") in result.output, result.summary()
        # nothing of the setup left behind: the ranks' next collective (mpi4py's) matches
        assert f"rank {rank}: mpi4py allreduce {ranks}" in result.output, result.summary()
    assert "returned" not in result.output and "cannot match: ranks 0 and" not in result.output
    assert result.seconds < 30, result.summary()

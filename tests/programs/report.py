"""The end of every multi-rank test program: rank 0 prints each rank's failures and a
verdict line (what the pytest side looks for), and the job exits non-zero on any."""

import sys

from mpi4py import MPI


def report_and_exit(failures, what):
    """failures: this rank's list of messages; what: the job's shape, e.g. '(2 ranks x 2 devices)'."""
    all_failures = MPI.COMM_WORLD.allgather(failures)
    if MPI.COMM_WORLD.Get_rank() == 0:
        for rank, rank_failures in enumerate(all_failures):
            for failure in rank_failures:
                print(f"rank {rank}: FAIL {failure}", flush=True)
        total = sum(map(len, all_failures))
        print("ALL OK" if total == 0 else f"{total} FAILURES", what, flush=True)
    sys.exit(1 if any(all_failures) else 0)

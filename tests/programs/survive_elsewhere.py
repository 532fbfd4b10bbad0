"""A survivor waiting on another communicator than the failed one.

    MPICOLL_FT=1 launch/mpirun.sh -n 3 python survive_elsewhere.py

Rank 2 dies.  Rank 1 waits in an allreduce with it on the default communicator
(MPI_ERR_PROC_FAILED); rank 0 waits in an allreduce with rank 1 alone, on a
communicator without the dead rank, which rank 1 never joins.  The first
failure revokes every communicator of mpicoll's, so rank 0 gets RankLost too
instead of waiting forever; both shrink and allreduce again.  Prints
"ELSEWHERE OK" on rank 0.
"""

import os
import signal
import sys
import time

import jax.numpy as jnp
from mpi4py import MPI

import mpicoll

world = MPI.COMM_WORLD
me = world.Get_rank()
pair = world.Split(0 if me < 2 else 1, me)
mpicoll.allreduce(jnp.ones(1))
mpicoll.allreduce(jnp.ones(1), comm=pair)
if me == 2:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.perf_counter()
try:
    if me == 1:
        mpicoll.allreduce(jnp.ones(1))            # with the dead rank
    else:
        time.sleep(0.5)                           # rank 1 has failed by now
        mpicoll.allreduce(jnp.ones(1), comm=pair)  # with rank 1, which is elsewhere
    print(f"rank {me}: no RankLost", flush=True)
    sys.exit(1)
except mpicoll.RankLost as lost:
    waited = time.perf_counter() - start
    survivors = mpicoll.shrink()
    total = float(mpicoll.allreduce(jnp.ones(1))[0])
    if lost.lost != (2,) or survivors.Get_size() != 2 or total != 2.0 or waited > 5:
        print(f"rank {me}: lost {lost.lost}, {survivors.Get_size()} survivors, sum {total}, "
              f"waited {waited:.2f} s", flush=True)
        sys.exit(1)
    if me == 0:
        print(f"ELSEWHERE OK (RankLost after {waited:.2f} s)", flush=True)

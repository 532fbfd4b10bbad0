"""The timeline after warm-up, run as `mpiexec -n R python timeline.py CASE ARG`:

  slow-compile SECONDS  (with MPICOLL_TRACE) after an allgather (COMM_WORLD's setup),
                the last rank sleeps SECONDS before its first call of `step`, as if it
                compiled much slower than the others; then every rank calls it 20
                times alike: a balanced run
  in-code DIR   3 calls of `step` (not traced), then `with mpicoll.trace(DIR/block)`:
                5 of `step` and 5 of `gathered`; 3 more not traced; then
                start_trace(DIR/skipped, skip=2), 4 of `step` and stop_trace()
  summary SECONDS  (with MPICOLL_SUMMARY=1) an allgather, then 10 calls of `step`, the
                last rank sleeping SECONDS before each: the others wait for it

Each rank prints `rank R: traced to PATH` for each trace it wrote, then `rank R: done`.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
from mpi4py import MPI

import mpicoll

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
CASE, ARG = sys.argv[1], sys.argv[2]

step = jax.jit(lambda x: mpicoll.allreduce(x))
gathered = jax.jit(lambda x: mpicoll.allgather(x))
x = jnp.ones(4)

if CASE == "slow-compile":
    gathered(x).block_until_ready()
    if RANK == SIZE - 1:
        time.sleep(float(ARG))
    for _ in range(21):
        step(x).block_until_ready()
elif CASE == "in-code":
    for _ in range(3):
        step(x).block_until_ready()
    with mpicoll.trace(os.path.join(ARG, "block")) as directory:
        for _ in range(5):
            step(x)
            gathered(x)
    os.write(1, f"rank {RANK}: traced to {directory}\n".encode())  # one write: whole lines
    for _ in range(3):
        step(x).block_until_ready()
    mpicoll.start_trace(os.path.join(ARG, "skipped"), skip=2)
    for _ in range(4):
        step(x)
    os.write(1, f"rank {RANK}: traced to {mpicoll.stop_trace()}\n".encode())
elif CASE == "summary":
    gathered(x).block_until_ready()
    for _ in range(10):
        if RANK == SIZE - 1:
            time.sleep(float(ARG))
        step(x).block_until_ready()
os.write(1, f"rank {RANK}: done\n".encode())  # one write: whole lines

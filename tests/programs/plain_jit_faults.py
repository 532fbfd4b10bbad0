"""A plain `jax.jit` on global arrays whose ranks go wrong, on mpicoll's MPI: the
collectives XLA's partitioner inserts are watched as mpicoll's own are.

    mpiexec -n R python plain_jit_faults.py CASE [DIR]

Every case first runs `total` (a column sum: XLA's all-reduce) on every rank, then
the last rank (the "odd" one) departs from the others:

  new-shape    the odd rank sums a wider array: the check across ranks names both
               calls, every rank raises it, and the job goes on (a right sum follows)
  skip-finish  the odd rank skips the next sum and finishes its script
  exit-mid     the odd rank's process ends (os._exit(7)) while the others wait
  raise        the odd rank raises an exception of its own before the next sum
  stuck        the odd rank sleeps in its own code (MPICOLL_TIMEOUT ends the job)
  traced       no divergence: 3 sums and a roll traced to DIR (start_trace)
  lost         (launched fault-tolerant: MPICOLL_FT=1) the odd rank is killed before
               the next sum: the others print what they raised
  some-devices (LOCAL_DEVICES=2) a sum over each process's first device only: XLA's
               MPI path needs every device (docs/jax-vocabulary.md), and says so

Each rank prints `rank R: returned VALUES` (`WRONG` if numpy disagrees), or
`rank R: raised TYPE: TEXT` for an exception it caught.
"""

import os
import sys
import time

import _common
from _common import fake_cpu_devices

LOCAL = fake_cpu_devices(int(os.environ.get("LOCAL_DEVICES", "1")))
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.distributed  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from mpicoll._src.over_ranks import jax_transport  # noqa: E402

CASE = sys.argv[1]
mpicoll.distributed.initialize(initialization_timeout=60)
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
ODD = RANK == SIZE - 1
assert jax_transport.transport()[0] == "mpi", jax_transport.transport()

mesh = jax.make_mesh((SIZE * LOCAL,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("x"))


def say(text):
    _common.say(text, rank=RANK)


def data(columns):
    full = np.arange(4 * SIZE * LOCAL * columns, dtype=np.float32).reshape(-1, columns)
    return full, jax.make_array_from_callback(full.shape, rows, lambda index: full[index])


total = jax.jit(lambda a: a.sum(0))  # XLA's all-reduce of each rank's column sums


def returned(value, expected):
    value = np.asarray(value)
    right = value.shape == np.shape(expected) and np.allclose(value, expected)
    say(f"returned {value.tolist()}" + ("" if right else f" WRONG (expected {expected})"))


def sum_of(columns):
    full, array = data(columns)
    returned(total(array).addressable_data(0), full.sum(0))


sum_of(3)  # the warm-up: every rank, checked across ranks once

if CASE == "new-shape":
    try:
        sum_of(5 if ODD else 3 + 1)  # a new program on every rank, another width on one
    except Exception as error:
        say(f"raised {type(error).__name__}: {' | '.join(str(error).splitlines())}")
    sum_of(2)  # the job goes on
elif CASE == "skip-finish":
    if not ODD:
        sum_of(3)
elif CASE == "exit-mid":
    if ODD:
        os._exit(7)
    sum_of(3)
elif CASE == "raise":
    if ODD:
        raise ValueError("the odd rank's own mistake")
    sum_of(3)
elif CASE == "stuck":
    if ODD:
        time.sleep(600)
    sum_of(3)
elif CASE == "some-devices":
    firsts = [jax.local_devices(process_index=p)[0] for p in range(SIZE)]
    some = jax.sharding.Mesh(np.array(firsts), ("x",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    full = np.arange(4.0 * SIZE, dtype=np.float32)
    array = jax.make_array_from_callback(full.shape, NamedSharding(some, P("x")),
                                         lambda index: full[index])
    returned(jax.jit(jnp.sum)(array), full.sum())
elif CASE == "lost":
    if ODD:
        os.kill(os.getpid(), 9)
    try:
        sum_of(3)
    except Exception as error:
        say(f"raised {type(error).__name__}: {' | '.join(str(error).splitlines())[:400]}")
    os._exit(0)  # the job's runtime cannot end cleanly with a rank gone
elif CASE == "traced":
    mpicoll.start_trace(sys.argv[2])
    for _ in range(3):
        sum_of(3)
    full, array = data(2)
    rolled = jax.jit(lambda a: jnp.roll(a, 1, axis=0))(array)
    returned(jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))(rolled)
             .addressable_data(0), np.roll(full, 1, axis=0))
    say(f"traced to {mpicoll.stop_trace()}")
say("finished")

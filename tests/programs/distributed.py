"""mpicoll.distributed.initialize() under mpiexec: JAX's multi-process runtime brought up
from MPI, JAX's multi-process API and mpicoll's collectives beside it.

    mpiexec -n RANKS python tests/programs/distributed.py LOCAL_DEVICES

Checked against numpy: the process ids and device counts, process_allgather,
mpicoll's allreduce eagerly, under jit and over ranks x local devices (pmap),
a second initialize() refused.  Prints "ALL OK (R ranks x L devices)".
"""

import os
import sys

LOCAL = int(sys.argv[1])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={LOCAL}")

from mpi4py import MPI  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.distributed  # noqa: E402
from report import report_and_exit  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
failures = []


def check(name, ok, detail=""):
    if not ok:
        failures.append(f"{name}: {detail}")


mpicoll.distributed.initialize(initialization_timeout=60)
check("initialized", mpicoll.distributed.is_initialized() and jax.distributed.is_initialized())
check("process index", jax.process_index() == RANK, jax.process_index())
check("process count", jax.process_count() == SIZE, jax.process_count())
check("local devices", jax.local_device_count() == LOCAL, jax.local_device_count())
check("global devices", len(jax.devices()) == SIZE * LOCAL, jax.devices())

# JAX's own multi-process API (its CPU collectives).
from jax.experimental import multihost_utils  # noqa: E402

mine = np.arange(3, dtype=np.float32) + 10 * RANK
gathered = np.asarray(multihost_utils.process_allgather(mine))
want = np.stack([np.arange(3, dtype=np.float32) + 10 * r for r in range(SIZE)])
check("process_allgather", np.array_equal(gathered, want), gathered)

# mpicoll's collectives beside it: eager, jitted, and over ranks x local devices.
x = np.arange(4, dtype=np.float32) * (RANK + 1)
total = sum(np.arange(4, dtype=np.float32) * (r + 1) for r in range(SIZE))
check("allreduce eager", np.array_equal(np.asarray(mpicoll.allreduce(x)), total))
check("allreduce jit", np.array_equal(np.asarray(jax.jit(mpicoll.allreduce)(x)), total))
per_device = np.stack([x + k for k in range(LOCAL)])
out = jax.pmap(lambda v: mpicoll.allreduce(v, axis_name="d"), axis_name="d",
               devices=jax.local_devices())(per_device)
everyone = sum(np.arange(4, dtype=np.float32) * (r + 1) + k
               for r in range(SIZE) for k in range(LOCAL))
check("allreduce ranks x devices", np.allclose(np.asarray(out), everyone), out)
gathered = np.asarray(mpicoll.allgather(jnp.asarray([RANK], jnp.int32)))
check("allgather", np.array_equal(gathered, np.arange(SIZE)[:, None]), gathered)

try:
    mpicoll.distributed.initialize()
    check("second initialize", False, "no error")
except RuntimeError as error:
    check("second initialize", "already called" in str(error), error)

report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices)")

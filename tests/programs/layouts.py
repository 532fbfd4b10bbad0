"""Ranks whose local device counts differ, run as `mpiexec -n R python layouts.py COUNTS CASE`.

COUNTS gives each rank's CPU devices, e.g. 2,1 (rank 0 two, rank 1 one).  CASE:

  mesh   a jitted shard_map over mpicoll.mesh("dev") with an allreduce
  eager  an eager allreduce on one device (the per-device communicators are
         made for every local device all the same)

Each rank prints `rank R: raised TYPE: MESSAGE` for the error it caught (or
`rank R: returned VALUE`), then `rank R: mpi4py allreduce N` from an mpi4py
allreduce on COMM_WORLD after it: the failed setup left no message behind that
the ranks' next collective could match.
"""

import os
import sys

from mpi4py import MPI

from _common import fake_cpu_devices

rank = MPI.COMM_WORLD.Get_rank()
counts = [int(c) for c in sys.argv[1].split(",")]
fake_cpu_devices(counts[rank])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mpicoll  # noqa: E402

assert jax.local_device_count() == counts[rank]


def mesh():
    spec = P((mpicoll.RANKS, "dev"))
    step = jax.jit(jax.shard_map(mpicoll.allreduce, mesh=mpicoll.mesh("dev"), in_specs=spec,
                                 out_specs=spec))
    return step(jnp.ones(counts[rank] * 4, jnp.float32))


def eager():
    return mpicoll.allreduce(jnp.ones(4, jnp.float32))


try:
    value = {"mesh": mesh, "eager": eager}[sys.argv[2]]()
    print(f"rank {rank}: returned {value}", flush=True)
except Exception as error:  # noqa: BLE001  (printed for the test to read)
    os.write(1, f"rank {rank}: raised {type(error).__name__}: {error}\n".encode())
total = MPI.COMM_WORLD.allreduce(1)
os.write(1, f"rank {rank}: mpi4py allreduce {total}\n".encode())

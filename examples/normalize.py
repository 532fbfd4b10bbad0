"""x / psum(x) over every device of every rank: the normalized pieces sum to 1.0.

JAX's pmap example `normalize = lambda x: x / lax.psum(x, 'i')`, but spanning
ranks x local devices: mpicoll.allreduce(..., axis_name='i') inside pmap sums
over all size * L participants (MPI across ranks, XLA across local devices).

Run:  mpiexec -n 2 python examples/normalize.py
Each rank fakes 2 local CPU devices unless XLA_FLAGS already sets a count.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
L = jax.local_device_count()
participants = size * L
CHUNK = 5  # elements per participant

# The global vector, and this rank's L pieces of it (participant p = rank * L + k).
x_all = np.arange(1, participants * CHUNK + 1, dtype=np.float32)
x_mine = x_all.reshape(participants, CHUNK)[rank * L:(rank + 1) * L]  # (L, CHUNK)


def normalize(x):
    total = mpicoll.allreduce(jnp.sum(x), axis_name="i")  # sum over ranks x devices
    y = x / total
    return y, mpicoll.allreduce(jnp.sum(y), axis_name="i")  # sum of every piece: 1.0


y, global_sum = jax.pmap(normalize, axis_name="i")(x_mine)
y, global_sum = np.asarray(y), np.asarray(global_sum)

expect = (x_all / x_all.astype(np.float64).sum()).reshape(participants, CHUNK)
expect = expect[rank * L:(rank + 1) * L]
ok = bool(np.allclose(y, expect, rtol=1e-6, atol=0)
          and np.allclose(global_sum, 1.0, rtol=1e-6, atol=0))

pieces = np.array2string(y, precision=5, separator=", ").replace("\n", "")
print(f"[rank {rank}/{size}, {L} devices] normalized pieces: {pieces}\n"
      f"[rank {rank}/{size}] global sum over {participants} participants = "
      f"{global_sum.tolist()}  (expect 1.0)\n"
      f"[rank {rank}/{size}] matches numpy: {ok}\n", end="", flush=True)

all_ok = comm.allreduce(ok, op=MPI.LAND)
if rank == 0:
    print(f"normalize: global sum = {float(global_sum[0]):.7f} over {size} ranks x {L} devices; "
          + ("OK" if all_ok else "MISMATCH"), flush=True)
raise SystemExit(0 if all_ok else 1)

"""A 10,000,000 x 3 vdot split over every device of every rank.

a and b are float32 arrays of shape (N, 3) (deterministic data, N = 10_000_000
by default).  Their rows are cut into size * L contiguous pieces, one per
participant (L local devices on each of `size` ranks, participant
p = rank * L + k); each computes jnp.vdot of its piece inside pmap and
mpicoll.allreduce(..., axis_name='i') adds the partial sums over all
participants.  The result is compared with the single-process jnp.vdot(a, b) on
one device: the two sum the same float32 products in a different order, so they
agree to a relative tolerance (RTOL below, ~8 float32 ulps), not bit for bit.
A float64 numpy vdot is printed for scale.

Run:  mpiexec -n 2 python examples/vdot.py [--n ROWS]
Each rank fakes 2 local CPU devices unless XLA_FLAGS already sets a count.
"""

import argparse
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

RTOL = 1e-6  # |distributed - single| / |float64 vdot|; float32 eps is 1.19e-7

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--n", type=int, default=10_000_000, help="rows of a and b (default 1e7)")
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
L = jax.local_device_count()
participants = size * L
N = args.n

# Same data on every rank (each needs it for the single-process reference anyway).
rng = np.random.default_rng(20240601)
a = rng.random((N, 3), dtype=np.float32)
b = rng.random((N, 3), dtype=np.float32) - np.float32(0.25)

# Participant p gets rows [p * rows, (p + 1) * rows); zero rows pad the last piece.
rows = -(-N // participants)


def pieces(x):
    padded = np.zeros((participants * rows, 3), np.float32)
    padded[:N] = x
    return padded.reshape(participants, rows, 3)[rank * L:(rank + 1) * L]  # (L, rows, 3)


def partial_vdot(a_piece, b_piece):
    return mpicoll.allreduce(jnp.vdot(a_piece, b_piece), axis_name="i")


distributed = np.asarray(jax.pmap(partial_vdot, axis_name="i")(pieces(a), pieces(b)))
single = float(jax.jit(jnp.vdot)(a, b))  # one process, one device
exact = float(np.dot(a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)))

rel = [abs(float(v) - single) / abs(exact) for v in distributed]
ok = bool(all(r <= RTOL for r in rel) and np.all(distributed == distributed[0]))

print(f"[rank {rank}/{size}] vdot over {participants} participants = "
      f"{[float(v) for v in distributed]}; single-process jnp.vdot = {single}; "
      f"relative difference {max(rel):.2e} (tolerance {RTOL:g}): {ok}\n", end="", flush=True)

all_ok = comm.allreduce(ok, op=MPI.LAND)
if rank == 0:
    print(f"vdot: ({N}, 3) float32 over {size} ranks x {L} devices = {float(distributed[0])!r}, "
          f"single-process jnp.vdot = {single!r}, float64 numpy = {exact!r}; "
          f"|distributed - single| / |float64| = {max(rel):.2e} <= {RTOL:g}: "
          + ("OK" if all_ok else "MISMATCH"), flush=True)
raise SystemExit(0 if all_ok else 1)

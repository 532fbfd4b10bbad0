"""An mpi4jax program, ported to mpicoll by changing one import.

    mpiexec -n 2 python examples/mpi4jax_port.py

Below is the kind of program mpi4jax's documentation shows: a 1-D diffusion
with halos exchanged by sendrecv between neighbours (periodic), a global sum
by allreduce, and the result collected on rank 0 with gather (whose output on
the other ranks is, as in mpi4jax, their input unchanged).  The only line that
differs from the mpi4jax version is the import:

    import mpi4jax                      # before
    import mpicoll.mpi4jax as mpi4jax   # after

Rank 0 compares the result with the same computation in one process.
"""

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll.mpi4jax as mpi4jax  # was: import mpi4jax

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
N, STEPS, NU = 32, 200, 0.2  # points per rank, time steps, nu * dt / dx^2


@jax.jit
def evolve(u):
    def step(_, u):
        left = mpi4jax.sendrecv(u[-1], u[-1], source=(rank - 1) % size, dest=(rank + 1) % size,
                                comm=comm)
        right = mpi4jax.sendrecv(u[0], u[0], source=(rank + 1) % size, dest=(rank - 1) % size,
                                 comm=comm)
        padded = jnp.concatenate([left[None], u, right[None]])
        return u + NU * (padded[2:] - 2 * u + padded[:-2])
    u = jax.lax.fori_loop(0, STEPS, step, u)
    total = mpi4jax.allreduce(jnp.sum(u), op=MPI.SUM, comm=comm)
    return u, total


def initial(n_total):
    x = np.arange(n_total) / n_total
    return np.exp(-100 * (x - 0.5) ** 2)


u0 = initial(N * size)
u, total = evolve(jnp.asarray(u0[rank * N:(rank + 1) * N]))
everything = mpi4jax.gather(u, 0, comm=comm)  # (size, N) on rank 0; u elsewhere

ok = True
if rank == 0:
    reference = u0.copy()
    for _ in range(STEPS):
        reference = reference + NU * (np.roll(reference, 1) - 2 * reference
                                      + np.roll(reference, -1))
    error = np.max(np.abs(np.asarray(everything).reshape(-1) - reference))
    ok = bool(error < 1e-5 and abs(float(total) - reference.sum()) < 1e-3)
    print(f"mpi4jax_port: {size} rank(s) x {N} points, {STEPS} steps; "
          f"max error vs one process {error:.2e}; sum {float(total):.6f} "
          f"(one process {reference.sum():.6f})\n"
          f"mpi4jax_port: {'ok' if ok else 'FAILED'}", flush=True)
raise SystemExit(0 if comm.bcast(ok, root=0) else 1)

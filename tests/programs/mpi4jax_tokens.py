"""A program written for mpi4jax <= 0.7, run unchanged on mpicoll (MPICOLL_AS_MPI4JAX=1).

    MPICOLL_AS_MPI4JAX=1 mpiexec -n 3 python tests/programs/mpi4jax_tokens.py

In that era's style: a context holds the last token, starting at None; every
call passes token= and unpacks (result, token) (send and barrier: the token);
every jitted kernel takes the token and returns it.  A 1-D diffusion whose
halos are exchanged with sendrecv (periodic), a tagged send/recv chain, a bcast
of the parameters from the last rank and an allreduce of the total, eagerly and
under jax.jit.  Every rank checks the gathered results (mpi4py) against numpy
and prints one line; rank 0 prints "mpi4jax_tokens: ok" when all agree.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpi4jax

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
LEFT, RIGHT = (rank - 1) % size, (rank + 1) % size
N, STEPS = 8, 5


class Context:
    """What applications of the token era keep: the last token (None at the start)."""

    def __init__(self):
        self.token = None


def initial(r):
    return np.sin(np.arange(N) + N * r).astype(np.float64)


def parameters(r):
    return np.array([0.1 + 0.05 * r, 0.2], np.float64)


def step(u, nu, token):
    """One diffusion step: halos from both neighbours, then the stencil."""
    from_left, token = mpi4jax.sendrecv(u[-1:], u[-1:], source=LEFT, dest=RIGHT, sendtag=1,
                                        recvtag=1, comm=comm, token=token)
    from_right, token = mpi4jax.sendrecv(u[:1], u[:1], source=RIGHT, dest=LEFT, sendtag=2,
                                         recvtag=2, comm=comm, token=token)
    padded = jnp.concatenate([from_left, u, from_right])
    return u + nu * (padded[:-2] - 2 * u + padded[2:]), token


def chain(u, token):
    """Rank r sends its u to rank r + 1 with tag 7 + r, in order along the ranks."""
    got = jnp.zeros_like(u)
    if rank > 0:
        got, token = mpi4jax.recv(u, source=rank - 1, tag=7 + rank - 1, comm=comm, token=token)
    if rank < size - 1:
        token = mpi4jax.send(u, dest=rank + 1, tag=7 + rank, comm=comm, token=token)
    return got, token


def program(u, params, token):
    params, token = mpi4jax.bcast(params, root=size - 1, comm=comm, token=token)
    for _ in range(STEPS):
        u, token = step(u, params[0], token)
    got, token = chain(u, token)
    total, token = mpi4jax.allreduce(jnp.sum(u), op=MPI.SUM, comm=comm, token=token)
    token = mpi4jax.barrier(comm=comm, token=token)
    return u, got, total, params, token


def expected():
    """The same computation in one process, with numpy."""
    us = np.stack([initial(r) for r in range(size)])
    nu = parameters(size - 1)[0]
    for _ in range(STEPS):
        padded = np.concatenate([np.roll(us[:, -1:], 1, axis=0), us,
                                 np.roll(us[:, :1], -1, axis=0)], axis=1)
        us = us + nu * (padded[:, :-2] - 2 * us + padded[:, 2:])
    got = np.concatenate([np.zeros((1, N)), us[:-1]])
    return us, got, us.sum(), parameters(size - 1)


def run(mode, ctx):
    u, params = jnp.asarray(initial(rank)), jnp.asarray(parameters(rank))
    if mode == "eager":
        u, got, total, params, ctx.token = program(u, params, ctx.token)
    else:
        # Every jitted kernel takes the last token and returns the new one.
        kernel = jax.jit(program)
        u, got, total, params, ctx.token = kernel(u, params, ctx.token)
        u, got, total, params, ctx.token = kernel(jnp.asarray(initial(rank)),
                                                  jnp.asarray(parameters(rank)), ctx.token)
    return [np.asarray(a) for a in (u, got, total, params)]


def main():
    jax.config.update("jax_enable_x64", True)
    import mpicoll.mpi4jax
    assert mpi4jax is mpicoll.mpi4jax, mpi4jax
    ctx = Context()
    failures = []
    us, got, total, params = expected()
    for mode in ("eager", "jit"):
        mine = run(mode, ctx)
        gathered = comm.allgather(mine)  # mpi4py: every rank checks every rank's results
        for r, (u_r, got_r, total_r, params_r) in enumerate(gathered):
            for name, value, want in (("u", u_r, us[r]), ("recv", got_r, got[r]),
                                      ("allreduce", total_r, total), ("bcast", params_r, params)):
                if not np.allclose(value, want, rtol=1e-12, atol=1e-12):
                    failures.append(f"{mode}: rank {r}'s {name} is {value}, numpy says {want}")
    token_type = type(ctx.token).__name__
    print(f"rank {rank}: mpi4jax {mpi4jax.__version__}, last token {token_type}, "
          f"{len(failures)} mismatch(es)", flush=True)
    for failure in failures:
        print(failure, file=sys.stderr, flush=True)
    failures = comm.allreduce(len(failures))
    if rank == 0 and not failures:
        print(f"mpi4jax_tokens: ok at {size} ranks", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

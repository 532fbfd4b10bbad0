"""The 2-D heat equation, domain-decomposed over MPI ranks, halos exchanged with mpicoll.

Run with a number of ranks that divides 96, e.g.

    mpiexec -n 2 python examples/heat_equation.py      (or launch/mpirun.sh -n 2 ...)

u_t = alpha * (u_xx + u_yy) on the unit square, u = 0 on the boundary, solved
with explicit finite differences (FTCS) on a 96 x 64 grid of interior points.
The grid is cut into horizontal strips, one per rank.  Each time step a rank
needs one row from each neighbour strip (its halo): the row above its first row
and the row below its last.  Those rows travel by mpicoll.sendrecv inside a
jitted lax.fori_loop, so all the steps run as one compiled XLA program.

At the end rank 0 gathers the strips and compares the field with the same
scheme solved by numpy in a single process (they must agree to rounding), and
with the exact solution of the PDE (they differ by the discretization error).
"""

import jax

jax.config.update("jax_enable_x64", True)  # float64, so the comparison is to ~1e-15

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

rank = MPI.COMM_WORLD.Get_rank()
size = MPI.COMM_WORLD.Get_size()

NX, NY = 96, 64          # interior points: rows (split over ranks) x columns
ALPHA, STEPS = 1.0, 400
DX, DY = 1 / (NX + 1), 1 / (NY + 1)
DT = 0.2 * min(DX, DY) ** 2 / ALPHA  # FTCS is stable for dt <= h^2 / (4 alpha)
if NX % size:
    raise SystemExit(f"heat_equation: the rank count ({size}) must divide {NX}")
ROWS = NX // size         # rows of this rank's strip
FIRST_ROW = rank * ROWS   # its first row in the global grid


def initial_field():
    """Two Fourier modes, so that the exact solution is known (each decays at its own rate)."""
    x = np.arange(1, NX + 1)[:, None] * DX
    y = np.arange(1, NY + 1)[None, :] * DY
    return (np.sin(np.pi * x) * np.sin(np.pi * y)
            + 0.5 * np.sin(2 * np.pi * x) * np.sin(3 * np.pi * y))


def exact_solution(t):
    x = np.arange(1, NX + 1)[:, None] * DX
    y = np.arange(1, NY + 1)[None, :] * DY
    return (np.exp(-2 * np.pi ** 2 * ALPHA * t) * np.sin(np.pi * x) * np.sin(np.pi * y)
            + 0.5 * np.exp(-13 * np.pi ** 2 * ALPHA * t)
            * np.sin(2 * np.pi * x) * np.sin(3 * np.pi * y))


def laplacian(padded):
    """The 5-point Laplacian of the interior of a field padded with one ghost cell all round."""
    center = padded[1:-1, 1:-1]
    return ((padded[2:, 1:-1] - 2 * center + padded[:-2, 1:-1]) / DX ** 2
            + (padded[1:-1, 2:] - 2 * center + padded[1:-1, :-2]) / DY ** 2)


def exchange_halos(u):
    """(row above my strip, row below it) from the neighbouring ranks; zeros at the boundary.

    Two sendrecv calls: my last row goes down while the row above arrives from
    up, then my first row goes up while the row below arrives.  At the edges
    the neighbour is PROC_NULL: nothing is sent, and zeros (the Dirichlet
    boundary u = 0) are received.  Every rank makes the same two calls in the
    same order, so the messages pair up and nothing can deadlock.
    """
    up = rank - 1 if rank > 0 else mpicoll.PROC_NULL
    down = rank + 1 if rank < size - 1 else mpicoll.PROC_NULL
    above = mpicoll.sendrecv(u[-1], source=up, dest=down, sendtag=0, recvtag=0)
    below = mpicoll.sendrecv(u[0], source=down, dest=up, sendtag=1, recvtag=1)
    return above, below


@jax.jit
def solve(u):
    """STEPS explicit time steps of this rank's strip, halo exchange included."""
    def step(_, u):
        above, below = exchange_halos(u)
        padded = jnp.pad(jnp.concatenate([above[None], u, below[None]]), ((0, 0), (1, 1)))
        return u + DT * ALPHA * laplacian(padded)
    return jax.lax.fori_loop(0, STEPS, step, u)


def numpy_reference():
    """The same scheme on the whole grid in one process."""
    u = initial_field()
    for _ in range(STEPS):
        u = u + DT * ALPHA * laplacian(np.pad(u, 1))
    return u


strip = jnp.asarray(initial_field()[FIRST_ROW:FIRST_ROW + ROWS])
strip = solve(strip)
field = mpicoll.gather(strip)  # (size, ROWS, NY) on rank 0, zeros elsewhere

ok = True
if rank == 0:
    field = np.asarray(field).reshape(NX, NY)
    error = np.max(np.abs(field - numpy_reference()))
    discretization = np.max(np.abs(field - exact_solution(STEPS * DT)))
    ok = bool(error < 1e-12)
    print(f"heat equation {NX}x{NY}, {STEPS} steps to t={STEPS * DT:.4f}, {size} rank(s) "
          f"x {ROWS} rows\n"
          f"max |u| = {np.max(np.abs(field)):.6f} "
          f"(initially {np.max(np.abs(initial_field())):.6f})\n"
          f"max error vs single-process numpy: {error:.3e}\n"
          f"max error vs exact solution:       {discretization:.3e} (discretization)\n"
          f"heat_equation: {'ok' if ok else 'FAILED'}", flush=True)

raise SystemExit(0 if MPI.COMM_WORLD.bcast(ok, root=0) else 1)

"""One program in JAX's own vocabulary, run three ways.

    python examples/jax_vocabulary.py local                  # one process, 4 CPU devices
    mpiexec -n 2 python examples/jax_vocabulary.py ranks     # mpicoll.mesh(): 2 ranks x 2 devices
    mpiexec -n 2 python examples/jax_vocabulary.py global    # jax.distributed, a global mesh

The step functions below are written once with jax.shard_map and jax.lax
collectives over an axis `AXIS`: data-parallel training of a linear model (its
gradient summed over AXIS by JAX's own rules) and a 1-D heat equation whose halos travel
with lax.ppermute around a ring.  Only the set-up differs: the mesh, the name
of the axis that spans every participant, and how the data becomes a sharded
array.  Across ranks mpicoll runs the collectives over MPI; every way prints
the same numbers (4 participants in each).
"""

import os
import sys

WAY = sys.argv[1] if len(sys.argv) > 1 else "local"
DEVICES = {"local": 4, "ranks": 2, "global": 2}[WAY]  # devices in this process
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

# --- The set-up: the only part that differs between the three ways ----------
if WAY == "local":
    MESH = jax.make_mesh((4,), ("data",))
    AXIS = "data"
    PROCESS, PROCESSES = 0, 1
elif WAY == "ranks":
    import mpicoll
    MESH = mpicoll.mesh("dev")  # RANKS x this rank's devices
    AXIS = (mpicoll.RANKS, "dev")  # every device of every rank, rank-major
    from mpi4py import MPI
    PROCESS, PROCESSES = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
else:
    import mpicoll.distributed
    mpicoll.distributed.initialize()  # the one line a gloo program would differ in
    MESH = jax.make_mesh((jax.device_count(),), ("data",))
    AXIS = "data"
    PROCESS, PROCESSES = jax.process_index(), jax.process_count()
SPEC = P(AXIS)


def sharded(everything):
    """The global array `everything`, split over the participants along axis 0."""
    mine = np.array_split(everything, PROCESSES)[PROCESS]
    if WAY == "ranks":  # the mesh holds this rank's devices: its part is the array
        return jax.device_put(mine, NamedSharding(MESH, SPEC))
    return jax.make_array_from_process_local_data(NamedSharding(MESH, SPEC), mine)


# --- The program, written once ---------------------------------------------
def loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


@jax.jit
@jax.shard_map(mesh=MESH, in_specs=(P(), SPEC, SPEC), out_specs=(P(), P()))
def train_step(w, x, y):
    # The global loss is the mean over participants.  w is replicated (P()), so
    # its gradient is summed over AXIS by JAX itself: pcast(to='varying')'s transpose is a
    # psum, the data-parallel all-reduce (over MPI, where AXIS spans ranks).
    value, grad = jax.value_and_grad(lambda w: lax.pmean(loss(w, x, y), AXIS))(w)
    return w - 0.1 * grad, value


@jax.jit
@jax.shard_map(mesh=MESH, in_specs=SPEC, out_specs=(SPEC, P()))
def heat_step(u):
    n = lax.axis_size(AXIS)
    left = lax.ppermute(u[-1:], AXIS, [(i, (i + 1) % n) for i in range(n)])  # from the left
    right = lax.ppermute(u[:1], AXIS, [(i, (i - 1) % n) for i in range(n)])  # from the right
    padded = jnp.concatenate([left, u, right])
    u = u + 0.25 * (padded[:-2] - 2 * u + padded[2:])
    return u, lax.psum(jnp.sum(u * u), AXIS)


rng = np.random.default_rng(0)
X = rng.normal(size=(64, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.1 * rng.normal(size=64)).astype(np.float32)
x, y = sharded(X), sharded(Y)
w = jnp.zeros(3, jnp.float32)
for _ in range(10):
    w, value = train_step(w, x, y)

u = sharded(np.sin(np.linspace(0, 2 * np.pi, 32, endpoint=False)).astype(np.float32))
for _ in range(20):
    u, energy = heat_step(u)



def numpy_reference():
    """The same training and heat equation in numpy, in one piece."""
    w = np.zeros(3)
    for _ in range(10):
        residual = X @ w - Y
        value, w = np.mean(residual ** 2), w - 0.1 * 2 * X.T @ residual / len(X)
    u = np.sin(np.linspace(0, 2 * np.pi, 32, endpoint=False))
    for _ in range(20):
        u = u + 0.25 * (np.roll(u, 1) - 2 * u + np.roll(u, -1))
    return w, value, np.sum(u * u)


if PROCESS == 0:
    print(f"{WAY}: w = {np.round(np.asarray(w), 4).tolist()} loss = {float(value):.6f} "
          f"energy = {float(energy):.6f}", flush=True)
    ok = all(np.allclose(a, b, rtol=1e-4, atol=1e-5)
             for a, b in zip((w, value, energy), numpy_reference()))
    print(f"{WAY}: matches numpy: {ok}", flush=True)
    sys.exit(0 if ok else 1)

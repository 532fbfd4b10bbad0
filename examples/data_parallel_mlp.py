"""Data-parallel training: an MLP on synthetic data, gradients averaged with mpicoll.

Run with a number of ranks that divides 96, e.g.

    mpiexec -n 2 python examples/data_parallel_mlp.py      (or launch/mpirun.sh -n 2 ...)

Every rank holds the same parameters and its own shard of every batch.  Each
training step computes the gradient of the loss on the rank's shard and
averages it over ranks with mpicoll.allreduce, so every rank applies the same
update and the parameters stay identical without ever being sent.  A whole
epoch is one jax.jit-compiled lax.scan over its steps, collectives included.
Rank 0 prints the loss each epoch.

At the end the example checks itself: the loss went down, the parameters are
identical on every rank, and they match plain single-process training on the
whole batches (with equal shards, the mean of the ranks' mean gradients is the
gradient of the whole batch).
"""

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll

rank = MPI.COMM_WORLD.Get_rank()
size = MPI.COMM_WORLD.Get_size()

SAMPLES, FEATURES, HIDDEN = 960, 8, 32
GLOBAL_BATCH, EPOCHS, LEARNING_RATE = 96, 20, 0.05
if GLOBAL_BATCH % size:
    raise SystemExit(f"data_parallel_mlp: the rank count ({size}) must divide {GLOBAL_BATCH}")
LOCAL_BATCH = GLOBAL_BATCH // size


def make_data():
    """The whole synthetic data set: a smooth nonlinear target plus a little noise.

    Every rank builds the same array from the same seed; a real job would read
    only its shard from disk instead.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=(FEATURES,)).astype(np.float32)
    y = np.sin(x @ w / np.sqrt(FEATURES)) + 0.5 * np.tanh(x[:, 0] * x[:, 1])
    y += 0.05 * rng.normal(size=SAMPLES)
    return x, y[:, None].astype(np.float32)


def init_params(key):
    """The same key on every rank, so every rank starts from the same parameters."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros(1),
    }


def loss_fn(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    prediction = hidden @ params["w2"] + params["b2"]
    return jnp.mean((prediction - y) ** 2)


def train_step(params, x, y):
    """One SGD step on this rank's shard (x, y) of the global batch."""
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    # The data-parallel part: average the gradients (and, for printing, the
    # loss) over ranks.  Each allreduce is an MPI_Allreduce that XLA runs inside
    # the compiled epoch below.
    grads = jax.tree.map(lambda g: mpicoll.allreduce(g) / size, grads)
    loss = mpicoll.allreduce(loss) / size
    params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return params, loss


@jax.jit
def train_epoch(params, xs, ys):
    """Every step of an epoch in one compiled loop; xs, ys: (steps, LOCAL_BATCH, ...)."""
    params, losses = jax.lax.scan(lambda p, xy: train_step(p, *xy), params, (xs, ys))
    return params, jnp.mean(losses)


@jax.jit
def reference_epoch(params, xs, ys):
    """The same epoch in one process on whole batches: what data parallelism must reproduce."""
    def step(params, xy):
        grads = jax.grad(loss_fn)(params, *xy)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), None
    return jax.lax.scan(step, params, (xs, ys))[0]


def batches(epoch):
    """The global batches of an epoch: the same shuffle on every rank."""
    order = np.random.default_rng(1000 + epoch).permutation(SAMPLES)
    return order.reshape(-1, GLOBAL_BATCH)


x_all, y_all = make_data()
params = init_params(jax.random.key(42))
initial_params = params
losses = []
for epoch in range(EPOCHS):
    mine = batches(epoch)[:, rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]  # this rank's shards
    params, loss = train_epoch(params, x_all[mine], y_all[mine])
    losses.append(float(loss))
    if rank == 0:
        print(f"epoch {epoch + 1:2d}/{EPOCHS}  loss {losses[-1]:.5f}", flush=True)

# --- Checks ---------------------------------------------------------------------
# Identical parameters everywhere: compare every rank's with rank 0's (mpi4py,
# outside JAX, as any extra bookkeeping would be).
flat = np.concatenate([np.asarray(p).ravel() for p in jax.tree.leaves(params)])
identical = MPI.COMM_WORLD.allreduce(
    bool(np.array_equal(flat, MPI.COMM_WORLD.bcast(flat, root=0))), op=MPI.LAND)

ok = identical and losses[-1] < 0.5 * losses[0]
if rank == 0:
    reference = initial_params
    for epoch in range(EPOCHS):
        reference = reference_epoch(reference, x_all[batches(epoch)], y_all[batches(epoch)])
    difference = max(float(jnp.max(jnp.abs(a - b)))
                     for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)))
    # float32, and the ranks sum the batch in another order than one process.
    ok = ok and difference < 1e-4
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f} over {EPOCHS} epochs on {size} rank(s): "
          f"{'decreased' if losses[-1] < 0.5 * losses[0] else 'DID NOT HALVE'}\n"
          f"parameters identical on every rank: {identical}\n"
          f"max |difference| from single-process training: {difference:.2e}\n"
          f"data_parallel_mlp: {'ok' if ok else 'FAILED'}", flush=True)

raise SystemExit(0 if MPI.COMM_WORLD.bcast(ok, root=0) else 1)

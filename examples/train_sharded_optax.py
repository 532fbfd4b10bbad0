"""Data-parallel training in JAX's current style: sharded arrays, jit shardings, optax.

    mpiexec -n 2 python examples/train_sharded_optax.py                 # each rank its own mesh
    mpiexec -n 2 python examples/train_sharded_optax.py --way global    # one mesh over every rank
    mpiexec -n 2 python examples/train_sharded_optax.py --devices 2     # 2 CPU devices per rank

(or launch/mpirun.sh -n 2 python ...; the global batch of 96 must divide into
ranks x devices.)  Every rank holds the same parameters and optimizer state,
replicated (P()) over its devices, and its own share of every batch, sharded
(P("batch")).  Where the collective goes in an optax step depends on the mesh:

--way ranks (the default): the mesh holds this rank's devices (jax.make_mesh
    over jax.local_device_count()).  The jit's gradient is this rank's; XLA sums
    it over the rank's devices, and one mpicoll.allreduce of the gradient
    pytree, divided by the rank count, makes it the global batch's, BEFORE
    opt.update.  It must come before: clip_by_global_norm and Adam's moments
    are not linear in the gradient, so per-rank updates averaged afterwards are
    another optimizer, and ranks that updated from their own gradients would
    drift apart.

--way global: after mpicoll.distributed.initialize(), one mesh spans every
    device of every rank (jax.make_mesh over jax.device_count()) and the batch is
    one global array.  The loss is the mean over the whole batch, so the jit's
    gradient already is the global one: XLA's partitioner inserts the all-reduce
    itself (it runs on the job's MPI) and the step has no mpicoll call at all.

Either way opt.update sees the gradient of the whole global batch, so the
trained parameters equal one process training on whole batches.  The example
checks itself against that: rank 0 trains the same model with plain JAX and
optax on one device (no mpicoll, no mesh) and compares the parameters and
losses, and every rank's parameters are compared with rank 0's.  If flax is
installed, the same is done for a flax nnx model (nnx.split/merge around the
same jit step); if not, it says so and skips that part.  The last line is
"train_sharded_optax: OK" or "... FAILED" (and the exit code 0 or 1).
"""

import argparse
import contextlib
import os
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--way", choices=("ranks", "global"), default="ranks")
parser.add_argument("--devices", type=int, default=0,
                    help="fake CPU devices per process (default: what JAX finds)")
parser.add_argument("--epochs", type=int, default=20)
args = parser.parse_args()
if args.devices:  # before JAX starts: XLA's CPU client reads it once
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={args.devices}"])

if args.way == "global":
    import mpicoll.distributed
    mpicoll.distributed.initialize()  # before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

try:
    from flax import nnx
except ImportError:
    nnx = None

rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
devices = jax.local_device_count()
SAMPLES, FEATURES, HIDDEN, GLOBAL_BATCH = 960, 8, 32, 96
if GLOBAL_BATCH % (size * devices):
    raise SystemExit(f"train_sharded_optax: {size} rank(s) x {devices} device(s) "
                     f"must divide the batch of {GLOBAL_BATCH}")
LOCAL_BATCH = GLOBAL_BATCH // size
STEPS = args.epochs * SAMPLES // GLOBAL_BATCH
TOLERANCE = 1e-5  # float32; the ranks and devices sum the batch in another order

# --- The mesh and the shardings: the only part where the two ways differ --------
if args.way == "global":
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))  # every rank's devices
else:
    mesh = jax.make_mesh((devices,), ("batch",))  # this rank's devices
replicated = NamedSharding(mesh, P())
batch_sharded = NamedSharding(mesh, P("batch"))
# jax.set_mesh, where the installed jax has it, makes `mesh` the context of the steps
# (arrays made inside them default to it); the explicit shardings below need no context.
mesh_context = getattr(jax, "set_mesh", lambda mesh: contextlib.nullcontext())


def place_batch(x):
    """This rank's rows of a global batch, sharded over the mesh's "batch" axis."""
    mine = x[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH]
    if args.way == "global":  # a piece of one global array of GLOBAL_BATCH rows
        return jax.make_array_from_process_local_data(batch_sharded, mine)
    return jax.device_put(mine, batch_sharded)  # this rank's array of LOCAL_BATCH rows


def mean_over_ranks(tree):
    """The mean over ranks of a per-rank pytree: one allreduce of the whole tree."""
    if args.way == "global":
        return tree  # already global: the jit's loss is the mean over every rank's rows
    return jax.tree.map(lambda leaf: leaf / size, mpicoll.allreduce(tree))


# --- The data: every rank builds the same, and uses only its rows of each batch --
def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    w = rng.normal(size=FEATURES).astype(np.float32)
    y = np.sin(x @ w / np.sqrt(FEATURES)) + 0.5 * np.tanh(x[:, 0] * x[:, 1])
    return x, (y + 0.05 * rng.normal(size=SAMPLES))[:, None].astype(np.float32)


def batches():
    """The global batches of every epoch, the same shuffle on every rank."""
    for epoch in range(args.epochs):
        yield from np.random.default_rng(1000 + epoch).permutation(SAMPLES).reshape(
            -1, GLOBAL_BATCH)


x_all, y_all = make_data()
# Clipping by the global norm makes the point of where the allreduce goes: it and
# Adam are nonlinear in the gradient, so the gradient must be global before them.
optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


# --- optax on a dict of arrays -------------------------------------------------
def init_params(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
            "b2": jnp.zeros(1)}


def loss_fn(params, x, y):
    prediction = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
    return jnp.mean((prediction - y) ** 2)


def train_step(state, x, y):
    """One step on this rank's rows (x, y) of the global batch; state: (params, opt_state)."""
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # this rank's rows
    grads, loss = mean_over_ranks((grads, loss))             # the whole batch's: before update
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def sharded(step):
    """`step` jitted with the layouts: the state replicated, the batch sharded."""
    return jax.jit(step, in_shardings=(replicated, batch_sharded, batch_sharded),
                   out_shardings=(replicated, replicated), donate_argnums=0)


def train_optax():
    params = init_params(jax.random.key(42))
    return run(sharded(train_step), jax.device_put((params, optimizer.init(params)), replicated))


@jax.jit
def reference_step(state, x, y):
    """One process, one device, the whole batch: no mpicoll, no mesh."""
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def reference_optax():
    params = init_params(jax.random.key(42))
    state, losses = (params, optimizer.init(params)), []
    for rows in batches():
        state, loss = reference_step(state, x_all[rows], y_all[rows])
        losses.append(float(loss))
    return state, losses


# --- flax nnx, the same step (optional) -------------------------------------------
if nnx is not None:
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
            self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))

    def nnx_loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def new_model_and_optimizer():
        model = MLP(nnx.Rngs(42))  # the same seed on every rank: the same parameters
        return model, nnx.Optimizer(model, optimizer, wrt=nnx.Param)

    def make_nnx_step(graphdef):
        def nnx_step(state, x, y):
            model, opt = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(nnx_loss)(model, x, y)  # this rank's rows
            grads, loss = mean_over_ranks((grads, loss))             # before opt.update
            opt.update(model, grads)
            return nnx.state((model, opt)), loss
        return nnx_step

    def train_nnx():
        graphdef, state = nnx.split(new_model_and_optimizer())
        return run(sharded(make_nnx_step(graphdef)), jax.device_put(state, replicated))

    def reference_nnx():
        model, opt = new_model_and_optimizer()

        @nnx.jit
        def step(model, opt, x, y):
            loss, grads = nnx.value_and_grad(nnx_loss)(model, x, y)
            opt.update(model, grads)
            return loss

        losses = [float(step(model, opt, x_all[rows], y_all[rows])) for rows in batches()]
        return nnx.state((model, opt)), losses


# --- Training and the checks ------------------------------------------------------
def run(step, state):
    """Every step of every epoch; returns (the final state, the losses, steps per second)."""
    losses = []
    with mesh_context(mesh):
        for i, rows in enumerate(batches()):
            if i == 1:  # the first step compiles: time the rest
                jax.block_until_ready(state)
                start = time.perf_counter()
            state, loss = step(state, place_batch(x_all[rows]), place_batch(y_all[rows]))
            losses.append(loss)
        jax.block_until_ready(state)
    rate = (STEPS - 1) / (time.perf_counter() - start)
    return state, [float(loss) for loss in losses], rate


def check(name, trained, reference):
    """Rank 0's verdict line for one model; True if the run matches `reference`."""
    (state, losses, rate), (expected_state, expected_losses) = trained, reference
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]
    flat = np.concatenate([leaf.ravel().astype(np.float64) for leaf in leaves])
    identical = MPI.COMM_WORLD.allreduce(
        bool(np.array_equal(flat, MPI.COMM_WORLD.bcast(flat, root=0))), op=MPI.LAND)
    if rank != 0:
        return identical
    difference = max(float(np.max(np.abs(a - np.asarray(b)))) for a, b in
                     zip(leaves, jax.tree.leaves(expected_state)))
    loss_difference = float(np.max(np.abs(np.subtract(losses, expected_losses))))
    ok = (identical and difference < TOLERANCE and loss_difference < TOLERANCE
          and losses[-1] < 0.5 * losses[0])
    print(f"{name}: loss {losses[0]:.5f} -> {losses[-1]:.5f} over {STEPS} steps, "
          f"{rate:.1f} steps/s\n"
          f"{name}: parameters identical on every rank: {identical}\n"
          f"{name}: max |difference| from one-process training: {difference:.2e} "
          f"(parameters and optimizer state), {loss_difference:.2e} (losses); "
          f"tolerance {TOLERANCE:g}: {'ok' if ok else 'FAILED'}", flush=True)
    return ok


if rank == 0:
    where = ("mpicoll.allreduce of the gradients before opt.update" if args.way == "ranks"
             else "the sharded jit's own all-reduce, on the job's MPI")
    print(f"train_sharded_optax: {size} rank(s) x {devices} device(s), way {args.way} "
          f"({where}); jax {jax.__version__}, optax {optax.__version__}", flush=True)
ok = check("optax", train_optax(), reference_optax() if rank == 0 else (None, None))
if nnx is not None:
    ok = check("flax nnx", train_nnx(), reference_nnx() if rank == 0 else (None, None)) and ok
elif rank == 0:
    print("flax nnx: skipped (flax is not installed; pip install flax to run it too)")
ok = MPI.COMM_WORLD.bcast(ok, root=0)
if rank == 0:
    print(f"train_sharded_optax: {'OK' if ok else 'FAILED'}", flush=True)
raise SystemExit(0 if ok else 1)

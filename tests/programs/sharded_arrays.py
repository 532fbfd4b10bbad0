"""mpicoll's collectives on arrays laid out over several local devices.

    mpiexec -n P python sharded_arrays.py DEVICES

Each rank's logical array x_r is known to every rank (numpy, from r), so each
result is checked against numpy on the per-rank data: every collective, every
layout (a dimension sharded, another, replicated; with 4 devices a 2 x 2 mesh
with one axis replicated, and both axes), eagerly and inside jit, under
jax.set_mesh, with Auto axes, and under grad and vmap; the result's layout is
checked against the documented one; a data-parallel step, also with one rank
arriving late at each call.  Prints "SHARDED OK" on rank 0.
"""

import sys

from _common import fake_cpu_devices

DEVICES = int(sys.argv[1])
fake_cpu_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.mpi4jax  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
failures = []

if DEVICES == 2:
    MESH = jax.make_mesh((2,), ("d",))
    LAYOUTS = {"dim0": P("d"), "dim1": P(None, "d"), "replicated": P()}
else:
    MESH = jax.make_mesh((2, 2), ("a", "b"))
    LAYOUTS = {"a-dim0 (b replicated)": P("a"), "a-dim0 b-dim1": P("a", "b"),
               "ab-dim1": P(None, ("a", "b")), "replicated": P()}


def logical(r, shape):
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100.0 * r)


def put(array, spec):
    return jax.device_put(jnp.asarray(array), NamedSharding(MESH, spec))


def expect(what, got, want, spec=None):
    got_values = np.asarray(got)
    if got_values.shape != want.shape or not np.allclose(got_values, want):
        failures.append(f"{what}: got {got_values.ravel()[:6]} {got_values.shape}, expected "
                        f"{want.ravel()[:6]} {want.shape}")
        return
    if spec is not None:
        have = tuple(got.sharding.spec) + (None,) * (got.ndim - len(got.sharding.spec))
        if have != tuple(spec) + (None,) * (got.ndim - len(spec)):
            failures.append(f"{what}: result laid out as {got.sharding.spec}, expected {spec}")


def shifted(spec):
    return P(None, *spec)


SHAPE = (4, 8)
xs = [logical(r, SHAPE) for r in range(SIZE)]
stacked = np.stack(xs)
ROOT = SIZE - 1
zeros = np.zeros(SHAPE, np.float32)

# Collectives that keep the shape or add a ranks dimension: x of shape (4, 8).
SAME = {
    "allreduce": (lambda x: mpicoll.allreduce(x), stacked.sum(0), None),
    "allreduce max": (lambda x: mpicoll.allreduce(x, op="max"), stacked.max(0), None),
    "bcast": (lambda x: mpicoll.bcast(x, root=ROOT), xs[ROOT], None),
    "reduce": (lambda x: mpicoll.reduce(x, root=0), stacked.sum(0) if RANK == 0 else zeros,
               None),
    "scan": (lambda x: mpicoll.scan(x), stacked[:RANK + 1].sum(0), None),
    "exscan": (lambda x: mpicoll.exscan(x), stacked[:RANK].sum(0) if RANK else zeros, None),
    "allgather": (lambda x: mpicoll.allgather(x), stacked, "lead"),
    "gather": (lambda x: mpicoll.gather(x, root=0),
               stacked if RANK == 0 else np.zeros_like(stacked), "lead"),
    "sendrecv": (lambda x: mpicoll.sendrecv(x, source=(RANK - 1) % SIZE,
                                            dest=(RANK + 1) % SIZE),
                 xs[(RANK - 1) % SIZE], None),
    "mpi4jax allreduce": (lambda x: mpicoll.mpi4jax.allreduce(x, op=MPI.SUM), stacked.sum(0),
                          None),
}
# Collectives over a leading ranks dimension: x of shape (SIZE, 4, 8).
RSHAPE = (SIZE,) + SHAPE
rxs = [logical(r, RSHAPE) for r in range(SIZE)]
LEADING = {
    "alltoall": (lambda x: mpicoll.alltoall(x), np.stack([rxs[i][RANK] for i in range(SIZE)]),
                 "same"),
    "scatter": (lambda x: mpicoll.scatter(x, root=0), rxs[0][RANK], "drop"),
    "reduce_scatter": (lambda x: mpicoll.reduce_scatter(x),
                       np.sum([rxs[i][RANK] for i in range(SIZE)], axis=0), "drop"),
}


def result_spec(spec, how):
    if how == "lead":
        return shifted(spec)
    if how == "drop":
        return P(*tuple(spec)[1:])
    return spec


for layout, spec in LAYOUTS.items():
    for name, (call, want, how) in SAME.items():
        x = put(xs[RANK], spec)
        expect(f"{name} eager, {layout}", call(x), want, result_spec(spec, how))
        expect(f"{name} jit, {layout}", jax.jit(call)(x), want, result_spec(spec, how))
    rspec = shifted(spec)  # the ranks dimension whole on each device
    for name, (call, want, how) in LEADING.items():
        x = put(rxs[RANK], rspec)
        expect(f"{name} eager, {layout}", call(x), want, result_spec(rspec, how))
        expect(f"{name} jit, {layout}", jax.jit(call)(x), want, result_spec(rspec, how))

# The ranks dimension sharded: a clear error on every rank, before any MPI call.
first = next(iter(LAYOUTS.values()))
if SIZE % MESH.axis_sizes[0] == 0:  # else JAX itself cannot lay it out so
    for run in (mpicoll.alltoall, jax.jit(mpicoll.alltoall)):
        try:
            run(put(rxs[RANK], first))
            failures.append("alltoall with its ranks dimension sharded did not raise")
        except ValueError as error:
            if "first dimension is sharded" not in str(error):
                failures.append(f"alltoall with its ranks dimension sharded: {error}")

# v-forms: rank r gives r + 1 rows of 8, dimension 1 laid out over the devices.
counts = tuple(r + 1 for r in range(SIZE))
vxs = [logical(r, (r + 1, 8)) for r in range(SIZE)]
vspec = P(None, tuple(MESH.axis_names))
got = mpicoll.allgatherv(put(vxs[RANK], vspec), counts)
expect("allgatherv eager", got, np.concatenate(vxs), vspec)
got = jax.jit(lambda x: mpicoll.allgatherv(x, counts))(put(vxs[RANK], vspec))
expect("allgatherv jit", got, np.concatenate(vxs), vspec)

# Point-to-point: every rank sends its x to the next rank, which receives into a
# template laid out alike.
x = put(xs[RANK], first)
template = put(np.zeros(SHAPE, np.float32), first)
if SIZE == 2:
    if RANK == 0:
        mpicoll.send(x, dest=1, tag=7)
    else:
        expect("send/recv eager", mpicoll.recv(template, source=0, tag=7), xs[0], first)

# Pytrees: leaves of several layouts in one call.
tree = {"w": put(xs[RANK], first), "b": put(xs[RANK][0], P()), "one": jnp.float32(RANK)}
out = jax.jit(mpicoll.allreduce)(tree)
expect("tree w", out["w"], stacked.sum(0), first)
expect("tree b", out["b"], stacked[:, 0].sum(0))
expect("tree one", out["one"], np.float32(sum(range(SIZE))))

# A tree of many leaves over one mesh travels fused: each device's shards (a small
# replicated leaf whole) in one MPI message per dtype, eagerly and in jit.
specs = list(LAYOUTS.values())
many = [put(xs[RANK] + i, specs[i % len(specs)]) for i in range(12)]
many.append(put(np.arange(6, dtype=np.int32) * (RANK + 1), P()))
want_many = [stacked.sum(0) + SIZE * i for i in range(12)]
want_many.append(np.arange(6, dtype=np.int32) * sum(range(1, SIZE + 1)))
for how, fn in (("eager", mpicoll.allreduce), ("jit", jax.jit(mpicoll.allreduce))):
    for i, (got, want) in enumerate(zip(fn(many), want_many)):
        expect(f"many leaves {how} [{i}]", got, want, specs[i % len(specs)] if i < 12 else P())
lowered = jax.jit(mpicoll.allreduce).lower(many).as_text()
calls = lowered.count("custom_call @mpicoll_allreduce")
if calls != 2:  # one message of the float32 leaves, one of the int32 leaf
    failures.append(f"many leaves: {calls} MPI calls per device in the program, expected 2")
mpicoll.set_autodiff("convention")
grads = jax.jit(jax.grad(lambda t: sum(jnp.sum(leaf * (i + 1.0))
                                        for i, leaf in enumerate(mpicoll.allreduce(t)))))(many[:4])
for i, got in enumerate(grads):  # mpicoll's convention: the cotangent itself
    expect(f"grad of many leaves [{i}]", got, np.full(SHAPE, i + 1.0, np.float32),
           specs[i % len(specs)])
mpicoll.set_autodiff("checked")

# jit with in and out shardings; jnp work and mpicoll's calls mixed.
step = jax.jit(lambda x: jnp.tanh(mpicoll.allreduce(x * 2.0)) + 1.0,
               in_shardings=NamedSharding(MESH, first), out_shardings=NamedSharding(MESH, first))
expect("jit in/out shardings", step(jnp.asarray(xs[RANK])), np.tanh(2 * stacked.sum(0)) + 1,
       first)

# Under jax.set_mesh: an unplaced array in a jit runs on the mesh (replicated), a
# placed one keeps its layout, and eager calls of single-device arrays stay as they are.
with jax.set_mesh(MESH):
    expect("set_mesh jit, one device's array", jax.jit(mpicoll.allreduce)(jnp.asarray(xs[RANK])),
           stacked.sum(0))
    expect("set_mesh eager, one device's array", mpicoll.allreduce(jnp.asarray(xs[RANK])),
           stacked.sum(0))
    expect("set_mesh jit, placed", jax.jit(mpicoll.allgather)(put(xs[RANK], first)), stacked,
           shifted(first))
    expect("set_mesh barrier then allreduce",
           (mpicoll.barrier(), mpicoll.allreduce(jnp.float32(1)))[1], np.float32(SIZE))

# Auto axes: mpicoll cannot see XLA's layout when it traces, so the array is
# replicated first; the values are the same.
auto = jax.make_mesh(MESH.axis_sizes, MESH.axis_names,
                     axis_types=(AxisType.Auto,) * len(MESH.axis_names))
with jax.set_mesh(auto):
    x = jax.device_put(jnp.asarray(xs[RANK]), NamedSharding(auto, first))
    expect("auto axes jit", jax.jit(lambda x: mpicoll.allreduce(x) * 1.0)(x), stacked.sum(0))

# grad (mpicoll's convention for values outside shard_map: docs/autodiff.md) and vmap.
mpicoll.set_autodiff("convention")
weights = np.linspace(0.5, 1.5, np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
grad = jax.jit(jax.grad(lambda x: jnp.sum(mpicoll.allreduce(x) * weights)))(put(xs[RANK], first))
expect("grad of allreduce", grad, weights, first)  # mpicoll's convention: the cotangent itself
batched = jax.jit(jax.vmap(mpicoll.allreduce))(put(xs[RANK], first))
expect("vmap of allreduce", batched, stacked.sum(0))

# A data-parallel step as docs/sharded-arrays.md writes it: the batch split over the
# devices, the parameters replicated; XLA sums the gradient over the devices, mpicoll
# across the ranks.
mpicoll.set_autodiff("checked")
axes = tuple(MESH.axis_names)
B = 8 * DEVICES
rng = [np.random.default_rng(r) for r in range(SIZE)]
data = [(g.standard_normal((B, 8)).astype(np.float32), g.standard_normal(B).astype(np.float32))
        for g in rng]
w0 = np.linspace(-1, 1, 8, dtype=np.float32)


def local_grads(w, x, y):
    return jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)


def numpy_step(want):
    """The step on every rank's data, in float64: the reference."""
    grads = [2.0 / B * xr.T.astype(np.float64) @ (xr @ want - yr) for xr, yr in data]
    return want - 0.1 * np.mean(grads, axis=0)


@jax.jit
def step(w, x, y):
    return w - 0.1 * mpicoll.allreduce(local_grads(w, x, y)) / SIZE


x = jax.device_put(data[RANK][0], NamedSharding(MESH, P(axes)))
y = jax.device_put(data[RANK][1], NamedSharding(MESH, P(axes)))
w = jax.device_put(w0, NamedSharding(MESH, P()))
want = w0.astype(np.float64)
for _ in range(3):
    w, want = step(w, x, y), numpy_step(want)
expect("data-parallel step", w, want.astype(np.float32), P())


@jax.jit
def late_step(w, x, y, late_work):
    # The same step, with one rank arriving late at the allreduce (late_work matmuls
    # feed its gradient first): the others' devices cannot run the call at once and
    # hand the wait to their progress threads (docs/design.md, "Ranks x devices").
    m = jnp.full((192, 192), 1.0 / 192, jnp.float32)
    busy = jax.lax.fori_loop(0, late_work, lambda i, a: a @ m, m)
    return w - 0.1 * mpicoll.allreduce(local_grads(w, x, y) + 0.0 * busy[0, :8]) / SIZE


for late in range(2 * SIZE):
    w, want = late_step(w, x, y, 40 if late % SIZE == RANK else 0), numpy_step(want)
expect("data-parallel step with a late rank", w, want.astype(np.float32), P())

failures = MPI.COMM_WORLD.allgather(failures)
if RANK == 0:
    bad = [f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs]
    print("\n".join(bad) if bad else f"SHARDED OK ({SIZE} ranks x {DEVICES} devices)",
          flush=True)
sys.exit(1 if any(failures) else 0)

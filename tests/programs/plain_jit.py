"""Plain `jax.jit` on global arrays, as JAX users write it, after
mpicoll.distributed.initialize(): the collectives XLA's partitioner inserts
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) run on
the job's MPI through mpicoll's MPI ABI library, not on gloo.

    mpiexec -n R python plain_jit.py ORDER [EXPECTED_TRANSPORT [LOCAL_DEVICES]]

ORDER: "jax-first" imports jax before mpicoll, "mpicoll-first" the other way.
Each case is checked against numpy on the gathered data, and its compiled
program holds the XLA collective it is about; with transport "mpi" no listener
beyond MPI's own is opened but the coordination service's, on rank 0 alone
(gloo opens one per rank).  Prints "ALL OK (R ranks, TRANSPORT)".
"""

import sys

from _common import fake_cpu_devices, listeners, report_and_exit

ORDER = sys.argv[1]
EXPECTED = sys.argv[2] if len(sys.argv) > 2 else "mpi"
LOCAL = fake_cpu_devices(int(sys.argv[3]) if len(sys.argv) > 3 else 1)

if ORDER == "jax-first":
    import jax  # noqa: E402
    import jax.numpy as jnp  # noqa: E402
    from mpi4py import MPI  # noqa: E402
    MPIS_OWN = listeners()
    import mpicoll.distributed  # noqa: E402
else:
    from mpi4py import MPI  # noqa: E402
    MPIS_OWN = listeners()
    import mpicoll.distributed  # noqa: E402
    import jax  # noqa: E402
    import jax.numpy as jnp  # noqa: E402

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from mpicoll._src.over_ranks import jax_transport  # noqa: E402

mpicoll.distributed.initialize(initialization_timeout=60)
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
failures = []
transport, why = jax_transport.transport()
if transport != EXPECTED:
    failures.append(f"transport {transport} ({why}), not {EXPECTED}")

# Auto axes: XLA's partitioner places every collective (jax.make_mesh's default is
# Explicit, checked once below).
mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("x"))
columns = NamedSharding(mesh, P(None, "x"))
replicated = NamedSharding(mesh, P())
N = SIZE * LOCAL  # every sharded extent divisible by the device count
rng = np.random.default_rng(7)  # the same data on every rank: the global arrays
X = rng.standard_normal((8 * N, 2 * N)).astype(np.float32)
W = rng.standard_normal((8 * N, 4 * N)).astype(np.float32)
I32 = rng.integers(-1000, 1000, (8 * N, 3)).astype(np.int32)
SQUARE = rng.standard_normal((4 * N, 4 * N)).astype(np.float32)


def global_array(full, sharding):
    """The global array of `full` laid out by `sharding` (each process its part)."""
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def gathered(array):
    """The whole of a global array, on every rank (through JAX's own transport)."""
    whole = jax.jit(lambda a: a, out_shardings=replicated)(array)
    return np.asarray(whole.addressable_shards[0].data)


def case(name, function, arguments, expected, collective, out_shardings=None, rtol=1e-5):
    try:
        compiled = jax.jit(function, out_shardings=out_shardings).lower(*arguments).compile()
        hlo = compiled.as_text()
        if collective not in hlo:
            failures.append(f"{name}: no {collective} in the compiled program")
        got = gathered(compiled(*arguments))
        if not np.allclose(got, expected, rtol=rtol, atol=1e-5):
            failures.append(f"{name}: {got.ravel()[:6]} against numpy's {np.ravel(expected)[:6]}")
    except Exception as error:  # every case is tried; the report names it
        failures.append(f"{name}: {type(error).__name__}: {str(error)[:300]}")


x, w = global_array(X, rows), global_array(W, rows)
case("sum of a sharded array", jnp.sum, [x], X.sum(), "all-reduce")
case("mean over the sharded axis", lambda a: a.mean(0), [x], X.mean(0), "all-reduce")
case("gathered to every process", lambda a: a, [x], X, "all-gather", out_shardings=replicated)
case("a matmul over the sharded contraction", lambda a, b: a.T @ b, [x, w], X.T @ W,
     "all-reduce", rtol=1e-4)
# (XLA:CPU's partitioner makes this an all-reduce and a slice, not a reduce-scatter:
# the library's Reduce_scatter is called directly below.)
case("the contraction's result sharded", lambda a, b: a.T @ b, [x, w], X.T @ W,
     "all-reduce", out_shardings=rows, rtol=1e-4)
case("jnp.roll over the sharded axis", lambda a: jnp.roll(a, 3, axis=0), [x],
     np.roll(X, 3, axis=0), "collective-permute")
case("rows to columns (all-to-all)", lambda a: a, [global_array(SQUARE, rows)], SQUARE,
     "all-to-all", out_shardings=columns)
case("int32 max", jnp.max, [global_array(I32, rows)], I32.max(), "all-reduce")
case("float product", lambda a: jnp.prod(1 + a / 100), [x], np.prod(1 + X / 100), "all-reduce")
# bf16 moves and reduces; f16 XLA's MPI path refuses (docs/jax-vocabulary.md), gloo does not.
B16 = X.astype(jnp.bfloat16)
case("bfloat16 gathered", lambda a: a, [global_array(B16, rows)], B16.astype(np.float32),
     "all-gather", out_shardings=replicated)
try:
    jax.jit(lambda a: a, out_shardings=replicated)(
        global_array(X.astype(np.float16), rows)).block_until_ready()
    if EXPECTED == "mpi":
        failures.append("float16 gathered: XLA's MPI path took it (update the docs)")
except Exception as error:
    if EXPECTED != "mpi" or "Unsupported primitive type for reduction: f16" not in str(error):
        failures.append(f"float16 gathered: {type(error).__name__}: {str(error)[:200]}")
explicit = jax.make_mesh((jax.device_count(),), ("x",),
                         axis_types=(jax.sharding.AxisType.Explicit,))
with jax.set_mesh(explicit):
    case("explicit sharding: a column sum", lambda a: a.sum(0),
         [global_array(X, NamedSharding(explicit, P("x")))], X.sum(0), "all-reduce")

# Groups of devices that are not the whole mesh: a 2-D mesh over the devices in
# order, so one axis's groups span processes and the other's (with several
# devices per process) mix a process's own devices with another's.
if N % 2 == 0 and N >= 4:
    grid_mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, N // 2), ("a", "b"),
                                  axis_types=(jax.sharding.AxisType.Auto,) * 2)
    grid = NamedSharding(grid_mesh, P("a", "b"))
    GRID = rng.standard_normal((4, 2 * N)).astype(np.float32)
    g = global_array(GRID, grid)
    case("sum over the first mesh axis", lambda a: a.sum(0), [g], GRID.sum(0), "all-reduce")
    case("sum over the second mesh axis", lambda a: a.sum(1), [g], GRID.sum(1), "all-reduce")
    case("gathered along the second axis", lambda a: a, [g], GRID, "all-gather",
         out_shardings=NamedSharding(grid_mesh, P("a", None)))
    case("jnp.roll along the second axis", lambda a: jnp.roll(a, 1, axis=1), [g],
         np.roll(GRID, 1, axis=1), "collective-permute")
    SQUARE2 = rng.standard_normal((N, N)).astype(np.float32)
    case("all-to-all within the second axis", lambda a: a,
         [global_array(SQUARE2, NamedSharding(grid_mesh, P("b", None)))], SQUARE2,
         "all-to-all", out_shardings=NamedSharding(grid_mesh, P(None, "b")))


# A data-parallel step as users write it: the batch sharded, the parameters
# replicated, jit's shardings; its gradient against numpy's.
def loss(params, batch, target):
    return jnp.mean((batch @ params - target) ** 2)


@jax.jit
def step(params, batch, target):
    value, grad = jax.value_and_grad(loss)(params, batch, target)
    return params - 0.1 * grad, value


P0 = rng.standard_normal((2 * N, 1)).astype(np.float32)
Y = rng.standard_normal((8 * N, 1)).astype(np.float32)
params = global_array(P0, replicated)
want = P0.copy()
for i in range(5):
    params, value = step(params, x, global_array(Y, rows))
    residual = X @ want - Y
    want = want - 0.1 * (2.0 / residual.size) * (X.T @ residual)
if not np.allclose(gathered(params), want, rtol=1e-4, atol=1e-5):
    failures.append(f"training step: {gathered(params).ravel()[:4]} against {want.ravel()[:4]}")
if "all-reduce" not in step.lower(params, x, global_array(Y, rows)).compile().as_text():
    failures.append("training step: no all-reduce in the compiled step")



def reduce_scatter_through_the_library():
    """MPI_Reduce_scatter as XLA calls it (the library's symbols, its constants'
    tokens), on the communicator XLA gets: each rank its block of the sum."""
    import ctypes

    import _mpicoll_jax_mpi

    library = ctypes.CDLL(_mpicoll_jax_mpi.library_path())
    token = {name: ctypes.c_uint64.in_dll(library, f"MPIABI_{name}").value
             for name in ("COMM_WORLD", "FLOAT", "SUM")}
    send = (np.arange(4 * SIZE, dtype=np.float32) + 10 * RANK).copy()
    receive = np.zeros(4, np.float32)
    counts = (ctypes.c_int * SIZE)(*([4] * SIZE))
    function = library.MPIABI_Reduce_scatter
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                         ctypes.c_uint64, ctypes.c_uint64]
    rc = function(send.ctypes.data, receive.ctypes.data, counts, token["FLOAT"], token["SUM"],
                  token["COMM_WORLD"])
    everyone = sum(np.arange(4 * SIZE, dtype=np.float32) + 10 * r for r in range(SIZE))
    if rc != 0 or not np.array_equal(receive, everyone[4 * RANK:4 * RANK + 4]):
        failures.append(f"MPI_Reduce_scatter through the library: rc {rc}, {receive}")


if EXPECTED == "mpi":
    reduce_scatter_through_the_library()

# What the job listens on beyond MPI's own: the coordination service (rank 0).
opened = sorted(set(listeners()) - set(MPIS_OWN))
if EXPECTED == "mpi" and len(opened) != (1 if RANK == 0 else 0):
    failures.append(f"listeners beyond MPI's own and the coordination service: {opened}")

report_and_exit(failures, f"({SIZE} ranks" + (f" x {LOCAL} devices" if LOCAL > 1 else "")
                + f", {transport})")

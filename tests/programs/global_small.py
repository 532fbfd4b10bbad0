"""The global allreduce below and above LOCAL_COMBINE_BYTES, run as
`mpiexec -n R python global_small.py L [scenario]`.

Every rank fakes L CPU devices.  Participant p = rank * L + k holds its own
data; the reference is numpy over every participant's input, gathered from the
ranks with mpi4py.  Below the threshold the program must contain mpicoll's
one MPI call in the meeting (csrc/meeting/meeting.cc), above it split over the devices; results,
output types (check_vma), vmap and gradients must match the lax composition
(LOCAL_COMBINE_BYTES = 0 while tracing).  Prints "ALL OK" when every check
passes.

scenario "stray": device 0 alone calls the combine for L = 2 devices (a program
outside pmap), so it waits for a device that never comes; MPICOLL_TIMEOUT must
end the job.
"""

import sys

from _common import Checker, fake_cpu_devices, report_and_exit

LOCAL = int(sys.argv[1])
SCENARIO = sys.argv[2] if len(sys.argv) > 2 else "check"
fake_cpu_devices(LOCAL)

from mpi4py import MPI  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import mpicoll  # noqa: E402
from mpicoll._src.ops import ranks_devices  # noqa: E402
from mpicoll._src.runtime import settings  # noqa: E402
from mpicoll._src.ops import local_meeting  # noqa: E402

jax.config.update("jax_enable_x64", True)
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
DEVICES = jax.local_devices()[:LOCAL]
MESH = Mesh(np.array(DEVICES), ("i",))
THRESHOLD = int(ranks_devices.local_combine_bytes(LOCAL))
failures = []
check = Checker(failures, rtol=1e-6, atol=1e-6)

if SCENARIO == "stray":
    mpicoll.allreduce(np.ones(1))  # the communicator is set up (collectively) first
    stray = jax.jit(lambda v: local_meeting.meet(
        v, "allreduce", mpicoll._src.runtime.comm.resolve(None, "test"), 2, axis_name="i"))
    stray(np.ones(3)).block_until_ready()
    print("stray call returned", flush=True)
    sys.exit(1)


def fail(name, message):
    failures.append(f"{name}: {message}")


def my_data(count, dtype, seed):
    """This rank's (L, count) inputs, one row per local device."""
    rng = np.random.default_rng(1000 * seed + RANK)
    if dtype == np.bool_:
        return rng.random((LOCAL, count)) < 0.7
    if np.issubdtype(dtype, np.integer):
        return rng.integers(1, 1 << 12, (LOCAL, count)).astype(dtype)
    # prod stays near 1 and sums are exact enough in low precision
    return (1 + rng.integers(-4, 5, (LOCAL, count)) / 64).astype(dtype)


NUMPY = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
         "land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def reference(mine, op):
    """numpy over every participant's input, gathered from every rank."""
    everyone = np.concatenate(COMM.allgather(mine))  # (SIZE * L, count)
    result = NUMPY[op].reduce(everyone.astype(np.float64) if everyone.dtype.kind == "f"
                              else everyone, axis=0)
    return np.broadcast_to(result, mine.shape)


def pmapped(fn):
    return jax.pmap(fn, axis_name="i", devices=DEVICES)


def shard_mapped(fn, check_vma):
    return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=MESH, in_specs=P("i"),
                                 out_specs=P("i"), check_vma=check_vma))


def composed(trace):
    """trace() with the lax composition (the GPU path) at every size."""
    with ranks_devices.composed_on_cpu():
        return trace()


def uses_combine(fn, *args):
    """Whether the program's allreduce is the meeting's with one MPI call per
    process (not split over the devices' communicators)."""
    program = str(jax.make_jaxpr(fn)(*args))
    assert "mpicoll_local_meeting" in program, program  # every size meets on CPU
    return "split=False" in program


# Small (a few elements, 4 KiB) and large (above the threshold, and above the
# split of the composition) per device, every op with a dtype it takes.
SIZES = {"2 elements": 2, "4 KiB": 1024, "above threshold": 2 * THRESHOLD // 4 + 5}
CASES = [("sum", np.float32), ("sum", np.float64), ("sum", np.int32), ("sum", np.float16),
         ("prod", np.float64), ("min", np.float32), ("max", np.int64), ("land", np.bool_),
         ("lor", np.int32), ("lxor", np.bool_), ("band", np.int32), ("bor", np.uint8),
         ("bxor", np.int64)]
for size_name, count in SIZES.items():
    for seed, (op, dtype) in enumerate(CASES):
        name = f"{op} {np.dtype(dtype).name} {size_name}"
        mine = my_data(count, dtype, seed)
        want = reference(mine, op)
        rtol = 1e-2 if dtype == np.float16 else 1e-6
        fn = lambda v, op=op: mpicoll.allreduce(v, op, axis_name="i")  # noqa: E731
        small = mine.nbytes // LOCAL <= THRESHOLD
        if uses_combine(pmapped(fn), mine) != (small and LOCAL > 1):
            fail(name, f"local combine in the program: {not small}, expected {small}")
        got = pmapped(fn)(mine)
        if got.dtype != mine.dtype:
            fail(name, f"dtype {got.dtype}, expected {mine.dtype}")
        check(f"pmap {name}", got, want, rtol)
        check(f"shard_map {name}", shard_mapped(fn, False)(mine), want, rtol)
        check(f"shard_map check_vma {name}", shard_mapped(fn, True)(mine), want, rtol)
        if count <= 1024 and op in ("sum", "max", "band"):
            batch = np.stack([mine, mine[:, ::-1]], axis=1)  # (L, 2, count)
            check(f"pmap vmap {name}", pmapped(jax.vmap(fn))(batch),
                  np.stack([want, reference(mine[:, ::-1], op)], axis=1), rtol)

# The composition (the GPU path, traced here on CPU) splits its MPI work
# over the devices above split_allreduce_bytes(L), which falls as 1 / (L - 1).
if LOCAL > 1:
    edge = int(ranks_devices.split_allreduce_bytes(LOCAL)) // 4  # float32 elements
    for count, splits in ((edge - 1, False), (edge + 3, True)):
        mine = my_data(count, np.float32, 90)
        fn = lambda v: mpicoll.allreduce(v, axis_name="i")  # noqa: E731
        program = composed(lambda: str(jax.make_jaxpr(pmapped(fn))(mine)))
        if ("reduce_scatter" in program) != splits:
            fail(f"split at {count} elements", f"psum_scatter in the program: {not splits}")
        check(f"composition {count} elements", composed(lambda: pmapped(fn)(mine)),
              reference(mine, "sum"))

# Typed outputs (check_vma): the same type as the composition's, sum and max.
for op in ("sum", "max"):
    seen = []

    def probe(v, op=op):  # a new function per trace: nothing is cached between them
        seen.append(jax.typeof(mpicoll.allreduce(v[0], op, axis_name="i")))
        return v

    for trace in (lambda: jax.eval_shape(jax.shard_map(probe, mesh=MESH, in_specs=P("i"),
                                                       out_specs=P("i")), np.ones((LOCAL, 3))),
                  lambda: composed(lambda: jax.eval_shape(jax.shard_map(
                      lambda v: probe(v), mesh=MESH, in_specs=P("i"), out_specs=P("i")),
                      np.ones((LOCAL, 3))))):
        trace()
    if len(seen) != 2 or seen[0] != seen[1]:
        fail(f"check_vma type {op}", f"combine {seen[:1]}, composition {seen[1:]}")

# Gradients: the same as the composition's, in pmap and shard_map (check_vma).
mpicoll.set_autodiff("convention")
G = my_data(6, np.float64, 50)
W = my_data(6, np.float64, 51)
for op in ("sum", "max", "prod"):
    def objective(v, w, op=op):
        return jnp.sum(jnp.sin(mpicoll.allreduce(v * w, op, axis_name="i")) * w)
    grad = pmapped(jax.grad(objective))
    check(f"pmap grad {op}", grad(G, W), composed(lambda: pmapped(jax.grad(objective))(G, W)),
          1e-12)
    jvp = pmapped(lambda v, t, op=op: jax.jvp(lambda u: mpicoll.allreduce(u, op, axis_name="i"),
                                              (v,), (t,))[1])
    check(f"pmap jvp {op}", jvp(G, W), composed(lambda: pmapped(
        lambda v, t: jax.jvp(lambda u: mpicoll.allreduce(u, op, axis_name="i"), (v,), (t,))[1])(
            G, W)), 1e-12)
shard_grad = jax.jit(jax.shard_map(
    jax.grad(lambda v, w: jnp.sum(jnp.sin(mpicoll.pvary(mpicoll.allreduce(v[0], axis_name="i")))
                                  * w[0])),
    mesh=MESH, in_specs=(P("i"), P("i")), out_specs=P("i")))
check("shard_map grad sum", shard_grad(G, W), composed(lambda: jax.jit(jax.shard_map(
    jax.grad(lambda v, w: jnp.sum(jnp.sin(mpicoll.pvary(mpicoll.allreduce(v[0], axis_name="i")))
                                  * w[0])),
    mesh=MESH, in_specs=(P("i"), P("i")), out_specs=P("i")))(G, W)), 1e-12)

# Inside mpicoll.overlap() the meeting runs too: it is asynchronous itself (on
# the devices' progress threads), so XLA computes meanwhile.
with mpicoll.overlap():
    overlapped = shard_mapped(lambda v: mpicoll.allreduce(v, axis_name="i"), False)
    X = my_data(8, np.float32, 70)
    if not uses_combine(overlapped, X):
        fail("overlap", "the meeting was not used inside mpicoll.overlap()")
    check("overlap sum", overlapped(X), reference(X, "sum"))

# Successive calls never mix (the generation counter): a loop of dependent
# calls, and two independent ones per step.
loop = pmapped(lambda v: jax.lax.fori_loop(
    0, 200, lambda i, u: (mpicoll.allreduce(u, axis_name="i") / (SIZE * LOCAL)
                          + mpicoll.allreduce(u * 0 + i, "max", axis_name="i") * 0), v))
X = my_data(16, np.float64, 60)
check("200 dependent calls", loop(X), reference(X, "sum") / (SIZE * LOCAL))

# Check mode sees the call: a rank running a different global allreduce gets
# the mismatch error instead of a hang (by default a new call site is compared
# the first time it runs).
if SIZE > 1:
    count = 4 if RANK == 0 else 5
    try:
        jax.block_until_ready(pmapped(lambda v: mpicoll.allreduce(v, axis_name="i"))(
            np.ones((LOCAL, count))))
        jax.effects_barrier()
        fail("check mode", "different shapes on the ranks ran without an error")
    except Exception as error:  # noqa: BLE001  (JaxRuntimeError)
        if "ranks called different collectives" not in str(error):
            fail("check mode", f"unexpected error: {error}")
    mpicoll.clear_error()

report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices)")

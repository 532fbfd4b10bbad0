"""jax.lax collectives over mpicoll.RANKS, run as `mpiexec -n R python lax_over_ranks.py L`.

Every body is written once in JAX's vocabulary with its axes as parameters and
run two ways: inside shard_map over mpicoll.mesh("dev") on this rank's L
devices, with the axes (RANKS,), (RANKS, "dev") and ("dev", RANKS); and in one
process over a mesh ("r", "dev") of R x L fake devices with the same axes
named ("r",), ("r", "dev"), ("dev", "r") -- JAX's own collectives, the
reference.  Participant p = rank * L + k holds DATA[p].  Values, the vjp with
every participant's cotangent, the body under vmap, and check_vma's types
(out_specs P() for an invariant result) are compared.  Prints "ALL OK".
"""

import sys

from _common import fake_cpu_devices, report_and_exit

LOCAL = int(sys.argv[1])
from mpi4py import MPI  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
N = SIZE * LOCAL
fake_cpu_devices(N)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import mpicoll  # noqa: E402
from lax_cases import CASES, attempt, blocks, check, failures, varying_axes  # noqa: E402

jax.config.update("jax_enable_x64", True)
R = mpicoll.RANKS
MESH = mpicoll.mesh("dev", devices=jax.devices()[:LOCAL])
REFERENCE_MESH = Mesh(np.array(jax.devices()).reshape(SIZE, LOCAL), ("r", "dev"))
MINE = slice(RANK * LOCAL, (RANK + 1) * LOCAL)
LAYOUTS = [(R,), (R, "dev"), ("dev", R)]

def data(shape, seed):
    return np.random.default_rng(seed).normal(size=(N, *shape))


def as_reference(axes):
    """The same axes named as the one-process mesh names them."""
    return tuple("r" if a == R else a for a in axes)


def rows(x):
    """(participants, *block) -> the array shard_map cuts into those blocks."""
    return jnp.asarray(x.reshape((-1, *x.shape[2:])))


def mine(global_array):
    """This rank's participants' blocks of a global (participants * block) array."""
    return np.concatenate(np.split(np.asarray(global_array), N)[MINE])


def _types_compared(ours, theirs, everyone, types, what):
    """Traces both programs: their results vary over the same axes (JAX's replication
    typing holds across ranks: a pmax over every axis is invariant, an all_gather not)."""
    ours.trace(rows(everyone[MINE]))
    theirs.trace(rows(everyone))
    if types["ours"] != types["theirs"]:
        failures.append(f"{what}: typed varying over {sorted(types['ours'])}, "
                        f"JAX's over {sorted(types['theirs'])}")
        return False
    return True


def run_case(name, body, shape, axes, vmapped):
    everyone = data(blocks(shape, N), sum(map(ord, name)))
    if vmapped:  # the body under vmap, over a leading batch of 2 inside each block
        everyone = np.stack([everyone, everyone * 2 + 1], axis=1)
        inner = body
        body = lambda x, a, n: jax.vmap(lambda row: inner(row, a, n))(x)  # noqa: E731
    count = N if "dev" in axes else SIZE
    reference_axes = as_reference(axes)
    types = {}  # check_vma's type of each body's result: the axes it varies over

    def typed(key, axes):
        def run(x):
            y = body(x, axes, count)
            types[key] = set(as_reference(varying_axes(jax.typeof(y))))
            return y
        return run

    ours = jax.jit(jax.shard_map(typed("ours", axes), mesh=MESH,
                                 in_specs=P((R, "dev")), out_specs=P((R, "dev"))))
    theirs = jax.jit(jax.shard_map(typed("theirs", reference_axes),
                                   mesh=REFERENCE_MESH, in_specs=P(("r", "dev")),
                                   out_specs=P(("r", "dev"))))
    what = f"{name} over {axes}{' under vmap' if vmapped else ''}"
    if not _types_compared(ours, theirs, everyone, types, what):
        return
    # JAX's own pmax, pmin and untiled all_to_all have no vjp to compare with (none; a
    # cotangent type error)
    compared_with_jax(what, ours, theirs, everyone, 7,
                      with_vjp=not name.startswith(("pmax", "pmin", "all_to_all untiled")))


def compared_with_jax(what, ours, theirs, everyone, seed, with_vjp=True):
    """Our program's values on this rank's blocks against JAX's one-process program on
    every block, and with_vjp their pullbacks of the same cotangents (data(seed))."""
    if not with_vjp:
        check(what, ours(rows(everyone[MINE])), mine(theirs(rows(everyone))))
        return
    expected, reference_pullback = jax.vjp(theirs, rows(everyone))
    got, pullback = jax.vjp(ours, rows(everyone[MINE]))
    check(what, got, mine(expected))
    cotangents = data((expected.shape[0] // N, *expected.shape[1:]), seed)
    check(what + ": vjp", pullback(rows(cotangents[MINE]))[0],
          mine(reference_pullback(rows(cotangents))[0]))


for name, (body, case_shape) in CASES.items():
    for axes in LAYOUTS:
        for vmapped in (False, True):
            if axes[0] == "dev" and ("ppermute" in name or "mix" in name):
                continue  # JAX wants ppermute's axes in the mesh's order (test_lax_over_ranks)
            attempt(f"{name} over {axes} vmapped={vmapped}",
                    lambda: run_case(name, body, case_shape, axes, vmapped))


def invariant_results():
    # check_vma: a reduction over every axis is the same on every participant:
    # out_specs P(), whatever the dtype (the small ones combine in mpicoll's handler).
    everyone = data((3,), 11) * 10
    for reduce, numpy_reduce in ((lax.psum, np.sum), (lax.pmax, np.max), (lax.pmin, np.min)):
        for dtype in (np.float64, np.int32):
            ours = jax.jit(jax.shard_map(lambda x: reduce(x.astype(dtype), (R, "dev")),
                                         mesh=MESH, in_specs=P((R, "dev")), out_specs=P()))
            check(f"{reduce.__name__} over (RANKS, dev) of {dtype.__name__} typed invariant",
                  ours(rows(everyone[MINE])), numpy_reduce(everyone.astype(dtype), axis=0))


def pbroadcast_against_numpy():
    # JAX has no CPU lowering of its own pbroadcast: numpy's.  The source is the last
    # participant in the axes' order; the vjp sums every cotangent there.
    everyone, cotangents = data((2, 3), 13), data((2, 3), 14)
    for axes in LAYOUTS[1:]:
        spec = P((R, "dev"))  # block p = rank * L + k
        program = jax.jit(jax.shard_map(lambda x: lax.pbroadcast(x, axes, N - 1), mesh=MESH,
                                        in_specs=spec, out_specs=spec))
        # participant N - 1 in the axes' order, as block rank * L + k
        source = N - 1 if axes[0] == R else (N - 1) % SIZE * LOCAL + (N - 1) // SIZE
        got, pullback = jax.vjp(program, rows(everyone[MINE]))
        check(f"pbroadcast over {axes}", got, np.concatenate([everyone[source]] * LOCAL))
        grad = np.zeros_like(cotangents)
        grad[source] = cotangents.sum(0)
        check(f"pbroadcast over {axes}: vjp", pullback(rows(cotangents[MINE]))[0],
              np.concatenate(grad[MINE]))


def groups_against_jax():
    # axis_index_groups over the ranks: JAX's own over the one-process mesh's "r" is
    # the reference (values and vjp; check_vma off, as JAX runs psum in groups only so).
    # Rows of all_gather follow each group's order.
    cases = [[list(range(SIZE))[::-1]], [[r] for r in range(SIZE)]]
    if SIZE % 2 == 0:
        cases.append([[r, SIZE - 1 - r] for r in range(SIZE // 2)])
    everyone = data((2, 3), 15)
    for groups in cases:
        for name, body in [
                ("psum", lambda x, a: lax.psum(x, a, axis_index_groups=groups)),
                ("pmean", lambda x, a: lax.pmean(x, a, axis_index_groups=groups)),
                ("pmax", lambda x, a: lax.pmax(x, a, axis_index_groups=groups)),
                ("pmin", lambda x, a: lax.pmin(x, a, axis_index_groups=groups)),
                ("all_gather", lambda x, a: lax.all_gather(x, a, axis_index_groups=groups)
                 .reshape(-1, 3))]:
            what = f"{name} in groups {groups}"
            ours = jax.jit(jax.shard_map(lambda x: body(x, R), mesh=MESH, in_specs=P((R, "dev")),
                                         out_specs=P((R, "dev")), check_vma=False))
            theirs = jax.jit(jax.shard_map(lambda x: body(x, "r"), mesh=REFERENCE_MESH,
                                           in_specs=P(("r", "dev")), out_specs=P(("r", "dev")),
                                           check_vma=False))
            compared_with_jax(what, ours, theirs, everyone, 16,
                              with_vjp=name not in ("pmax", "pmin"))  # JAX has no vjp of those
    if LOCAL == 1:
        return
    # Over ranks x devices (participant p = rank * L + k): one group in reverse, the
    # same device of every rank, and each process's own devices.
    for groups in ([list(range(N))[::-1]],
                   [[r * LOCAL + k for r in range(SIZE)] for k in range(LOCAL)],
                   [[r * LOCAL + k for k in range(LOCAL)][::-1] for r in range(SIZE)]):
        for name, body in [
                ("psum", lambda x, a: lax.psum(x, a, axis_index_groups=groups)),
                ("pmax", lambda x, a: lax.pmax(x, a, axis_index_groups=groups)),
                ("all_gather", lambda x, a: lax.all_gather(x, a, axis_index_groups=groups)
                 .reshape(-1, 3))]:
            what = f"{name} over ranks x devices in groups {groups}"
            ours = jax.jit(jax.shard_map(lambda x: body(x, (R, "dev")), mesh=MESH,
                                         in_specs=P((R, "dev")), out_specs=P((R, "dev")),
                                         check_vma=False))
            theirs = jax.jit(jax.shard_map(lambda x: body(x, ("r", "dev")), mesh=REFERENCE_MESH,
                                           in_specs=P(("r", "dev")), out_specs=P(("r", "dev")),
                                           check_vma=False))
            compared_with_jax(what, ours, theirs, everyone, 16, with_vjp=name == "psum")


attempt("invariant reductions", invariant_results)
attempt("axis_index_groups", groups_against_jax)
if LOCAL > 1:
    attempt("pbroadcast over ranks and devices", pbroadcast_against_numpy)
report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices)")

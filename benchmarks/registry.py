"""The implementations benchmarks/bench.py compares, each a setup that returns what timing.py measures.

A setup(ctx, op, count) returns (once, run, timed) for one collective at one
count (see benchmarks/timing.py), or raises timing.Unavailable with the reason.
IMPLEMENTATIONS is the one table of them, in the order of the report's columns:
a new library is a setup function and a row there; a new collective is an entry
in cases.py (OPS, expected output), in the per-library tables below
(mpi4py_call, mpicoll_ops, mpi4jax_ops), in mpi_floor.c and in report.OP_TITLES.

jax-gloo, JAX's own multi-process runtime, cannot share a process with MPI: it
runs in child processes (gloo_worker), for GLOO_OPS only.
"""

import functools
import json
import sys
from pathlib import Path

import numpy as np

import jax_gloo
from cases import (PYTREE_LEAF_BYTES, PYTREE_LEAVES, block_count, expected, feed,
                   floor_buffers, make_input, pytree_inputs)
from timing import Timer, Unavailable

IN_PLACE = {"mpicoll": ("bcast", "reduce", "allreduce")}  # output aliases the input
GLOO_OPS = ("allreduce", "allgather", "alltoall")  # what JAX has natively across processes


class Context:
    """What the setups share: rank, size, comm, pycomm, floor, jax_ops, mpi4jax_reason."""


# ---------------------------------------------------------------------------
# Per library: op name -> the call


def mpicoll_ops():
    """op name -> function of one jax array."""
    import mpicoll
    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    return {"bcast": mpicoll.bcast, "scatter": mpicoll.scatter, "reduce": mpicoll.reduce,
            "allreduce": mpicoll.allreduce, "gather": mpicoll.gather,
            "allgather": mpicoll.allgather, "alltoall": mpicoll.alltoall,
            "sendrecv": lambda x: mpicoll.sendrecv(x, left, right),
            "reduce_scatter": mpicoll.reduce_scatter,
            "allreduce_rs_ag": lambda x: mpicoll.allgather(mpicoll.reduce_scatter(x))}


def mpi4jax_ops(comm):
    """op name -> function of one jax array, for the collectives mpi4jax has."""
    import mpi4jax
    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    return {"sendrecv": lambda x: mpi4jax.sendrecv(x, x, left, right, comm=comm),
            "bcast": lambda x: mpi4jax.bcast(x, 0, comm=comm),
            "scatter": lambda x: mpi4jax.scatter(x, 0, comm=comm),
            "reduce": lambda x: mpi4jax.reduce(x, MPI.SUM, 0, comm=comm),
            "allreduce": lambda x: mpi4jax.allreduce(x, MPI.SUM, comm=comm),
            "gather": lambda x: mpi4jax.gather(x, 0, comm=comm),
            "allgather": lambda x: mpi4jax.allgather(x, comm=comm),
            "alltoall": lambda x: mpi4jax.alltoall(x, comm=comm)}


def jax_ops(library, comm=None):
    """op name -> function of one jax array, for mpicoll or mpi4jax (which lacks some)."""
    return mpicoll_ops() if library == "mpicoll" else mpi4jax_ops(comm)


def jax_input(library, op, rank, size, count, salt=0):
    x = make_input(op, rank, size, count, salt)
    if library == "mpi4jax" and op == "scatter" and rank != 0:
        x = x[0]  # mpi4jax: only the root passes (size, n)
    return x


def mpi4py_call(op, comm, x, out):
    """mpi4py's buffer method for op on (x, out), as a function of no arguments."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    root = rank == 0

    def reduce_scatter_allgather():
        comm.Reduce_scatter_block(x, out[rank], MPI.SUM)
        comm.Allgather(MPI.IN_PLACE, out)

    calls = {
        "bcast": lambda: functools.partial(comm.Bcast, out, 0),
        "scatter": lambda: functools.partial(comm.Scatter, x if root else None, out, 0),
        "reduce": lambda: functools.partial(comm.Reduce, x, out if root else None, MPI.SUM, 0),
        "allreduce": lambda: functools.partial(comm.Allreduce, x, out, MPI.SUM),
        "gather": lambda: functools.partial(comm.Gather, x, out if root else None, 0),
        "allgather": lambda: functools.partial(comm.Allgather, x, out),
        "alltoall": lambda: functools.partial(comm.Alltoall, x, out),
        "sendrecv": lambda: functools.partial(comm.Sendrecv, x, (rank + 1) % size, 0, out,
                                              (rank - 1) % size, 0),
        "reduce_scatter": lambda: functools.partial(comm.Reduce_scatter_block, x, out, MPI.SUM),
        "allreduce_rs_ag": lambda: reduce_scatter_allgather}
    return calls[op]()


def import_mpi4jax():
    """(True, version) or (False, why not)."""
    try:
        import mpi4jax
        return True, mpi4jax.__version__
    except Exception as error:  # ImportError, or mpi4jax's own checks (RuntimeError)
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
        if isinstance(error, ModuleNotFoundError) and error.name == "mpi4jax":
            reason = "not installed (make bench installs it)"
        log = Path(sys.prefix) / "mpi4jax-build.log"
        if log.exists():
            lines = [ln for ln in log.read_text(errors="replace").splitlines()
                     if "error" in ln.lower()]
            if lines:
                reason += f"; build failed ({log}): {lines[-1].strip()[:200]}"
        return False, reason


# ---------------------------------------------------------------------------
# Setups: (ctx, op, count) -> (once, run, timed)


def setup_floor(ctx, op, count):
    floor = ctx.floor
    if floor is None:
        raise Unavailable(ctx.floor_reason)

    def once():
        x, out = floor_buffers(op, ctx.rank, ctx.size, count)
        floor.call(op, x, out, count, 1)
        return out

    x, out = floor_buffers(op, ctx.rank, ctx.size, count)

    def run(k):
        floor.call(op, x, out, count, k)

    def timed(repeats, timer):
        # k chosen as for everyone else, but each run timed inside C (MPI_Wtime,
        # barrier first, MAX over ranks): no Python in the loop.
        k = timer.choose_k(run, amortize=False, nbytes=x.nbytes)
        return k, floor.call(op, x, out, count, k, repeats)

    return once, run, timed


def setup_mpi4py(ctx, op, count):
    def buffers():
        x, out = floor_buffers(op, ctx.rank, ctx.size, count)
        return (x, out) if op == "bcast" else (x, np.zeros_like(out))

    def once():
        x, out = buffers()
        mpi4py_call(op, ctx.pycomm, x, out)()
        return out

    call = mpi4py_call(op, ctx.pycomm, *buffers())

    def run(k):
        for _ in range(k):
            call()

    return once, run, None


def setup_jit(ctx, library, op, count):
    """jax.jit of lax.fori_loop over k dependent calls, input donated."""
    import jax
    fn = ctx.jax_ops[library][op]
    in_place = op in IN_PLACE.get(library, ())
    loop = jax.jit(lambda x, k: jax.lax.fori_loop(0, k, lambda i, v: feed(v, fn(v), in_place), x),
                   donate_argnums=0)
    # One call's output: the loop's with k = 1 when it feeds the output back (one
    # compilation less), else the collective on its own.
    single = (lambda x: loop(x, 1)) if in_place else jax.jit(fn)
    state = [jax.numpy.asarray(jax_input(library, op, ctx.rank, ctx.size, count))]

    def once():
        return np.asarray(single(jax.numpy.asarray(
            jax_input(library, op, ctx.rank, ctx.size, count))).block_until_ready())

    def run(k):
        state[0] = loop(state[0], k)
        state[0].block_until_ready()

    return once, run, None


def setup_eager(ctx, library, op, count):
    """k eager calls on one jax array."""
    import jax
    fn = ctx.jax_ops[library][op]
    x = jax.numpy.asarray(jax_input(library, op, ctx.rank, ctx.size, count))

    def once():
        return np.asarray(fn(jax.numpy.asarray(
            jax_input(library, op, ctx.rank, ctx.size, count))).block_until_ready())

    def run(k):
        out = None
        for _ in range(k):
            out = fn(x)
        out.block_until_ready()
        jax.effects_barrier()

    return once, run, None


def with_library(setup_pattern, library):
    """setup_pattern(ctx, library, op, count) as a setup; Unavailable where library lacks op."""
    def setup(ctx, op, count):
        if library not in ctx.jax_ops:
            raise Unavailable(ctx.mpi4jax_reason)
        if op not in ctx.jax_ops[library]:
            raise Unavailable(f"{library} has no {op}")
        return setup_pattern(ctx, library, op, count)
    return setup


# name -> setup(ctx, op, count); a name ending in "-jit" is a jitted loop (timing
# amortizes its one dispatch per run).  jax-gloo comes last, from child processes.
IMPLEMENTATIONS = {
    "c-floor": setup_floor,
    "mpicoll-jit": with_library(setup_jit, "mpicoll"),
    "mpicoll-eager": with_library(setup_eager, "mpicoll"),
    "mpi4py": setup_mpi4py,
    "mpi4jax-jit": with_library(setup_jit, "mpi4jax"),
    "mpi4jax-eager": with_library(setup_eager, "mpi4jax"),
}
IMPLS = (*IMPLEMENTATIONS, "jax-gloo")


# ---------------------------------------------------------------------------
# The pytree case: PYTREE_LEAVES leaves, one fused allreduce vs a call per leaf.
# Setups: ctx -> (once, run, timed); once() returns the list of output leaves.


def fresh_tree(ctx):
    import jax
    return [jax.numpy.asarray(a) for a in pytree_inputs(ctx.rank, ctx.size)]


def fused_allreduce():
    import mpicoll
    return mpicoll.allreduce


def per_leaf_allreduce():
    import mpicoll
    return lambda tree: [mpicoll.allreduce(leaf) for leaf in tree]


def pytree_eager(ctx, fn):
    import jax
    tree = fresh_tree(ctx)

    def run(k):
        out = None
        for _ in range(k):
            out = fn(tree)
        jax.block_until_ready(out)
    return (lambda: fn(fresh_tree(ctx))), run, None


def pytree_jit(ctx, fn):
    import jax
    loop = jax.jit(lambda t, k: jax.lax.fori_loop(0, k, lambda i, v: fn(v), t), donate_argnums=0)
    state = [fresh_tree(ctx)]

    def run(k):
        state[0] = loop(state[0], k)
        jax.block_until_ready(state[0])
    return (lambda: loop(fresh_tree(ctx), 1)), run, None


def pytree_floor(ctx, leaves):
    """The C floor on the whole pytree as one buffer (leaves=1) or one call per leaf."""
    if ctx.floor is None:
        raise Unavailable(ctx.floor_reason)
    n = PYTREE_LEAVES * PYTREE_LEAF_BYTES // 4 // leaves
    x = np.ones(n, np.float32)

    def once():
        parts = [leaf.copy() for leaf in pytree_inputs(ctx.rank, ctx.size)]
        if leaves == 1:
            buf = np.concatenate(parts)
            ctx.floor.call("allreduce", buf, buf, n, 1)
            return np.split(buf, PYTREE_LEAVES)
        for part in parts:
            ctx.floor.call("allreduce", part, part, n, 1)
        return parts

    def run(k):
        ctx.floor.call("allreduce", x, x, n, k * leaves)

    def timed(repeats, timer):
        k = timer.choose_k(run, amortize=False)
        return k, ctx.floor.call("allreduce", x, x, n, k * leaves, repeats)
    return once, run, timed


def pytree_mpi4py(ctx):
    from mpi4py import MPI
    pairs = [(a.copy(), np.empty_like(a)) for a in pytree_inputs(ctx.rank, ctx.size)]
    calls = [functools.partial(ctx.pycomm.Allreduce, a, b, MPI.SUM) for a, b in pairs]

    def once():
        for call in calls:
            call()
        return [b for _, b in pairs]

    def run(k):
        for _ in range(k):
            for call in calls:
                call()
    return once, run, None


# name -> setup(ctx); the part before "/" is the IMPLS entry that selects it.
PYTREE_IMPLEMENTATIONS = {
    "c-floor/fused": lambda ctx: pytree_floor(ctx, 1),
    "c-floor/per-leaf": lambda ctx: pytree_floor(ctx, PYTREE_LEAVES),
    "mpi4py/per-leaf": pytree_mpi4py,
    "mpicoll-eager/fused": lambda ctx: pytree_eager(ctx, fused_allreduce()),
    "mpicoll-eager/per-leaf": lambda ctx: pytree_eager(ctx, per_leaf_allreduce()),
    "mpicoll-jit/fused": lambda ctx: pytree_jit(ctx, fused_allreduce()),
    "mpicoll-jit/per-leaf": lambda ctx: pytree_jit(ctx, per_leaf_allreduce()),
}


# ---------------------------------------------------------------------------
# jax-gloo: a child process per rank (benchmarks/jax_gloo.py), started by bench.py


def gloo_worker(args):
    """In a worker: time args.plan's cases with jit(shard_map(fori_loop)) and emit the results."""
    jax = jax_gloo.initialize(args)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    plan = json.loads(args.plan)
    rank, size = args.process_id, args.num_processes
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    steps = {"allreduce": lambda v: jax.lax.psum(v, "d"),
             "allgather": lambda v: jax.lax.all_gather(v, "d"),
             "alltoall": lambda v: jax.lax.all_to_all(v, "d", 0, 0, tiled=True)}

    def slowest(t):
        return float(np.max(multihost_utils.process_allgather(np.float64(t))))

    timer = Timer(lambda: multihost_utils.sync_global_devices("bench"), slowest,
                  plan["target_ms"] / 1e3)
    results = []
    for op, nbytes, repeats in plan["cases"]:
        count = block_count(op, nbytes, size)
        entry = dict(op=op, bytes=nbytes)
        try:
            step = steps[op]
            single = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                           check_vma=False))
            looped = lambda x, k: jax.lax.fori_loop(  # noqa: E731
                0, k, lambda i, v: feed(v, step(v), False), x)
            loop = jax.jit(jax.shard_map(looped, mesh=mesh, in_specs=(P("d"), P()),
                                         out_specs=P("d"), check_vma=False), donate_argnums=0)
            local = make_input(op, rank, size, count)
            out = single(jax.make_array_from_process_local_data(sharding, local))
            got = np.asarray(out.addressable_shards[0].data)
            ok = bool(np.array_equal(got, expected(op, rank, size, count)))
            del out
            state = [jax.make_array_from_process_local_data(sharding, local)]

            def run(k):
                state[0] = loop(state[0], k)
                state[0].block_until_ready()

            k, times = timer.times(run, repeats, nbytes=nbytes)
            entry.update(ok=ok, k=k, times=times)
            state.clear()  # frees the device buffer before the next size
        except Exception as error:
            entry.update(error=f"{type(error).__name__}: {str(error)[:300]}")
        results.append(entry)
    multihost_utils.sync_global_devices("done")
    jax_gloo.emit(dict(jax=jax.__version__, results=results))
    jax_gloo.shutdown()

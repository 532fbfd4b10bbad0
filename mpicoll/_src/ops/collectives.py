"""The rank-block collectives: each one's spec (shape rule, autodiff, flags: a row
of csrc/ops.def on the C++ side) and its public function, MPI's names and
argument order; barrier and pvary.

bcast, scatter, reduce, allreduce, gather, allgather, alltoall,
reduce_scatter, scan and exscan move equal blocks per rank (MPI's plain
collectives); pytrees of them fuse into one message per dtype
(primitive/dispatch.py).  Each function takes an array or a pytree and an
optional communicator (default COMM_WORLD).  With axis_name (the local device
axis of pmap/shard_map) a collective spans ranks x local devices
(ops/ranks_devices.py, which finds these specs by name in the registry,
primitive/spec.SPECS); this module is the one reader of axis_name.  The
variable-size collectives are in vector.py, point-to-point in p2p.py.
"""

import jax
import jax.numpy as jnp

from . import ranks_devices
from .. import _compat
from ..primitive import spec, varying
from ..runtime import dtypes, comm as comm_layer
from ..primitive.dispatch import collective
from ..primitive.define import (
    define, effectful_primitive, mpi_effect, ordered_ffi_call, reduction_tangent)
from ..primitive.spec import Collective, rank as _rank
from ..primitive.validate import as_array, each_leaf
from ..primitive.varying import pvary_p


# --- The specs: what each collective is ----------------------------------------------

_SUM = dtypes.SUM
_OP_NAMES = dtypes.OP_NAMES


def _reduction_tangent(reduction, x, y, t, params):
    """reduction_tangent for REDUCE or ALLREDUCE (`reduction`) across the ranks."""
    return reduction_tangent(
        reduction.name, _OP_NAMES[params["op"]], x,
        lambda: y if reduction is ALLREDUCE else ALLREDUCE.run(x, params), t,
        lambda v: reduction.run(v, params, op=_SUM), lambda: ALLGATHER.run(x, params, op=-1),
        lambda: _rank(params))


# bcast: root's x on every rank.  The output is replicated (one value), so its
# cotangent is the same everywhere and belongs to root's input alone (with
# transpose_sums, pmap's convention, every rank's cotangent is summed to root).
BCAST = define(Collective(
    "bcast",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: (
        REDUCE.run(ct, params, op=_SUM) if params["transpose_sums"]
        else ct if _rank(params) == params["root"] else jnp.zeros_like(ct)),
    has_root=True,
    in_place=True,
    replicates=True,
))


# scatter: rank r gets root's x[r].
SCATTER = define(Collective(
    "scatter",
    out_shape=lambda shape, params: shape[1:],
    transpose=lambda ct, params: GATHER.run(ct, params),
    has_root=True,
    leading_axis_is_size=True,
))

# reduce: the reduction on root, zeros elsewhere.  Only root's cotangent
# matters, and it reaches every rank's input.
REDUCE = define(Collective(
    "reduce",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: BCAST.run(ct, params, op=-1),
    reduction_jvp=lambda x, y, t, params: _reduction_tangent(REDUCE, x, y, t, params),
    has_root=True,
    reduces=True,
    in_place=True,
))

# allreduce: the reduction on every rank.  The output is one value; with
# op="sum" each rank's input receives its cotangent unchanged (or, with
# transpose_sums, the sum of every rank's cotangent, as psum under pmap).
# "Unchanged" is pvary, the identity whose own transpose is this allreduce, so
# that transposing twice gives allreduce back (as in mpi4jax), not the identity.
ALLREDUCE = define(Collective(
    "allreduce",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: (
        ALLREDUCE.run(ct, params) if params["transpose_sums"]
        else pvary_p.bind(ct, comm=params["comm"], size=params["size"])),
    reduction_jvp=lambda x, y, t, params: _reduction_tangent(ALLREDUCE, x, y, t, params),
    reduces=True,
    in_place=True,
    replicates=True,
))


def _pvary_transpose(ct, x, *, comm, size):
    """pvary's transpose: the sum over ranks (the allreduce pvary transposes back to)."""
    if type(ct) is _compat.Zero:
        return [_compat.zero_tangent(x.aval)]
    return [ALLREDUCE.run(ct, dict(comm=comm, size=size, root=0, op=_SUM,
                                   transpose_sums=False))]


_compat.register_transpose(pvary_p, _pvary_transpose)

# gather: the stack by rank on root, zeros elsewhere.
GATHER = define(Collective(
    "gather",
    out_shape=lambda shape, params: (params["size"], *shape),
    transpose=lambda ct, params: SCATTER.run(ct, params),
    has_root=True,
))

# allgather: the stack by rank on every rank (one value); each input's
# cotangent is its own slice (with transpose_sums, of the sum over ranks).
ALLGATHER = define(Collective(
    "allgather",
    out_shape=lambda shape, params: (params["size"], *shape),
    transpose=lambda ct, params: (
        ALLREDUCE.run(ct, params, op=_SUM) if params["transpose_sums"] else ct)[_rank(params)],
    replicates=True,
))


# alltoall: out[j] on rank r is x[r] of rank j; its own transpose.
# Not in place although the handler supports MPI_IN_PLACE: MPICH's in-place
# alltoall (pairwise Sendrecv_replace) measured 5.3x the out-of-place floor at
# 64 MiB and 2.1x at 4 MiB on 2 ranks (make bench), against 1.5x and 1.06x.
ALLTOALL = define(Collective(
    "alltoall",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: ALLTOALL.run(ct, params),
    leading_axis_is_size=True,
))

# reduce_scatter: rank r gets the reduction of every rank's x[r].  With
# op="sum" its transpose is allgather (block r came from every rank's x[r]);
# that allgather's output is a per-rank cotangent, not one replicated value, so
# it is told to sum on transposition (giving reduce_scatter back).
REDUCE_SCATTER = define(Collective(
    "reduce_scatter",
    out_shape=lambda shape, params: shape[1:],
    transpose=lambda ct, params: ALLGATHER.run(ct, params, op=-1, transpose_sums=True),
    reduces=True,
    leading_axis_is_size=True,
))


def _total(ct, params):
    """The sum of ct over ranks, as a per-rank value (its transpose sums too)."""
    return ALLREDUCE.run(ct, params, op=_SUM, transpose_sums=True)


# scan / exscan: inclusive / exclusive prefix reductions in rank order (exscan
# gives zeros on rank 0, where MPI leaves the result undefined).  With
# op="sum", the transpose is the suffix sum: x_q's cotangent is the sum of
# ct_r over r >= q (scan) or r > q (exscan), written as the total minus the
# other prefix (its rounding follows the total's magnitude).
SCAN = define(Collective(
    "scan",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: _total(ct, params) - EXSCAN.run(ct, params),
    reduces=True,
    in_place=True,
))

EXSCAN = define(Collective(
    "exscan",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: _total(ct, params) - SCAN.run(ct, params),
    reduces=True,
    in_place=True,
))


# --- The public functions ----------------------------------------------------------


# What every rank-block collective has in common, put into each docstring by
# _contract ({x}, {comm}, {raises}, {rules}), so that help() and the API page show
# the whole contract of each function, in napoleon's Google style.
_X = spec.paragraph(
    "An array (jax or numpy), a Python scalar, or a pytree of them (each leaf as if "
    "alone; small leaves of one dtype travel in one message; the result has the tree's "
    f"structure).  Dtypes: {dtypes.dtype_names()} (64-bit ones need jax_enable_x64).")

_COMM = """an mpi4py intracommunicator (COMM_WORLD, a Dup(), Split(),
            Create_cart() ...); None (the default) means MPI.COMM_WORLD.
            mpicoll talks on private duplicates of it, so its messages never
            match the caller's own mpi4py calls."""

_OPS = """"sum" (the default), "prod", "min", "max", "land", "lor", "lxor",
            "band", "bor", "bxor", or the mpi4py op (MPI.SUM, ...).  sum and
            prod: integers, floats, complex; min and max: bool, integers,
            floats; the logical and bitwise ops: bool and integers.  "sum" is
            linear (JVP and transpose); prod, min and max of allreduce and
            reduce have a JVP; the other ops are not differentiable."""

_RAISES = """TypeError, ValueError: the same on every rank and before any MPI
            call, for an argument it cannot take (an unsupported dtype, an op
            invalid for the dtype, a root out of range or traced under jit, a
            leading axis other than comm's size, a comm that is not an
            intracommunicator); the message names the argument and the leaf.
        jax.errors.JaxRuntimeError: on every rank, when the ranks' calls
            differ (compared the first time each call site runs: collective,
            dtype, shape, op, root, communicator), and when MPI fails (naming
            the op, the rank and the communicator)."""

_RULES = """Every rank of comm must call the same collectives in the same order,
        with the same root, op, dtype and shape.  Works eagerly (one cached
        compiled program per shape, dtype and parameters) and under jax.jit,
        vmap (one call for the batch), grad and jvp (docs/autodiff.md), and
        inside pmap and shard_map over the local devices, where each device
        talks to the same device of the other ranks (docs/devices.md)."""

_NO_AXIS_NAME = """NotImplementedError: for axis_name (no global form), naming what to
            use instead."""


_contract = spec.documented({"x": _X, "comm": _COMM, "ops": _OPS, "raises": _RAISES,
                             "rules": _RULES, "no_axis_name": _NO_AXIS_NAME})


@_contract
def bcast(x, root=0, *, comm=None, axis_name=None):
    """Root's x on every rank (MPI_Bcast).

    Args:
        x: {x}
            Every rank passes an x of the same shape and dtype; only root's
            values are read.
        root: the rank whose x is sent, a static int (default 0).
        comm: {comm}
        axis_name: the local device axis of pmap/shard_map: the broadcast spans
            ranks x local devices, and root is the participant rank * L + device
            (L local devices).
    Returns:
        On every rank, root's x (shape and dtype of x).  Linear; its transpose
        sums the cotangents to root.
    Raises:
        {raises}
    Note:
        {rules}

    Example (2 ranks)::

        x = jnp.full(3, rank)            # [0,0,0] on rank 0, [1,1,1] on rank 1
        mpicoll.bcast(x, root=1)         # [1,1,1] on both
    """
    if axis_name is not None:
        return ranks_devices.bcast(x, root, comm, axis_name)
    return collective(BCAST, x, comm=comm, root=root)


def _no_global_form(name, axis_name, instead):
    if axis_name is not None:
        raise NotImplementedError(
            f"mpicoll.{name}: axis_name is not supported: {name} has no global (ranks x "
            f"devices) form; {instead}, or call {name} without axis_name inside pmap/shard_map "
            "(one collective per local device)")


@_contract
def scatter(x, root=0, *, comm=None, axis_name=None):
    """Rank r gets root's x[r] (MPI_Scatter).

    Args:
        x: shape (size, *s) on every rank (size: comm's size); only root's
            values are read.
            {x}
        root: the rank whose x is scattered, a static int (default 0).
        comm: {comm}
        axis_name: not supported (use alltoall(x, axis_name=...)).
    Returns:
        On rank r, root's x[r] (shape s).  Linear; its transpose gathers the
        cotangents to root.
    Raises:
        {raises}
        {no_axis_name}
    Note:
        {rules}

    Example (2 ranks)::

        x = jnp.array([[10, 11], [20, 21]])  # read on root only
        mpicoll.scatter(x, root=0)           # rank 0: [10, 11]; rank 1: [20, 21]
    """
    _no_global_form("scatter", axis_name, "use alltoall(x, axis_name=...)")
    return collective(SCATTER, x, comm=comm, root=root)


@_contract
def reduce(x, op="sum", root=0, *, comm=None, axis_name=None):
    """The reduction of x over ranks, on root (MPI_Reduce).

    Args:
        x: {x}
        op: {ops}
        root: the rank that receives the result, a static int (default 0).
        comm: {comm}
        axis_name: not supported (use allreduce(x, op, axis_name=...)).
    Returns:
        On root, op over every rank's x (shape and dtype of x); zeros on the
        other ranks.
    Raises:
        {raises}
        {no_axis_name}
    Note:
        {rules}

    Example (2 ranks)::

        mpicoll.reduce(jnp.array([rank + 1.0]), "sum", root=0)  # rank 0: [3.], rank 1: [0.]
    """
    _no_global_form("reduce", axis_name, "use allreduce(x, op, axis_name=...)")
    return collective(REDUCE, x, comm=comm, root=root, op=op)


@_contract
def allreduce(x, op="sum", *, comm=None, axis_name=None):
    """The reduction of x over ranks, on every rank (MPI_Allreduce).

    Args:
        x: {x}
        op: {ops}
        comm: {comm}
        axis_name: the local device axis of pmap/shard_map: the reduction spans
            every device of every rank (lax.psum over ranks x devices for
            op="sum"; its paths by size: docs/devices.md).
    Returns:
        On every rank, op over every rank's x (shape and dtype of x; for a
        pytree, the same tree).  Integer sums wrap around like numpy's.
    Raises:
        {raises}
    Note:
        {rules}

    Example (2 ranks)::

        mpicoll.allreduce(jnp.array([rank + 1.0, 2.0]))     # [3., 4.] on both
        mpicoll.allreduce({{"w": w, "b": b}}, "max")  # a pytree, one message per dtype
        jax.tree.map(lambda g: g / size, mpicoll.allreduce(grads))  # averaged gradients
    """
    if axis_name is not None:
        return ranks_devices.allreduce(x, op, comm, axis_name)
    return collective(ALLREDUCE, x, comm=comm, op=op)


@_contract
def gather(x, root=0, *, comm=None, axis_name=None):
    """Every rank's x, stacked by rank, on root (MPI_Gather).

    Args:
        x: {x}
        root: the rank that receives the stack, a static int (default 0).
        comm: {comm}
        axis_name: not supported (use allgather(x, axis_name=...)).
    Returns:
        On root, shape (size, *x.shape) with row r = rank r's x; zeros of that
        shape on the other ranks.  Linear; its transpose scatters from root.
    Raises:
        {raises}
        {no_axis_name}
    Note:
        {rules}

    Example (2 ranks)::

        mpicoll.gather(jnp.array([rank, 10 * rank]), root=0)
        # rank 0: [[0, 0], [1, 10]]; rank 1: [[0, 0], [0, 0]]
    """
    _no_global_form("gather", axis_name, "use allgather(x, axis_name=...)")
    return collective(GATHER, x, comm=comm, root=root)


@_contract
def allgather(x, *, comm=None, axis_name=None):
    """Every rank's x, stacked by rank, on every rank (MPI_Allgather).

    Args:
        x: {x}
        comm: {comm}
        axis_name: the local device axis: the stack of every participant's x
            (participant rank * L + device), shape (size * L, *x.shape).
    Returns:
        On every rank, shape (size, *x.shape) with row r = rank r's x.
        Linear; its transpose is each rank's own row of the cotangent.
    Raises:
        {raises}
    Note:
        {rules}

    Example (2 ranks)::

        mpicoll.allgather(jnp.array(rank))   # [0, 1] on both
    """
    if axis_name is not None:
        return ranks_devices.allgather(x, comm, axis_name)
    return collective(ALLGATHER, x, comm=comm)


@_contract
def alltoall(x, *, comm=None, axis_name=None):
    """Every rank sends x[j] to rank j (MPI_Alltoall).

    Args:
        x: shape (size, *s) (size: comm's size).
            {x}
        comm: {comm}
        axis_name: the local device axis: x has shape (size * L, *s) and the
            exchange is among every participant.
    Returns:
        On rank r, shape x.shape with row j = rank j's x[r].  Linear; its
        transpose is the alltoall of the cotangents.
    Raises:
        {raises}
    Note:
        {rules}

    Example (2 ranks)::

        mpicoll.alltoall(jnp.array([10 * rank, 10 * rank + 1]))
        # rank 0: [0, 10]; rank 1: [1, 11]
    """
    if axis_name is not None:
        return ranks_devices.alltoall(x, comm, axis_name)
    return collective(ALLTOALL, x, comm=comm)


@_contract
def reduce_scatter(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction over ranks of x[r] (MPI_Reduce_scatter_block).

    From blocks of 256 KiB mpicoll runs its own pairwise exchange, with MPI's
    operators (docs/performance.md).

    Args:
        x: shape (size, *s) (size: comm's size).
            {x}
        op: {ops}
        comm: {comm}
        axis_name: the local device axis: x has shape (size * L, *s) and
            participant p gets the reduction of every participant's x[p]
            (lax.psum_scatter over ranks x devices for op="sum").
    Returns:
        On rank r, op over every rank's x[r] (shape s).  For "sum" it is
        linear, and its transpose is the allgather of the cotangents.
    Raises:
        {raises}
    Note:
        {rules}

    Example (2 ranks)::

        x = jnp.array([[1.0, 2.0], [3.0, 4.0]]) * (rank + 1)
        mpicoll.reduce_scatter(x)            # rank 0: [3., 6.]; rank 1: [9., 12.]
    """
    if axis_name is not None:
        return ranks_devices.reduce_scatter(x, op, comm, axis_name)
    return collective(REDUCE_SCATTER, x, comm=comm, op=op)


@_contract
def scan(x, op="sum", *, comm=None, axis_name=None):
    """Inclusive prefix reduction in rank order (MPI_Scan).

    Args:
        x: {x}
        op: {ops}
        comm: {comm}
        axis_name: not supported (use allgather(x, axis_name=...) and a local
            cumsum).
    Returns:
        On rank r, op over the x of ranks 0..r (shape and dtype of x).
    Raises:
        {raises}
        {no_axis_name}
    Note:
        {rules}

    Example (3 ranks)::

        mpicoll.scan(jnp.array(rank + 1))    # rank 0: 1; rank 1: 3; rank 2: 6
    """
    _no_global_form("scan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return collective(SCAN, x, comm=comm, op=op)


@_contract
def exscan(x, op="sum", *, comm=None, axis_name=None):
    """Exclusive prefix reduction in rank order (MPI_Exscan).

    Args:
        x: {x}
        op: {ops}
        comm: {comm}
        axis_name: not supported (use allgather(x, axis_name=...) and a local
            cumsum).
    Returns:
        On rank r > 0, op over the x of ranks 0..r-1; on rank 0, zeros (where
        MPI leaves the result undefined).  Shape and dtype of x.
    Raises:
        {raises}
        {no_axis_name}
    Note:
        {rules}

    Example (3 ranks)::

        mpicoll.exscan(jnp.array(rank + 1))  # rank 0: 0; rank 1: 1; rank 2: 3
    """
    _no_global_form("exscan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return collective(EXSCAN, x, comm=comm, op=op)


@_compat.api_boundary
def barrier(*, comm=None):
    """Block until every rank of comm has reached this point (MPI_Barrier).

    It keeps its place in program order like any collective, under jax.jit too,
    where it is never dropped although it returns nothing.

    Args:
        comm: an mpi4py intracommunicator; None (the default) means
            MPI.COMM_WORLD.
    Returns:
        None, on every rank, once every rank of comm has called it.
    Raises:
        TypeError, ValueError: before any MPI call, for a comm that is not an
            intracommunicator.

    Example::

        mpicoll.barrier()                    # eagerly: every rank is here

        @jax.jit
        def step(x):
            mpicoll.barrier()                # in program order, before the allreduce
            return mpicoll.allreduce(x)
    """
    info = comm_layer.resolve(comm, "barrier")
    if _compat.at_top_level():
        with _compat.no_context_mesh():  # its eager program names its own device
            _barrier_p.bind(comm=info.slot)
    else:
        _barrier_p.bind(comm=info.slot)


@_compat.api_boundary
def pvary(x, *, comm=None):
    """x unchanged; under reverse-mode autodiff its cotangent is summed over the ranks.

    Use it on a value that is the same on every rank (parameters, a bcast or
    allreduce result) before using it with this rank's data, so that its
    gradient collects every rank's contribution.  Inside jax.shard_map over
    mpicoll.mesh() JAX inserts it where a replicated value meets per-rank data;
    there it is needed only to keep a loop carry per-rank.  Outside, in the
    "convention" autodiff mode, replicated parameters need it (docs/autodiff.md).

    Args:
        x: an array or a pytree of arrays of a supported dtype (those of
            allreduce).
        comm: the ranks whose cotangents are summed: an mpi4py
            intracommunicator; None (the default) means MPI.COMM_WORLD.
    Returns:
        x, of the same structure, shapes, dtypes and values, on every rank.
        Its JVP is the tangent, marked alike; its transpose the allreduce
        (sum) of the cotangents over comm.  Outside a transpose it makes no
        MPI call.
    Raises:
        TypeError, ValueError: before any MPI call, for a leaf that is not an
            array of a supported dtype, or a comm that is not an
            intracommunicator.
        ValueError: inside shard_map over mpicoll.mesh(), for a value that
            already varies over the ranks (a per-rank value).

    Example (the "convention" autodiff mode)::

        def global_loss(params):             # params: the same on every rank
            local = loss(mpicoll.pvary(params), x_local, y_local)
            return mpicoll.allreduce(local) / size
        grads = jax.grad(global_loss)(params)    # the same on every rank
    """
    info = comm_layer.resolve(comm, "pvary")
    leaves, treedef = jax.tree.flatten(x)
    leaves = each_leaf(x, leaves, lambda leaf: as_array(leaf, "pvary"))
    each_leaf(x, leaves, lambda leaf: dtypes.dtype_family(leaf.dtype, "pvary"))
    if varying.ranks_typed():
        each_leaf(x, leaves, varying.check_invariant)
    return jax.tree.unflatten(treedef, [varying.pvary_p.bind(leaf, comm=info.slot,
                                                             size=info.size)
                                        for leaf in leaves])


# Barrier: no data, only the ordering token.
def _barrier_lowering(ctx, *, comm):
    devices = _compat.partitioned_devices(ctx)
    if devices:  # in a program XLA partitions: each device's barrier, in a manual region
        mesh = jax.sharding.AbstractMesh((devices,), ("_mpicoll_devices",))
        region = jax.shard_map(lambda: _barrier_p.bind(comm=comm), mesh=mesh, in_specs=(),
                               out_specs=[], check_vma=False)
        return _compat.lower_function(ctx, region, multiple_results=True)
    return ordered_ffi_call(ctx, "mpicoll_barrier", comm=comm)


_barrier_p = effectful_primitive("mpicoll_barrier", lambda *, comm: ([], {mpi_effect}),
                                 _barrier_lowering, multiple_results=True)

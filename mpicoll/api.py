"""The public functions of the rank-block collectives, barrier and pvary: MPI's names and
argument order.

Each takes an array or a pytree and an optional communicator (default
COMM_WORLD).  With axis_name (the local device axis of pmap/shard_map) a
collective spans ranks x local devices (_ranks_devices.py); this module is the
one reader of axis_name.  The variable-size collectives are in vector.py,
point-to-point in p2p.py.
"""

import jax

from . import _blocks, _compat, _ranks_devices, _types, _typing, comm as comm_layer
from ._dispatch import collective
from ._primitive import effectful_primitive, mpi_effect, ordered_ffi_call
from ._validate import as_array, each_leaf


# What every rank-block collective has in common, appended to each docstring.
_COMMON = """
    Common to mpicoll's collectives:
        x: a jax or numpy array or a Python scalar, of a supported dtype (bool,
            int8-64, uint8-64, float16, bfloat16, float32, float64, complex64,
            complex128), or a pytree of them: small leaves of one dtype travel
            in one message; the result has the tree's structure.
        comm: an mpi4py intracommunicator; None means MPI.COMM_WORLD.  mpicoll
            talks on private duplicates of it, so its messages never match the
            caller's own mpi4py calls.
        Every rank of comm must call the same collectives in the same order, with
        the same root, op, dtype and shape (checked across ranks the first time
        each call site runs; a mismatch raises jax.errors.JaxRuntimeError on
        every rank).  Works eagerly and under jax.jit, vmap, grad, pmap and
        shard_map (README: vmap and autodiff; Inside pmap and shard_map).
    Raises:
        TypeError / ValueError, the same on every rank and before any MPI call,
        for an unsupported dtype, an invalid op for the dtype, a root out of
        range, a wrong leading axis, a communicator that is not one.
    """

_OPS = """
        op: "sum", "prod", "min", "max", "land", "lor", "lxor", "band", "bor",
            "bxor", or the mpi4py op (MPI.SUM, ...).  sum/prod: integers, floats,
            complex; min/max: bool, integers, floats; the logical and bitwise
            ops: bool and integers.  op="sum" is linear (JVP and transpose);
            prod, min and max of allreduce and reduce have a JVP too (README:
            vmap and autodiff); the other ops are not differentiable."""


def _contract(function):
    """The docstring completed with what every collective has in common; an error
    raised inside shows the caller's frames, not mpicoll's (as JAX's own API does)."""
    doc = function.__doc__.replace("{ops}", _OPS).replace("{{", "{").replace("}}", "}")
    function.__doc__ = doc.rstrip() + "\n" + _COMMON
    return _compat.api_boundary(function)


@_contract
def bcast(x, root=0, *, comm=None, axis_name=None):
    """Root's x on every rank (MPI_Bcast).

    Args:
        root: the rank whose x is sent (a static int).  Every rank passes an x
            of the same shape and dtype; only root's values are read.
        axis_name: the local device axis of pmap/shard_map: the broadcast spans
            ranks x local devices, and root is the participant rank * L + device.
    Returns:
        On every rank, root's x (shape x.shape).

    Example (2 ranks)::

        x = jnp.full(3, rank)            # [0,0,0] on rank 0, [1,1,1] on rank 1
        mpicoll.bcast(x, root=1)         # [1,1,1] on both
    """
    if axis_name is not None:
        return _ranks_devices.bcast(x, root, comm, axis_name)
    return collective(_blocks.BCAST, x, comm=comm, root=root)


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
        x: shape (size, *s) on every rank (size = comm's size); only root's is read.
        root: the rank whose x is scattered (a static int).
        axis_name: not supported (NotImplementedError naming what to use instead).
    Returns:
        On rank r, root's x[r] (shape s).

    Example (2 ranks)::

        mpicoll.scatter(jnp.array([[10, 11], [20, 21]]), root=0)  # rank 1: [20, 21]
    """
    _no_global_form("scatter", axis_name, "use alltoall(x, axis_name=...)")
    return collective(_blocks.SCATTER, x, comm=comm, root=root)


@_contract
def reduce(x, op="sum", root=0, *, comm=None, axis_name=None):
    """The reduction of x over ranks, on root (MPI_Reduce).

    Args:{ops}
        root: the rank that receives the result (a static int).
        axis_name: not supported (use allreduce(x, op, axis_name=...)).
    Returns:
        On root, op over every rank's x (shape x.shape); zeros elsewhere.

    Example (2 ranks)::

        mpicoll.reduce(jnp.array([rank + 1.0]), "sum", root=0)  # rank 0: [3.], rank 1: [0.]
    """
    _no_global_form("reduce", axis_name, "use allreduce(x, op, axis_name=...)")
    return collective(_blocks.REDUCE, x, comm=comm, root=root, op=op)


@_contract
def allreduce(x, op="sum", *, comm=None, axis_name=None):
    """The reduction of x over ranks, on every rank (MPI_Allreduce).

    Args:{ops}
        axis_name: the local device axis of pmap/shard_map: the reduction spans
            every device of every rank (lax.psum over ranks x devices for
            op="sum"; the path by size: README, Inside pmap and shard_map).
    Returns:
        On every rank, op over every rank's x (shape and dtype of x).  Integer
        sums wrap around like numpy's.

    Example (2 ranks)::

        mpicoll.allreduce(jnp.array([rank + 1.0, 2.0]))        # [3., 4.] on both
        mpicoll.allreduce({{"w": w, "b": b}}, "max")              # a pytree, one message per dtype
        jax.tree.map(lambda g: g / size, mpicoll.allreduce(grads))  # averaged gradients
    """
    if axis_name is not None:
        return _ranks_devices.allreduce(x, op, comm, axis_name)
    return collective(_blocks.ALLREDUCE, x, comm=comm, op=op)


@_contract
def gather(x, root=0, *, comm=None, axis_name=None):
    """Every rank's x, stacked by rank, on root (MPI_Gather).

    Args:
        root: the rank that receives the stack (a static int).
        axis_name: not supported (use allgather(x, axis_name=...)).
    Returns:
        On root, shape (size, *x.shape) with row r = rank r's x; zeros elsewhere.
    """
    _no_global_form("gather", axis_name, "use allgather(x, axis_name=...)")
    return collective(_blocks.GATHER, x, comm=comm, root=root)


@_contract
def allgather(x, *, comm=None, axis_name=None):
    """Every rank's x, stacked by rank, on every rank (MPI_Allgather).

    Args:
        axis_name: the local device axis: the stack of every participant's x
            (participant rank * L + device), shape (size * L, *x.shape).
    Returns:
        On every rank, shape (size, *x.shape) with row r = rank r's x.

    Example (2 ranks)::

        mpicoll.allgather(jnp.array(rank))   # [0, 1] on both
    """
    if axis_name is not None:
        return _ranks_devices.allgather(x, comm, axis_name)
    return collective(_blocks.ALLGATHER, x, comm=comm)


@_contract
def alltoall(x, *, comm=None, axis_name=None):
    """Every rank sends x[j] to rank j (MPI_Alltoall).

    Args:
        x: shape (size, *s).
        axis_name: the local device axis: x has shape (size * L, *s) and the
            exchange is among every participant.
    Returns:
        On rank r, shape x.shape with row j = rank j's x[r].

    Example (2 ranks)::

        mpicoll.alltoall(jnp.array([10 * rank, 10 * rank + 1]))  # rank 0: [0, 10]; rank 1: [1, 11]
    """
    if axis_name is not None:
        return _ranks_devices.alltoall(x, comm, axis_name)
    return collective(_blocks.ALLTOALL, x, comm=comm)


@_contract
def reduce_scatter(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction over ranks of x[r] (MPI_Reduce_scatter_block).

    Args:
        x: shape (size, *s).{ops}
        axis_name: the local device axis: x has shape (size * L, *s) and
            participant p gets the reduction of every participant's x[p]
            (lax.psum_scatter over ranks x devices for op="sum").
    Returns:
        On rank r, op over every rank's x[r] (shape s).
    """
    if axis_name is not None:
        return _ranks_devices.reduce_scatter(x, op, comm, axis_name)
    return collective(_blocks.REDUCE_SCATTER, x, comm=comm, op=op)


@_contract
def scan(x, op="sum", *, comm=None, axis_name=None):
    """Inclusive prefix reduction in rank order (MPI_Scan).

    Args:{ops}
        axis_name: not supported (use allgather(x, axis_name=...) and a local cumsum).
    Returns:
        On rank r, op over the x of ranks 0..r (shape x.shape).
    """
    _no_global_form("scan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return collective(_blocks.SCAN, x, comm=comm, op=op)


@_contract
def exscan(x, op="sum", *, comm=None, axis_name=None):
    """Exclusive prefix reduction in rank order (MPI_Exscan).

    Args:{ops}
        axis_name: not supported (use allgather(x, axis_name=...) and a local cumsum).
    Returns:
        On rank r > 0, op over the x of ranks 0..r-1; on rank 0, zeros (where MPI
        leaves the result undefined).  Shape x.shape.
    """
    _no_global_form("exscan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return collective(_blocks.EXSCAN, x, comm=comm, op=op)


@_compat.api_boundary
def barrier(*, comm=None):
    """Block until every rank of comm reaches this point (MPI_Barrier), in program order."""
    info = comm_layer.resolve(comm, "barrier")
    _barrier_p.bind(comm=info.slot)


@_compat.api_boundary
def pvary(x, *, comm=None):
    """x (an array or a pytree) unchanged; under autodiff its cotangent is summed over ranks.

    Use it on a value that is identical on every rank (parameters, a bcast or
    allreduce result) before using it in a rank-dependent way, so that the
    gradient collects every rank's contribution.
    """
    info = comm_layer.resolve(comm, "pvary")
    leaves, treedef = jax.tree.flatten(x)
    leaves = each_leaf(x, leaves, lambda leaf: as_array(leaf, "pvary"))
    each_leaf(x, leaves, lambda leaf: _types.dtype_family(leaf.dtype, "pvary"))
    if _typing.ranks_typed():
        each_leaf(x, leaves, _typing.check_invariant)
    return jax.tree.unflatten(treedef, [_typing.pvary_p.bind(leaf, comm=info.slot,
                                                             size=info.size)
                                        for leaf in leaves])


# Barrier: no data, only the ordering token.
def _barrier_lowering(ctx, *, comm):
    return ordered_ffi_call(ctx, "mpicoll_barrier", comm=comm)


_barrier_p = effectful_primitive("mpicoll_barrier", lambda *, comm: ([], {mpi_effect}),
                                 _barrier_lowering, multiple_results=True)

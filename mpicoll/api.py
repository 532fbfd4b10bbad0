"""The public functions of the rank-block collectives, barrier and pvary: MPI's names and
argument order.

Each takes an array or a pytree and an optional communicator (default
COMM_WORLD).  With axis_name (the local device axis of pmap/shard_map) a
collective spans ranks x local devices (_ranks_devices.py); this module is the
one reader of axis_name.  The variable-size collectives are in vector.py,
point-to-point in p2p.py.
"""

import jax

from . import _blocks, _ranks_devices, _types, _typing, comm as comm_layer
from ._dispatch import collective
from ._primitive import effectful_primitive, mpi_effect, ordered_ffi_call
from ._validate import as_array, each_leaf


def bcast(x, root=0, *, comm=None, axis_name=None):
    """Root's x on every rank (MPI_Bcast). Output shape: x.shape.

    With axis_name (the local device axis of pmap/shard_map), root is a global
    participant index rank * local_devices + device.
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


def scatter(x, root=0, *, comm=None, axis_name=None):
    """Rank r gets root's x[r]; x has shape (size, *s) on every rank (MPI_Scatter). Output: s."""
    _no_global_form("scatter", axis_name, "use alltoall(x, axis_name=...)")
    return collective(_blocks.SCATTER, x, comm=comm, root=root)


def reduce(x, op="sum", root=0, *, comm=None, axis_name=None):
    """Reduction of x over ranks on root, zeros elsewhere (MPI_Reduce). Output: x.shape."""
    _no_global_form("reduce", axis_name, "use allreduce(x, op, axis_name=...)")
    return collective(_blocks.REDUCE, x, comm=comm, root=root, op=op)


def allreduce(x, op="sum", *, comm=None, axis_name=None):
    """Reduction of x over ranks on every rank (MPI_Allreduce). Output: x.shape.

    With axis_name, over every device of every rank (like lax.psum for op="sum").
    """
    if axis_name is not None:
        return _ranks_devices.allreduce(x, op, comm, axis_name)
    return collective(_blocks.ALLREDUCE, x, comm=comm, op=op)


def gather(x, root=0, *, comm=None, axis_name=None):
    """Stack of every rank's x by rank on root, zeros elsewhere (MPI_Gather). Output: (size, *x.shape)."""
    _no_global_form("gather", axis_name, "use allgather(x, axis_name=...)")
    return collective(_blocks.GATHER, x, comm=comm, root=root)


def allgather(x, *, comm=None, axis_name=None):
    """Stack of every rank's x by rank on every rank (MPI_Allgather). Output: (size, *x.shape).

    With axis_name: the stack of every participant's x, (size * local_devices, *x.shape).
    """
    if axis_name is not None:
        return _ranks_devices.allgather(x, comm, axis_name)
    return collective(_blocks.ALLGATHER, x, comm=comm)


def alltoall(x, *, comm=None, axis_name=None):
    """out[j] on rank r is x[r] of rank j; x has shape (size, *s) (MPI_Alltoall). Output: x.shape.

    With axis_name, over every participant: x has shape (size * local_devices, *s).
    """
    if axis_name is not None:
        return _ranks_devices.alltoall(x, comm, axis_name)
    return collective(_blocks.ALLTOALL, x, comm=comm)


def reduce_scatter(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction over ranks of x[r]; x has shape (size, *s) (MPI_Reduce_scatter_block). Output: s.

    With axis_name, over every participant: x has shape (size * local_devices, *s)
    and participant p gets the reduction of every participant's x[p] (like
    lax.psum_scatter for op="sum").
    """
    if axis_name is not None:
        return _ranks_devices.reduce_scatter(x, op, comm, axis_name)
    return collective(_blocks.REDUCE_SCATTER, x, comm=comm, op=op)


def scan(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction of x over ranks 0..r (MPI_Scan). Output: x.shape."""
    _no_global_form("scan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return collective(_blocks.SCAN, x, comm=comm, op=op)


def exscan(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction of x over ranks 0..r-1; zeros on rank 0 (MPI_Exscan). Output: x.shape."""
    _no_global_form("exscan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return collective(_blocks.EXSCAN, x, comm=comm, op=op)


def barrier(*, comm=None):
    """Block until every rank of comm reaches this point (MPI_Barrier), in program order."""
    info = comm_layer.resolve(comm, "barrier")
    _barrier_p.bind(comm=info.slot)


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

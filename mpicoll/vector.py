"""Variable-size collectives with counts known at trace time: gatherv,
allgatherv, scatterv, alltoallv.

Counts are static tuples of rows along the leading axis, so every shape is
known when the program is compiled.  They are specs of the shared mechanism,
family "vector": the handler reads [row elements, counts...] from `args` and
moves whole buffers with one MPI call (displacements are the running sums of
the counts: blocks are stored contiguously in rank order).

The leading length of x is the one argument that differs between ranks
(counts[rank], or sum(send_counts) for alltoallv): a wrong one raises on that
rank only, so the other ranks' call does not match; with abort on error (the
default with several ranks) the job ends there.
"""

import operator

import jax.numpy as jnp
import numpy as np

from . import _compat, _types
from ._dispatch import bind
from ._primitive import define
from ._spec import Collective, rank as _rank, run as _run

_INT_MAX = 2**31 - 1


def _counts_arg(counts, name, info, caller):
    try:
        counts = tuple(operator.index(c) for c in counts)
    except TypeError:
        raise TypeError(f"mpicoll.{caller}: {name} must be a tuple of ints (one per rank; "
                        f"static), got {counts!r}") from None
    if len(counts) != info.size:
        raise ValueError(f"mpicoll.{caller}: {name} has {len(counts)} entries, but the "
                         f"communicator has {info.size} ranks")
    if any(c < 0 for c in counts):
        raise ValueError(f"mpicoll.{caller}: {name} has a negative count: {counts}")
    if sum(counts) > _INT_MAX:
        raise ValueError(f"mpicoll.{caller}: {name} adds up to {sum(counts)} rows, more than "
                         f"MPI's displacements hold ({_INT_MAX})")
    return counts


def _leading(x, caller):
    if x.ndim == 0:
        raise ValueError(f"mpicoll.{caller}: x must have a leading axis (rows), got a scalar")


def _rows(x):
    return int(np.prod(x.shape[1:], dtype=np.int64))


def _own_rows(x, counts, info, caller, what="counts[rank]"):
    """The rank-local check: x's leading length is this rank's count."""
    if x.shape[0] != counts:
        raise ValueError(f"mpicoll.{caller}: on rank {info.rank}, x has {x.shape[0]} rows "
                         f"(shape {tuple(x.shape)}) but {what} = {counts}; this check depends "
                         "on the rank, so only this rank raises")


def _check_own(caller):
    """gatherv / allgatherv: x has counts[rank] rows."""
    def check(x, info, counts):
        _leading(x, caller)
        counts = _counts_arg(counts, "counts", info, caller)
        _own_rows(x, counts[info.rank], info, caller)
        return dict(ffi_args=(_rows(x), *counts))
    return check


def _check_scatterv(x, info, counts):
    _leading(x, "scatterv")
    counts = _counts_arg(counts, "counts", info, "scatterv")
    if x.shape[0] != sum(counts):  # the same on every rank
        raise ValueError(f"mpicoll.scatterv: x must have sum(counts) = {sum(counts)} rows, got "
                         f"shape {tuple(x.shape)}")
    return dict(ffi_args=(_rows(x), *counts))


def _check_alltoallv(x, info, send_counts, recv_counts):
    _leading(x, "alltoallv")
    send_counts = _counts_arg(send_counts, "send_counts", info, "alltoallv")
    recv_counts = _counts_arg(recv_counts, "recv_counts", info, "alltoallv")
    _own_rows(x, sum(send_counts), info, "alltoallv", what="sum(send_counts)")
    return dict(ffi_args=(_rows(x), *send_counts, *recv_counts))


def _static(counts):
    """Counts as a tuple of ints where they are (a list, numpy ints), for the eager cache key;
    anything else is left for the check to report."""
    try:
        return tuple(operator.index(c) for c in counts)
    except TypeError:
        return counts


def _counts(params):
    return params["ffi_args"][1:1 + params["size"]]


def _batch(x, dim, params):
    """One call for the batch: the counts axis stays first, the row grows by the batch."""
    if dim == 0:
        x, dim = jnp.moveaxis(x, 0, 1), 1
    return x, {**params, "ffi_args": (_rows(x), *params["ffi_args"][1:])}, dim


def _own_slice(ct, params):
    """Rank r's rows of an allgatherv output (with transpose_sums, of the sum over ranks)."""
    if params["transpose_sums"]:
        ct = _run("allreduce", ct, params, op=_types.SUM, ffi_args=())
    counts, rank = _counts(params), _rank(params)
    start = sum(counts[:rank])
    return ct[start:start + counts[rank]]


def _swap_counts(ct, params):
    args, size = params["ffi_args"], params["size"]
    return _run("alltoallv", ct, params,
                            ffi_args=(args[0], *args[1 + size:], *args[1:1 + size]))


def _spec(name, out_rows, transpose, check, **flags):
    return define(Collective(
        name,
        out_shape=lambda shape, params: (out_rows(params), *shape[1:]),
        transpose=transpose,
        family="vector",
        check=check,
        batch=_batch,
        **flags))


# gatherv: root gets every rank's rows in rank order, zeros elsewhere.
GATHERV = _spec("gatherv", lambda p: sum(_counts(p)),
                lambda ct, params: _run("scatterv", ct, params),
                _check_own("gatherv"), has_root=True)
# allgatherv: every rank gets every rank's rows (one value); the transpose is
# the rank's own rows, as for allgather.
ALLGATHERV = _spec("allgatherv", lambda p: sum(_counts(p)), _own_slice,
                   _check_own("allgatherv"), replicates=True)
# scatterv: rank r gets root's rows of block r (counts[r] rows).
SCATTERV = _spec("scatterv", lambda p: _counts(p)[_rank(p)],
                 lambda ct, params: _run("gatherv", ct, params),
                 _check_scatterv, has_root=True)
# alltoallv: rank r sends send_counts[j] rows to rank j and receives
# recv_counts[j] rows from rank j, stored in rank order; the transpose sends
# them back (counts swapped).
ALLTOALLV = _spec("alltoallv", lambda p: sum(p["ffi_args"][1 + p["size"]:]), _swap_counts,
                  _check_alltoallv)


@_compat.api_boundary
def gatherv(x, counts, root=0, *, comm=None):
    """Every rank's rows, in rank order, on root; zeros elsewhere (MPI_Gatherv).

    counts: a static tuple, rows per rank; x on rank r has shape (counts[r], *s).
    Output: (sum(counts), *s) on every rank.
    """
    return bind(GATHERV, x, comm=comm, root=root, static=(("counts", _static(counts)),))


@_compat.api_boundary
def allgatherv(x, counts, *, comm=None):
    """Every rank's rows, in rank order, on every rank (MPI_Allgatherv).

    counts: a static tuple, rows per rank; x on rank r has shape (counts[r], *s).
    Output: (sum(counts), *s).
    """
    return bind(ALLGATHERV, x, comm=comm, static=(("counts", _static(counts)),))


@_compat.api_boundary
def scatterv(x, counts, root=0, *, comm=None):
    """Rank r gets rows [sum(counts[:r]), sum(counts[:r+1])) of root's x (MPI_Scatterv).

    x: (sum(counts), *s) on every rank (only root's content is used).
    Output: (counts[r], *s).
    """
    return bind(SCATTERV, x, comm=comm, root=root, static=(("counts", _static(counts)),))


@_compat.api_boundary
def alltoallv(x, send_counts, recv_counts, *, comm=None):
    """Rank r sends send_counts[j] rows of x to rank j, in order, and receives
    recv_counts[j] rows from rank j (MPI_Alltoallv).

    x: (sum(send_counts), *s); output: (sum(recv_counts), *s), rows by source
    rank.  Both tuples are this rank's own: send_counts[j] on rank r must equal
    recv_counts[r] on rank j (check mode verifies it).
    """
    return bind(ALLTOALLV, x, comm=comm, static=(
        ("send_counts", _static(send_counts)), ("recv_counts", _static(recv_counts))))

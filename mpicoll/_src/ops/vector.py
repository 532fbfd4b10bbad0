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

from .collectives import ALLREDUCE
from ..primitive import spec
from ..runtime import dtypes
from ..primitive.dispatch import bind
from ..primitive.define import define
from ..primitive.spec import Collective, rank as _rank

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
        ct = ALLREDUCE.run(ct, params, op=dtypes.SUM, ffi_args=())
    counts, rank = _counts(params), _rank(params)
    start = sum(counts[:rank])
    return ct[start:start + counts[rank]]


def _swap_counts(ct, params):
    args, size = params["ffi_args"], params["size"]
    return ALLTOALLV.run(ct, params, ffi_args=(args[0], *args[1 + size:], *args[1:1 + size]))


def _vector_collective(name, out_rows, transpose, check, **flags):
    return define(Collective(
        name,
        out_shape=lambda shape, params: (out_rows(params), *shape[1:]),
        transpose=transpose,
        family="vector",
        check=check,
        batch=_batch,
        **flags))


# gatherv: root gets every rank's rows in rank order, zeros elsewhere.
GATHERV = _vector_collective("gatherv", lambda p: sum(_counts(p)),
                lambda ct, params: SCATTERV.run(ct, params),
                _check_own("gatherv"), has_root=True)
# allgatherv: every rank gets every rank's rows (one value); the transpose is
# the rank's own rows, as for allgather.
ALLGATHERV = _vector_collective("allgatherv", lambda p: sum(_counts(p)), _own_slice,
                   _check_own("allgatherv"), replicates=True)
# scatterv: rank r gets root's rows of block r (counts[r] rows).
SCATTERV = _vector_collective("scatterv", lambda p: _counts(p)[_rank(p)],
                 lambda ct, params: GATHERV.run(ct, params),
                 _check_scatterv, has_root=True)
# alltoallv: rank r sends send_counts[j] rows to rank j and receives
# recv_counts[j] rows from rank j, stored in rank order; the transpose sends
# them back (counts swapped).
ALLTOALLV = _vector_collective("alltoallv", lambda p: sum(p["ffi_args"][1 + p["size"]:]), _swap_counts,
                  _check_alltoallv)


# What the four have in common, put into each docstring by _contract.
_X_ROWS = spec.paragraph(
    f"One array (not a pytree) of a supported dtype ({dtypes.dtype_names()}), with a "
    "leading axis of rows; the rest of the shape, s, and the dtype are the same on every "
    "rank.")

_COMM = """an mpi4py intracommunicator; None (the default) means
            MPI.COMM_WORLD."""

_RAISES = """TypeError, ValueError: the same on every rank and before any MPI
            call, for counts that are not one static int >= 0 per rank of
            comm (adding up to at most 2**31 - 1), a root out of range, a
            pytree, a 0-d x, an unsupported dtype, or a comm that is not an
            intracommunicator.
        jax.errors.JaxRuntimeError: on every rank, when the ranks' calls
            differ (the counts included), and when MPI fails."""

_OWN_ROWS = """ValueError: when x's leading length is not {rows}: the one check
            that depends on the rank, so only this rank finds it.  With the
            checks across ranks on (the default, at each call site's first
            run) every rank raises jax.errors.JaxRuntimeError naming the
            rejection instead (this rank chains its ValueError); with them
            off only this rank raises, and its partners' call waits (abort on
            error, the default with several ranks, ends the job)."""

_RULES = """Blocks are stored contiguously in rank order (the displacements
        are the running sums of the counts).  Eager and under jax.jit, vmap
        (one call for the batch) and autodiff (docs/autodiff.md); no pytrees
        and no axis_name form.  One MPI call moves the whole buffers."""


_contract = spec.documented({
    "x": _X_ROWS, "comm": _COMM, "raises": _RAISES, "rules": _RULES,
    "own_rows:counts": _OWN_ROWS.format(rows="counts[rank]"),
    "own_rows:send_counts": _OWN_ROWS.format(rows="sum(send_counts)")})


@_contract
def gatherv(x, counts, root=0, *, comm=None):
    """Every rank's rows, in rank order, on root; zeros elsewhere (MPI_Gatherv).

    Args:
        x: this rank's rows, shape (counts[rank], *s).
            {x}
        counts: how many rows each rank sends: a static tuple of ints, one
            per rank of comm, the same on every rank.
        root: the rank that receives, a static int (default 0).
        comm: {comm}
    Returns:
        On every rank, shape (sum(counts), *s), holding on root every rank's
        rows, rank 0's first (rank r's x is rows sum(counts[:r]) to
        sum(counts[:r+1]) - 1); zeros on the other ranks.  Linear; its
        transpose is the scatterv of the cotangent from root.
    Raises:
        {raises}
        {own_rows:counts}
    Note:
        {rules}

    Example (2 ranks)::

        x = jnp.full((rank + 1, 2), rank)           # 1 row on rank 0, 2 rows on rank 1
        mpicoll.gatherv(x, counts=(1, 2), root=0)
        # rank 0: [[0, 0], [1, 1], [1, 1]]; rank 1: zeros of shape (3, 2)
    """
    return bind(GATHERV, x, comm=comm, root=root, static=(("counts", _static(counts)),))


@_contract
def allgatherv(x, counts, *, comm=None):
    """Every rank's rows, in rank order, on every rank (MPI_Allgatherv).

    Args:
        x: this rank's rows, shape (counts[rank], *s).
            {x}
        counts: how many rows each rank sends: a static tuple of ints, one
            per rank of comm, the same on every rank.
        comm: {comm}
    Returns:
        On every rank, shape (sum(counts), *s), holding every rank's rows,
        rank 0's first (rank r's x is rows sum(counts[:r]) to sum(counts[:r+1]) - 1).
        Linear; its transpose is each rank's own rows of the cotangent.
    Raises:
        {raises}
        {own_rows:counts}
    Note:
        {rules}

    Example (2 ranks)::

        x = jnp.full((rank + 1, 2), rank)           # 1 row on rank 0, 2 rows on rank 1
        mpicoll.allgatherv(x, counts=(1, 2))        # [[0, 0], [1, 1], [1, 1]] on both
    """
    return bind(ALLGATHERV, x, comm=comm, static=(("counts", _static(counts)),))


@_contract
def scatterv(x, counts, root=0, *, comm=None):
    """Rank r gets rows sum(counts[:r]) to sum(counts[:r+1]) - 1 of root's x (MPI_Scatterv).

    Args:
        x: shape (sum(counts), *s) on every rank; only root's values are read.
            {x}
        counts: how many rows each rank receives: a static tuple of ints, one
            per rank of comm, the same on every rank.
        root: the rank whose x is scattered, a static int (default 0).
        comm: {comm}
    Returns:
        On rank r, shape (counts[r], *s), holding rank r's block of root's
        rows.
        Linear; its transpose is the gatherv of the cotangents to root.
    Raises:
        {raises}
        ValueError: the same on every rank, for an x without sum(counts) rows.
    Note:
        {rules}

    Example (2 ranks)::

        x = jnp.arange(3.0)                         # read on root only
        mpicoll.scatterv(x, counts=(1, 2), root=0)  # rank 0: [0.]; rank 1: [1., 2.]
    """
    return bind(SCATTERV, x, comm=comm, root=root, static=(("counts", _static(counts)),))


@_contract
def alltoallv(x, send_counts, recv_counts, *, comm=None):
    """Rank r sends send_counts[j] rows to rank j and receives recv_counts[j] (MPI_Alltoallv).

    Args:
        x: this rank's rows for every rank in rank order, shape
            (sum(send_counts), *s): send_counts[0] rows for rank 0 first.
            {x}
        send_counts: the rows this rank sends to each rank: a static tuple of
            ints, one per rank of comm.
        recv_counts: the rows this rank receives from each rank, likewise.
            Both are this rank's own: send_counts[j] on rank r must equal
            recv_counts[r] on rank j (the checks across ranks verify it when
            they compare the call, and every rank raises, naming the pair).
        comm: {comm}
    Returns:
        On every rank, shape (sum(recv_counts), *s), holding the rows from
        each rank, rank 0's first.  Linear; its transpose is the alltoallv of the
        cotangents with the counts swapped.
    Raises:
        {raises}
        {own_rows:send_counts}
    Note:
        {rules}

    Example (2 ranks)::

        send = (1, 2) if rank == 0 else (1, 1)      # rank 0: 1 row to itself, 2 to rank 1
        recv = (1, 1) if rank == 0 else (2, 1)      # what the other side sends here
        x = jnp.full((sum(send), 2), rank)
        mpicoll.alltoallv(x, send, recv)
        # rank 0: [[0, 0], [1, 1]]; rank 1: [[0, 0], [0, 0], [1, 1]]
    """
    return bind(ALLTOALLV, x, comm=comm, static=(
        ("send_counts", _static(send_counts)), ("recv_counts", _static(recv_counts))))

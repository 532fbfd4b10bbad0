"""The rank-block collectives: shape rules and autodiff, one spec each.

bcast, scatter, reduce, allreduce, gather, allgather, alltoall,
reduce_scatter, scan and exscan move equal blocks per rank (MPI's plain
collectives); pytrees of them fuse into one message per dtype (primitive/dispatch.py).
Each spec is a row of csrc/ops.def on the C++ side.
"""

import jax.numpy as jnp

from .. import _compat
from ..runtime import dtypes
from ..primitive.define import define
from ..primitive.spec import Collective, rank as _rank
from ..primitive.varying import pvary_p

_SUM = dtypes.SUM
_OP_NAMES = dtypes.OP_NAMES


def reduction_tangent(name, op, x, selected, t, summed, gathered, own_row):
    """The derivative of a reduction with the non-linear op (min, max, prod) over
    some participants, linear in the tangent t: summed(v) sums v over them,
    gathered() stacks every participant's x, own_row() is this participant's
    place in that stack, selected is the min or max (reduce asks for it).  The
    other reductions differentiate op="sum" only.  Shared by the rank-block
    collectives here and the local meeting's allreduce (ops/local_meeting.py)."""
    if op in ("min", "max"):
        # Like jnp.max: the selected elements' tangents, ties sharing equally.
        chosen = (x == selected()).astype(t.dtype)
        count = summed(chosen)
        return summed(t * chosen) * jnp.where(count > 0, 1 / jnp.where(count > 0, count, 1), 0)
    if op == "prod":
        # d(prod_p x_p) = sum_p (product of the others' x) * t_p: exact with zeros.
        everyone = gathered()
        own = (jnp.arange(everyone.shape[0]) == own_row()).reshape((-1,) + (1,) * x.ndim)
        others = jnp.prod(jnp.where(own, jnp.ones_like(everyone), everyone), axis=0)
        return summed(others * t)
    raise NotImplementedError(f"mpicoll.{name}: op={op!r} has no derivative")


def _reduction_tangent(spec, x, y, t, params):
    """reduction_tangent for reduce and allreduce (`spec`) across the ranks."""
    return reduction_tangent(
        spec.name, _OP_NAMES[params["op"]], x,
        lambda: y if spec is ALLREDUCE else ALLREDUCE.run(x, params), t,
        lambda v: spec.run(v, params, op=_SUM), lambda: ALLGATHER.run(x, params, op=-1),
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

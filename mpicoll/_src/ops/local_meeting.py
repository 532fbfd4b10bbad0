"""Collectives over every local device of several processes, run in ONE
mechanism: the L device threads meet in mpicoll's handler (csrc/meeting/), the
process's MPI work runs inside that meeting, every device takes its part.

    kind            x (per device)       result (per device)    MPI, per process
    allreduce       a block, any op      the reduction          MPI_Allreduce (one, or
                                                                one per device on its
                                                                1/L slice: split)
    allgather       a block              (P*L, *block)          MPI_Allgather, L blocks each
    reduce_scatter  (P*L, *block), op    its block              reduce-scatter, L blocks each
    alltoall        (P*L, *block)        (P*L, *block)          MPI_Alltoall, L*L blocks each
    permute         a block              the block sent to it   MPI_Alltoallv of the pairs
    bcast           a block              the root's block       MPI_Bcast
    reduce          a block, sum         the sum at the root    MPI_Reduce (bcast's transpose)

The kinds are a table the extension owns (csrc/meeting/kinds.def); KINDS below
is read from it.  Rows are numbered rank-major, row r * L + k for local device k
of rank r of the communicator (k counts the devices of one group, where a
process's devices meet in several: a mesh axis that takes some of them);
callers reorder rows to their axes' order around the call
(over_ranks/lax.py, _Participants).  Each rank sends the bytes of the direct
collective over its P*L participants whatever L is.  CPU only (the handler
reads the devices' buffers on the host).

Why it cannot deadlock: every call is chained by mpicoll's ordered effect, so
each device thread enters the meetings in program order, and every MPI call of
a meeting runs while all of this process's devices are inside it
(docs/design.md, "Ranks x devices: why it cannot deadlock").

Typed like JAX's psum, all_gather, psum_scatter, all_to_all, ppermute and
pbroadcast: allreduce's result is invariant over the local axis (and, where
typed, over the ranks), the others vary over the communicator's axes unless
asked to be invariant (`invariant`: all_gather_invariant, mpicoll.bcast).
Every kind but allreduce with max/min/prod is linear; the transposes pair them
(allgather <-> reduce_scatter, alltoall and permute their own inverses, bcast
<-> reduce, allreduce(sum) itself), vmap moves the batch axis behind the rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from .._compat import unrouted_lax  # jax.lax over device axes, bypassing the router
from ..runtime import dtypes, comm as comm_layer, native
from ..primitive import varying
from ..primitive.define import (
    effectful_primitive, mpi_effect, ordered_ffi_call, reduction_tangent)
from ..primitive.spec import SPECS  # the rank-block collectives (ops/collectives.py), by name

# name -> (code, rows_in): the extension's table (csrc/meeting/kinds.def).
_TABLE = native.extension.meeting_kinds()
KINDS = {name: code for name, (code, _) in _TABLE.items()}
_ROWS_IN = {name for name, (_, rows_in) in _TABLE.items() if rows_in}  # one row per participant
_SUM = dtypes.SUM


def meet(x, kind, comm, local, *, pairs=(), root=0, groups=(), invariant=(), op=0,
         split=False, axis_name=None, whole=True):
    """`kind` over `local` devices (those the program runs on here, or one group
    of them) of every rank of `comm` (a CommInfo).

    pairs: permute's (source row, destination row); root: bcast's row; groups:
    each local device's group, where the devices meet in several (each over its
    own `local`); op: the reduction's code (allreduce, reduce_scatter); split:
    allreduce's MPI work on every device's own slice.  invariant: for a result
    typed invariant (all_gather_invariant, mpicoll.bcast), (the axes it is
    invariant over, the rank-major row of each participant in their order, or ()
    for rank * L + the index on the last of the axes).  axis_name: the local
    axis of mpicoll's ranks x devices collectives (None on a global mesh): the
    input is typed varying over it, as JAX's collective over it types it, and
    allreduce's result invariant.  whole (allreduce): the meeting is the entire
    collective over its axes (a global mesh's, or a process's devices alone)
    rather than mpicoll's ranks x devices one (axis_name=)."""
    params = dict(comm=comm.slot, size=comm.size, root=int(root), op=op,
                  transpose_sums=not _compat.check_vma_enabled(),
                  checked_ad=varying.autodiff_checked())
    if kind == "allreduce":
        params = varying.typed_params(params)
    elif axis_name is not None and _compat.check_vma_enabled():
        x = _compat.pvary(x, (axis_name,))
    x = varying.typed_input(x, comm)
    flat = tuple(int(index) for pair in pairs for index in pair)
    return local_meeting_p.bind(x, kind=kind, local=local, pairs=flat, groups=tuple(groups),
                                invariant=invariant, split=bool(split), axis_name=axis_name,
                                whole=whole, **params)


def _shape(shape, kind, participants):
    if kind == "allgather":
        return (participants, *shape)
    if kind == "reduce_scatter":
        return shape[1:]
    return shape


def _abstract_eval(x, *, kind, comm, size, local, invariant=(), axis_name=None, **params):
    if kind == "allreduce":
        # Like lax.psum/pmax/pmin: the same value on every local device,
        # invariant over the local axis; over the ranks as mpicoll's allreduce.
        if _compat.check_vma_enabled() and axis_name is not None:
            x = _compat.with_varying_axes(x, _compat.varying_axes(x) - {axis_name})
        return varying.typed_output(SPECS["allreduce"], x, x.shape,
                                    {"comm": comm, "size": size, **params}), {mpi_effect}
    out = _compat.aval_with_shape(x, _shape(x.shape, kind, size * local))
    axes = set(varying.typed_axes(comm))
    if invariant:  # the same rows on every participant of the axes
        out = _compat.with_varying_axes(out, _compat.varying_axes(x) - set(invariant[0]) - axes)
    elif axes:
        out = _compat.with_varying_axes(out, _compat.varying_axes(x) | axes)
    return out, {mpi_effect}


def _lowering(ctx, x, *, kind, comm, local, pairs, root, op, split, groups=(), **params):
    if kind == "reduce":
        op = dtypes.op_code("sum", ctx.avals_in[0].dtype, "psum")
    # In place for allreduce: a dead or donated x (a loop carry) is the output buffer.
    return ordered_ffi_call(ctx, "mpicoll_local_meeting", x,
                            aliases={1: 1} if kind == "allreduce" else None, comm=comm,
                            op=op, root=root, local=local, kind=KINDS[kind], split=int(split),
                            pairs=np.asarray(pairs, np.int64).reshape(-1),
                            groups=np.asarray(groups, np.int64).reshape(-1))


def _elsewhere(ctx, x, **params):
    raise NotImplementedError(
        "mpicoll's collectives over ranks x local devices meet the local devices on the host "
        "(CPU only); this program runs on another platform. On GPUs give a global mesh a "
        "process axis and a device axis and collect over the process axis, or use mpicoll's "
        "collectives with axis_name (traced for the GPU, they compose XLA's collectives over "
        "the devices with MPI)")


local_meeting_p = effectful_primitive("mpicoll_local_meeting", _abstract_eval, _lowering,
                                      lowerings={"cuda": _elsewhere})


def _batch(args, dims, *, kind, **params):
    x, (dim,) = args[0], dims
    if kind in _ROWS_IN and dim == 0:  # the rows stay first
        x, dim = jax.numpy.moveaxis(x, 0, 1), 1
    out = local_meeting_p.bind(x, kind=kind, **params)
    return out, {"allgather": dim + 1, "reduce_scatter": dim - 1}.get(kind, dim)


def _rebind(x, **params):
    """The same meeting on another value (a tangent, a cotangent), typed as its input."""
    x = varying.typed_input(x, comm_layer.info_for_slot(params["comm"]))
    return local_meeting_p.bind(x, **params)


def _own_row(params):
    """This participant's rank-major row (r * L + k), traced."""
    axes, rows = params["invariant"] or ((params["axis_name"],), ())
    if rows:  # a global mesh: the axes' index, reordered rank-major
        return jnp.asarray(rows, jnp.int32)[unrouted_lax.axis_index(axes)]
    rank = comm_layer.info_for_slot(params["comm"]).rank
    return rank * params["local"] + unrouted_lax.axis_index(axes[-1])


def _allreduce_tangent(x, y, t, params):
    """The derivative of allreduce with a non-linear op, each piece a meeting."""
    op = dtypes.OP_NAMES[params["op"]]
    if params["whole"]:
        raise NotImplementedError(
            f"jax.lax.p{op} over axes spanning processes has no derivative (JAX defines "
            "none for pmax and pmin)")
    return reduction_tangent(
        "allreduce", op, x, lambda: y, t, lambda v: _rebind(v, **{**params, "op": _SUM}),
        lambda: _rebind(x, **{**params, "kind": "allgather", "op": 0, "split": False}),
        lambda: _own_row(params))


def _jvp(primals, tangents, *, kind, **params):
    (x,), (t,) = primals, tangents
    y = local_meeting_p.bind(x, kind=kind, **params)
    if type(t) is _compat.Zero:
        return y, _compat.zero_tangent(jax.typeof(y))
    if kind == "allreduce" and params["op"] != _SUM:
        return y, _allreduce_tangent(x, y, t, {**params, "kind": kind})
    if kind == "reduce_scatter" and params["op"] != _SUM:
        raise NotImplementedError(f"mpicoll.reduce_scatter: op={dtypes.OP_NAMES[params['op']]!r} "
                                  "has no derivative (op='sum' has)")
    return y, local_meeting_p.bind(t, kind=kind, **params)  # linear


_TRANSPOSED = {"allgather": "reduce_scatter", "reduce_scatter": "allgather",
               "alltoall": "alltoall", "permute": "permute", "bcast": "reduce", "reduce": "bcast",
               "allreduce": "allreduce"}


def _transpose(ct, x, *, kind, pairs, invariant=(), **params):
    if type(ct) is _compat.Zero:
        return [_compat.zero_tangent(x.aval)]
    params = {**params, "invariant": invariant}
    varying.check_reverse_mode(kind, params)  # outside mesh(), as every collective's
    if kind == "allreduce":  # the sum (the other ops are not linear)
        if params["transpose_sums"]:  # pmap-style: psum transposes to psum
            return [_rebind(ct, kind=kind, pairs=pairs, **params)]
        ct = varying.typed_like(ct, x.aval, params)  # check_vma: to pvary
        local_axis = params["axis_name"]
        if (not params["whole"] and local_axis in _compat.varying_axes(x.aval)
                and local_axis not in _compat.varying_axes(jax.typeof(ct))):
            ct = _compat.pvary(ct, (local_axis,))
        return [ct]
    if invariant:  # the result is the same on every participant: its cotangent counts once
        own = _own_row(params)
        if kind == "allgather":  # JAX's all_gather_invariant's: this participant's own row
            return [varying.typed_like(lax.dynamic_index_in_dim(ct, own, 0, keepdims=False),
                                       x.aval, params)]
        if kind == "bcast":  # the root's input alone
            return [varying.typed_like(jnp.where(own == params["root"], ct, jnp.zeros_like(ct)),
                                       x.aval, params)]
    inverse = tuple(value for s, d in zip(pairs[::2], pairs[1::2]) for value in (d, s))
    return [_rebind(ct, kind=_TRANSPOSED[kind], pairs=inverse,
                    **{**params, "invariant": ()})]


_compat.register_batching(local_meeting_p, _batch)
_compat.register_jvp(local_meeting_p, _jvp)
_compat.register_transpose(local_meeting_p, _transpose)

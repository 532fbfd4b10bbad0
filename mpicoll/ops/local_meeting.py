"""Collectives over every local device of several processes, moved by ONE MPI
collective per process: the L device threads meet in mpicoll's handler
(csrc/local_meeting.cc), the lowest device packs the process's data into one
buffer and runs the MPI collective, every device takes its part.

    kind            x (per device)       result (per device)    MPI, once per process
    allgather       a block              (P*L, *block)          MPI_Allgather, L blocks each
    reduce_scatter  (P*L, *block), sum   its block              reduce-scatter, L blocks each
    alltoall        (P*L, *block)        (P*L, *block)          MPI_Alltoall, L*L blocks each
    permute         a block              the block sent to it   MPI_Alltoallv of the pairs
    bcast           a block              the root's block       MPI_Bcast
    reduce          a block, sum         the sum at the root    MPI_Reduce (bcast's transpose)

Rows are numbered rank-major, row r * L + k for local device k of rank r of
the communicator (k counts the devices of one group, where a process's
devices meet in several: a mesh axis that takes some of them); callers reorder rows to their axes' order around the call
(_lax_over_ranks._Participants).  Each rank sends the bytes of the direct
collective over its P*L participants whatever L is (the sum of placed rows it
replaces sent P*L times that; issue 34).  CPU only (the handler reads the
devices' buffers on the host).

Typed like JAX's all_gather, psum_scatter, all_to_all, ppermute and
pbroadcast: the result varies over the communicator's axes.  Every kind is
linear; its transpose is another kind (allgather <-> reduce_scatter, alltoall
and permute their own inverses, bcast <-> reduce), vmap moves the batch axis
behind the rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from ..runtime import dtypes as _types, comm as comm_layer
from ..primitive import varying as _typing
from ..primitive.define import effectful_primitive, mpi_effect, ordered_ffi_call

# The handler's kind codes (csrc/local_meeting.cc, MeetingKind).
KINDS = {"allreduce": 0, "allgather": 1, "reduce_scatter": 2, "alltoall": 3, "permute": 4,
         "bcast": 5, "reduce": 6}
_ROWS_IN = ("reduce_scatter", "alltoall")  # x holds one row per participant


def meet(x, kind, comm, local, *, pairs=(), root=0, groups=(), invariant=()):
    """`kind` over `local` devices (those the program runs on here, or one group
    of them) of every rank of `comm` (a CommInfo); pairs: permute's (source row,
    destination row); root: bcast's row; groups: each local device's group,
    where the devices meet in several groups (each over its own `local`).
    invariant: for an allgather typed invariant over mesh axes (JAX's
    all_gather_invariant), a tuple (those axes, the rank-major row of each
    participant in their order); its transpose is then this participant's own row."""
    x = _typing.typed_input(x, comm)
    flat = tuple(int(index) for pair in pairs for index in pair)
    return local_meeting_p.bind(x, kind=kind, comm=comm.slot, size=comm.size, local=local,
                                pairs=flat, root=int(root), groups=tuple(groups),
                                invariant=invariant)


def _shape(shape, kind, participants):
    if kind == "allgather":
        return (participants, *shape)
    if kind == "reduce_scatter":
        return shape[1:]
    return shape


def _abstract_eval(x, *, kind, comm, size, local, invariant=(), **params):
    out = _compat.aval_with_shape(x, _shape(x.shape, kind, size * local))
    if invariant:  # the same gathered rows on every participant of the axes
        out = _compat.with_varying_axes(out, _compat.varying_axes(x) - set(invariant[0]))
    elif axes := set(_typing.typed_axes(comm)):
        out = _compat.with_varying_axes(out, _compat.varying_axes(x) | axes)
    return out, {mpi_effect}


def _lowering(ctx, x, *, kind, comm, local, pairs, root, groups=(), invariant=(), **params):
    op = _types.op_code("sum", ctx.avals_in[0].dtype, "psum") if kind in (
        "reduce_scatter", "reduce") else 0
    return ordered_ffi_call(ctx, "mpicoll_local_meeting", x, comm=comm, op=op, root=root,
                            local=local, kind=KINDS[kind],
                            pairs=np.asarray(pairs, np.int64).reshape(-1),
                            groups=np.asarray(groups, np.int64).reshape(-1))


def _elsewhere(ctx, x, **params):
    raise NotImplementedError(
        "jax.lax collectives over axes that span processes and their devices meet the local "
        "devices on the host (CPU only); on GPUs give the mesh a process axis and a device "
        "axis and collect over the process axis, or use mpicoll's collectives with axis_name")


local_meeting_p = effectful_primitive("mpicoll_local_meeting", _abstract_eval, _lowering,
                                      lowerings={"cuda": _elsewhere})


def _batch(args, dims, *, kind, **params):
    x, (dim,) = args[0], dims
    if kind in _ROWS_IN and dim == 0:  # the rows stay first
        x, dim = jax.numpy.moveaxis(x, 0, 1), 1
    out = local_meeting_p.bind(x, kind=kind, **params)
    return out, {"allgather": dim + 1, "reduce_scatter": dim - 1}.get(kind, dim)


def _jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    y = local_meeting_p.bind(x, **params)
    if type(t) is _compat.Zero:
        return y, _compat.zero_tangent(jax.typeof(y))
    return y, local_meeting_p.bind(t, **params)  # linear


_TRANSPOSED = {"allgather": "reduce_scatter", "reduce_scatter": "allgather",
               "alltoall": "alltoall", "permute": "permute", "bcast": "reduce", "reduce": "bcast"}


def _transpose(ct, x, *, kind, pairs, invariant=(), **params):
    if type(ct) is _compat.Zero:
        return [_compat.zero_tangent(x.aval)]
    if invariant:  # JAX's all_gather_invariant's: this participant's own row, no traffic
        axes, rows = invariant
        own = jnp.asarray(rows, jnp.int32)[lax.axis_index(axes)]
        return [lax.dynamic_index_in_dim(ct, own, 0, keepdims=False)]
    inverse = tuple(value for s, d in zip(pairs[::2], pairs[1::2]) for value in (d, s))
    info = comm_layer.info_for_slot(params["comm"])
    ct = _typing.typed_input(ct, info)
    return [local_meeting_p.bind(ct, kind=_TRANSPOSED[kind], pairs=inverse, **params)]


_compat.register_batching(local_meeting_p, _batch)
_compat.register_jvp(local_meeting_p, _jvp)
_compat.register_transpose(local_meeting_p, _transpose)

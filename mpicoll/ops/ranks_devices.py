"""Collectives over every device of every process: ranks x local devices.

Inside pmap or shard_map over the L local devices of each of `size` ranks,
`axis_name` names the local device axis.  The global op spans all size*L
participants, ordered by (rank, local index): participant p = rank * L + k.
Each is composed of a lax collective over the local devices and an mpicoll
per-device collective across ranks (device k of every rank talks on its own
communicator, all devices in parallel):

  allreduce  combine (CPU, up to local_combine_bytes(L)): the device threads combine
             their data in mpicoll's handler, one MPI allreduce for all of them.
             Otherwise (GPU, mpicoll.overlap(), larger arrays), by size:
             small: psum over devices, then MPI allreduce on every device.
             split (from split_allreduce_bytes(L)): psum_scatter over devices, MPI
             allreduce of 1/L of the data per device (all devices in parallel),
             all_gather over devices.
  allgather  MPI allgather of each device's own x, then all_gather over devices.
  alltoall   all_to_all over devices, then MPI alltoall across ranks.
  bcast      the root device's x to its rank's devices, then MPI bcast per device.
  reduce_scatter  reduce-scatter over devices (each device keeps the rows of
             its own local index, for every rank), then MPI reduce_scatter.

Autodiff and vmap follow the matching lax collective over one axis spanning all
participants: the lax pieces bring their own rules (the combine's derivative
is the composition's), and the MPI pieces are told
(transpose_sums) whether cotangents of replicated values are summed (pmap,
shard_map(check_vma=False)) or taken once (shard_map with check_vma).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import blocks as _blocks, local_meeting as _local_meeting
from .. import _compat
from ..runtime import settings as _settings, dtypes as _types, comm as comm_layer
from ..primitive import varying as _typing, validate as _validate, overlap
from ..primitive.dispatch import bind
from ..primitive.define import effectful_primitive, mpi_effect, ordered_ffi_call

_SUM = _types.SUM

# Above split_allreduce_bytes(L) per device, allreduce splits the MPI work over
# the L devices (reduce-scatter / allreduce / all-gather) instead of every device
# allreducing the whole array.  Splitting takes (L - 1) * n bytes per call off
# each node's link (its devices send n bytes across nodes between them, not
# L * n) for an extra cost on the node (psum_scatter + all_gather instead of
# psum) that does not grow with L, so the crossover falls as 1 / (L - 1).
# SPLIT_ALLREDUCE_BYTES is the crossover measured at 2 devices on the simulated
# cluster (split slower at 128 KiB, faster from 1 MiB); at 8 devices split was
# 1.11-1.41x faster than small at 64 KiB there, and the cost model
# (benchmarks/allreduce_model.py, docs/design.md, "A cost model") puts the crossover at
# 4-19 KiB for 1,000 nodes x 8 devices.  256 KiB at 2 devices, 85 KiB at 4,
# 37 KiB at 8.  (The value at 2 devices: runtime/settings.py, MPICOLL_SPLIT_ALLREDUCE_BYTES.)


def _scaled_to(local, bytes_at_two_devices):
    """A threshold set at 2 devices, at `local` devices: it falls as 1 / (L - 1)."""
    return bytes_at_two_devices / max(local - 1, 1)


def split_allreduce_bytes(local):
    """Bytes per device above which the allreduce over `local` devices splits its MPI work."""
    return _scaled_to(local, _settings.current().split_allreduce_bytes)


def _local_axis_size(axis_name, caller):
    try:
        return lax.axis_size(axis_name)
    except (NameError, KeyError, ValueError) as error:
        raise ValueError(f"mpicoll.{caller}: axis_name={axis_name!r} is not a mapped axis here; "
                         "use it inside pmap or shard_map over the local devices") from error


def _reduction_arguments(x, op, comm, axis_name, caller):
    """(x as an array, the op checked for its dtype, the communicator, the local
    device count): the one check of op and comm on this path (the binds below
    take them as checked, runtime/dtypes.CheckedOp and comm.CommInfo)."""
    x = _validate.as_array(x, caller)
    op = _types.checked_op(op, x.dtype, caller)
    return x, op, comm_layer.resolve(comm, caller), _local_axis_size(axis_name, caller)


def allreduce(x, op, comm, axis_name):
    x, op, info, local = _reduction_arguments(x, op, comm, axis_name, "allreduce")
    if _combines_in_handler(x, local):
        return combined_allreduce(x, op, info, axis_name)
    return _composed_allreduce(x, op, info, axis_name)


def _composed_allreduce(x, op, comm, axis_name):
    """The lax collective over the local devices, then the per-device MPI allreduce."""
    local = lax.axis_size(axis_name)
    vma = _compat.check_vma_enabled()
    # psum's transpose is psum under pmap, and pvary (identity) with check_vma.
    per_rank = functools.partial(bind, _blocks.ALLREDUCE, op=op, comm=comm,
                                 transpose_sums=not vma)
    if op.name != "sum":
        # Every device reduces the same gathered rows, so the result is typed
        # invariant over the local axis, as lax.pmax's is (its derivative then
        # reaches the device whose element won).
        gathered = (_compat.all_gather_invariant if vma else lax.all_gather)(x, axis_name)
        combined = functools.reduce(_types.elementwise(op.name),
                                    [gathered[k] for k in range(local)])
        return per_rank(combined.astype(x.dtype))
    if local == 1 or x.size * x.dtype.itemsize < split_allreduce_bytes(local):
        return per_rank(lax.psum(x, axis_name))
    flat = x.reshape(-1)
    padded = -flat.size % local
    flat = jnp.pad(flat, (0, padded))
    mine = lax.psum_scatter(flat, axis_name, tiled=True)  # this device's 1/L, summed locally
    mine = per_rank(mine)  # every device allreduces its own part across ranks, in parallel
    gather = _compat.all_gather_invariant if vma else lax.all_gather
    full = gather(mine, axis_name, tiled=True)
    return full[:x.size].reshape(x.shape)


# ---------------------------------------------------------------------------
# Small arrays: the L device threads combine their data in mpicoll's own
# handler (csrc/local_meeting.cc, CpuLocalMeetingEntry: a meeting of the local
# threads, one MPI allreduce by one of them), instead of XLA's collective over
# the local devices followed by L MPI allreduces.  Measured at 2 ranks x 2
# devices on 2 cores (Open MPI 4.1, float32 sum, jitted loop of 100, medians
# of 15, slowest rank; benchmarks/global_allreduce.py --combine-bytes 2000000),
# us per allreduce:
#   bytes/device   combined here   lax composition   per-device MPI alone
#   4 B                 18.6            3,010              20.4   (default run)
#   4 KiB               22.1              688             119
#   64 KiB               129            5,950           2,170
#   256 KiB              217            7,520           7,310
#   1 MiB                618            8,270          11,530
# XLA's rendezvous, and L threads each in its own MPI call, lose most when the
# device threads outnumber the cores; the combine wins at every size measured,
# so the threshold is the largest size measured.  Above it the composition
# (split MPI work over the devices) is kept for machines with cores to spare.
# CPU only (the handler reads the device buffers on the host), and not inside
# mpicoll.overlap() (whose calls run on progress threads; the composition
# overlaps instead).  Read when a call is traced.
# With more devices the split path wins earlier: on the simulated cluster at 8
# devices per host (benchmarks/multihost_allreduce.sh) the combine was 1.7x
# faster than split at 64 KiB and split 1.14-1.38x faster at 256 KiB and
# 1.21-1.24x at 1 MiB; the cost model puts the crossover at 437 KiB for 4
# devices and 130 KiB for 8.  So the threshold, like the split's, falls as
# 1 / (L - 1): 1 MiB at 2 devices, 341 KiB at 4, 146 KiB at 8.
# (The value at 2 devices, 1 MiB: runtime/settings.py, MPICOLL_LOCAL_COMBINE_BYTES.)


def local_combine_bytes(local):
    """Bytes per device up to which the allreduce over `local` devices combines in the handler."""
    return _scaled_to(local, _settings.current().local_combine_bytes)


def _combines_in_handler(x, local):
    return (local > 1 and x.size * x.dtype.itemsize <= local_combine_bytes(local)
            and not overlap.active() and jax.default_backend() == "cpu")


def combined_allreduce(x, op, info, axis_name, whole=False, local=None, groups=()):
    """whole: the combine is the entire collective over axis_name (its every
    participant is a device of a rank of info), not a step of the composition
    over a local axis: a global mesh's axes that span processes and their
    devices, or a process's devices alone, where XLA's own collectives would be
    JAX's cross-process ones.  local, groups: the devices that meet per rank,
    and each device's group where several groups meet apart (ops/local_meeting.py)."""
    params = dict(comm=info.slot, size=info.size, root=0,
                  op=_types.op_code(op, x.dtype, "allreduce"),
                  transpose_sums=not _compat.check_vma_enabled(),
                  checked_ad=_typing.autodiff_checked())
    x, params = _typing.typed_input(x, info), _typing.typed_params(params)
    if local is None:
        local = jax.local_device_count() if whole else lax.axis_size(axis_name)
    return combined_allreduce_p.bind(x, axis_name=axis_name, local=local, whole=whole,
                                     groups=tuple(groups), **params)


def _combined_abstract_eval(x, *, axis_name, local, op, **params):
    # Typed like the composition, and like lax.psum/pmax/pmin: the value is the
    # same on every local device, invariant over the local axis.
    if _compat.check_vma_enabled():
        x = _compat.with_varying_axes(x, _compat.varying_axes(x) - {axis_name})
    return _typing.typed_output(_blocks.ALLREDUCE, x, x.shape, params), {mpi_effect}


def _combined_lowering(ctx, x, *, comm, op, local, groups=(), **params):
    # In place: a dead or donated x (a loop carry) is the output buffer.
    return ordered_ffi_call(ctx, "mpicoll_local_meeting", x, aliases={1: 1}, comm=comm,
                            op=op, root=0, local=local, kind=_local_meeting.KINDS["allreduce"],
                            pairs=np.zeros(0, np.int64), groups=np.asarray(groups, np.int64))


def _combined_elsewhere(ctx, x, **params):
    raise NotImplementedError(
        "mpicoll.allreduce: the ranks x devices allreduce of small arrays combines the local "
        "devices on the host (CPU only); this program runs on another platform. Trace it "
        "inside mpicoll.runtime.settings.override(local_combine_bytes=0) (or set "
        "MPICOLL_LOCAL_COMBINE_BYTES=0) to use XLA's collectives there")


combined_allreduce_p = effectful_primitive(
    "mpicoll_allreduce_local", _combined_abstract_eval, _combined_lowering,
    lowerings={"cuda": _combined_elsewhere})


def _combined_batch(args, dims, **params):
    # Elementwise across participants: the batch axis stays where it is.
    return combined_allreduce_p.bind(args[0], **params), dims[0]


def _combined_jvp(primals, tangents, *, axis_name, comm, op, **params):
    """The composition's derivative (its lax and MPI pieces bring the transpose rules)."""
    (x,), (t,) = primals, tangents
    y = combined_allreduce_p.bind(x, axis_name=axis_name, comm=comm, op=op, **params)
    if type(t) is _compat.Zero:
        return y, _compat.zero_tangent(jax.typeof(y))
    if params["whole"]:
        if op != _SUM:
            raise NotImplementedError(
                f"jax.lax.p{_types.OP_NAMES[op]} over axes spanning processes has no "
                "derivative (JAX defines none for pmax and pmin)")
        return y, combined_allreduce_p.bind(t, axis_name=axis_name, comm=comm, op=op, **params)
    composed = functools.partial(_composed_allreduce,
                                 op=_types.checked_op(_types.OP_NAMES[op], x.dtype, "allreduce"),
                                 comm=comm_layer.info_for_slot(comm), axis_name=axis_name)
    if op == _SUM:  # linear
        return y, composed(t)
    return y, jax.jvp(composed, (x,), (t,))[1]


def _combined_transpose(ct, x, *, axis_name, comm, op, transpose_sums, **params):
    """The sum's transpose where the combine is the whole collective (the
    composition's pieces bring their own): psum's under each typing."""
    assert params["whole"] and op == _SUM, "only the whole sum is transposed"
    if type(ct) is _compat.Zero:
        return [_compat.zero_tangent(x.aval)]
    if transpose_sums:  # pmap-style: psum transposes to psum
        return [combined_allreduce_p.bind(ct, axis_name=axis_name, comm=comm, op=op,
                                          transpose_sums=transpose_sums, **params)]
    return [_typing.typed_like(ct, x.aval, {"comm": comm})]  # check_vma: to pvary


_compat.register_batching(combined_allreduce_p, _combined_batch)
_compat.register_jvp(combined_allreduce_p, _combined_jvp)
_compat.register_transpose(combined_allreduce_p, _combined_transpose)


def allgather(x, comm, axis_name):
    x = _validate.as_array(x, "allgather")
    local = _local_axis_size(axis_name, "allgather")
    # lax.all_gather transposes to psum_scatter: the MPI part sums over ranks too.
    across_ranks = bind(_blocks.ALLGATHER, x, comm=comm, transpose_sums=True)
    everything = lax.all_gather(across_ranks, axis_name)  # (L, size, *s)
    size = across_ranks.shape[0]
    return jnp.swapaxes(everything, 0, 1).reshape((size * local, *x.shape))


def _participant_blocks(x, info, local, caller):
    """x of shape (size * local devices, *s), checked, as (size, local devices, *s)."""
    participants = info.size * local
    if x.ndim == 0 or x.shape[0] != participants:
        raise ValueError(f"mpicoll.{caller}: with axis_name, x must have shape (size * local "
                         f"devices, ...) = ({participants}, ...), got {tuple(x.shape)}")
    return x.reshape((info.size, local, *x.shape[1:]))


def alltoall(x, comm, axis_name):
    x = _validate.as_array(x, "alltoall")
    info = comm_layer.resolve(comm, "alltoall")
    local = _local_axis_size(axis_name, "alltoall")
    blocks = _participant_blocks(x, info, local, "alltoall")  # [dest rank, dest device]
    # Device k' receives, from every local device k, the rows meant for devices k':
    # [dest rank, src device].
    blocks = lax.all_to_all(blocks, axis_name, split_axis=1, concat_axis=1)
    blocks = bind(_blocks.ALLTOALL, blocks, comm=info)  # [src rank, src device]
    return blocks.reshape(x.shape)


def bcast(x, root, comm, axis_name):
    x = _validate.as_array(x, "bcast")
    info = comm_layer.resolve(comm, "bcast")
    local = _local_axis_size(axis_name, "bcast")
    root = _validate.check_root(
        root, info.size * local, "bcast",
        among=f"{info.size} rank(s) x {local} local device(s) = {info.size * local} participants")
    root_rank, root_device = divmod(root, local)
    vma = _compat.check_vma_enabled()
    mask = lax.axis_index(axis_name) == root_device
    on_rank = lax.psum(jnp.where(mask, x, jnp.zeros_like(x)), axis_name)
    return bind(_blocks.BCAST, on_rank.astype(x.dtype), comm=info, root=root_rank,
                transpose_sums=not vma)


def reduce_scatter(x, op, comm, axis_name):
    x, op, info, local = _reduction_arguments(x, op, comm, axis_name, "reduce_scatter")
    blocks = _participant_blocks(x, info, local, "reduce_scatter")  # [dest rank, dest device]
    if op.name == "sum":
        # Device k keeps, for every rank, the rows meant for local device k, summed locally.
        mine = lax.psum_scatter(blocks, axis_name, scatter_dimension=1)  # [dest rank, ...]
    else:
        everything = lax.all_to_all(blocks, axis_name, split_axis=1, concat_axis=1)
        # [dest rank, source device]: combine over the local source devices
        mine = functools.reduce(_types.elementwise(op.name),
                                [everything[:, k] for k in range(local)])
        mine = mine.astype(x.dtype)
    vma = _compat.check_vma_enabled()
    return bind(_blocks.REDUCE_SCATTER, mine, op=op, comm=info, transpose_sums=not vma)

"""Collectives over every device of every process: ranks x local devices.

Inside pmap or shard_map over the L local devices of each of `size` ranks,
`axis_name` names the local device axis.  The global op spans all size*L
participants, ordered by (rank, local index): participant p = rank * L + k.

On CPU every one of them is ONE mechanism, the local meeting
(ops/local_meeting.py, csrc/meeting/): the L device threads meet in mpicoll's
handler and the process's MPI work runs inside that meeting, so the device
threads never wait in XLA's own in-process collectives between mpicoll calls.
XLA orders its collectives among themselves but not with mpicoll's calls
(they hold different resources in XLA:CPU's thunk executor), so a program that
mixed the two could have device 0 in an MPI call waiting for device 0 of
another rank while device 1 waited in XLA's rendezvous for device 0: a
deadlock.  The meeting's calls are chained by mpicoll's ordered
effect, so every device thread runs them in program order; why that cannot
deadlock: docs/design.md, "Ranks x devices: why it cannot deadlock".

  allreduce  up to local_combine_bytes(L) per device one thread makes the one
             MPI allreduce for the process; above, every device allreduces its
             1/L slice of the locally reduced data on its own communicator, all
             in parallel, inside the same meeting (the split).
  allgather, alltoall, bcast, reduce_scatter: the meeting's kinds, one MPI
             collective per process.

On GPUs (the meeting reads the devices' buffers on the host) each is composed
of a lax collective over the local devices (XLA's, on the device's stream, in
the program's order) and an mpicoll per-device collective across ranks:
  allreduce  small: psum over devices, then MPI allreduce on every device;
             split (from split_allreduce_bytes(L)): psum_scatter, MPI allreduce
             of 1/L per device, all_gather.
  allgather  MPI allgather of each device's own x, then all_gather over devices.
  alltoall   all_to_all over devices, then MPI alltoall across ranks.
  bcast      the root device's x to its rank's devices, then MPI bcast per device.
  reduce_scatter  reduce-scatter over devices, then MPI reduce_scatter.

Autodiff and vmap follow the matching lax collective over one axis spanning all
participants: the meeting's kinds transpose to each other, the lax pieces bring
their own rules, and the MPI pieces are told (transpose_sums) whether
cotangents of replicated values are summed (pmap, shard_map(check_vma=False))
or taken once (shard_map with check_vma).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp

from . import local_meeting
from .. import _compat
from .._compat import unrouted_lax  # jax.lax over device axes, bypassing the router
from ..runtime import settings, dtypes, comm as comm_layer
from ..primitive import validate
from ..primitive.dispatch import bind
from ..primitive.spec import SPECS  # the rank-block collectives (ops/collectives.py), by name

# The two thresholds below are set at 2 devices and fall as 1 / (L - 1)
# (their values at 2 devices: runtime/settings.py).
#
# local_combine_bytes(L): on CPU, up to it one device thread makes the
# process's one MPI allreduce; above it every device allreduces its 1/L slice
# on its own communicator (the split, inside the meeting).  Measured at 2 ranks
# x 2 devices on 2 cores before the split moved into the meeting (Open MPI 4.1,
# float32 sum, jitted loop of 100, medians of 15, slowest rank;
# benchmarks/global_allreduce.py --combine-bytes 2000000), us per allreduce:
#   bytes/device   one MPI call (meeting)   lax composition   per-device MPI alone
#   4 B                 18.6                  3,010              20.4
#   4 KiB               22.1                    688             119
#   64 KiB               129                  5,950           2,170
#   256 KiB              217                  7,520           7,310
#   1 MiB                618                  8,270          11,530
# With more devices splitting wins earlier: on the simulated cluster at 8
# devices per host (benchmarks/multihost_allreduce.sh) one call was 1.7x
# faster than split at 64 KiB, split 1.14-1.38x faster at 256 KiB and
# 1.21-1.24x at 1 MiB; the cost model (benchmarks/allreduce_model.py,
# docs/design.md, "A cost model") puts the crossover at 437 KiB for 4 devices
# and 130 KiB for 8.  So 1 MiB at 2 devices, 341 KiB at 4, 146 KiB at 8.
#
# split_allreduce_bytes(L): on GPUs (the composition), from it psum_scatter /
# per-device MPI allreduce of 1/L / all_gather instead of psum + every device
# allreducing the whole: (L - 1) * n bytes per call off each node's link for an
# extra cost on the node that does not grow with L (split slower at 128 KiB,
# faster from 1 MiB at 2 devices on the simulated cluster; 1.11-1.41x faster at
# 64 KiB at 8 devices).  256 KiB at 2 devices, 85 KiB at 4, 37 KiB at 8.


def _scaled_to(local, bytes_at_two_devices):
    """A threshold set at 2 devices, at `local` devices: it falls as 1 / (L - 1)."""
    return bytes_at_two_devices / max(local - 1, 1)


def local_combine_bytes(local):
    """Bytes per device up to which one thread makes the meeting's MPI allreduce (CPU)."""
    return _scaled_to(local, settings.current().local_combine_bytes)


def split_allreduce_bytes(local):
    """Bytes per device from which the GPU composition splits its MPI work over the devices."""
    return _scaled_to(local, settings.current().split_allreduce_bytes)


def meets(local):
    """Whether the `local` device threads meet in mpicoll's handler: on CPU, for
    every kind and size (one mechanism; the module docstring says why)."""
    return local > 1 and jax.default_backend() == "cpu" and not _composing_on_cpu


_composing_on_cpu = False


@contextlib.contextmanager
def composed_on_cpu():
    """Tests only: trace the GPU composition on CPU (the one way to run it here).
    Not deadlock-free on CPU (the module docstring says why): single programs only."""
    global _composing_on_cpu
    _composing_on_cpu, previous = True, _composing_on_cpu
    try:
        yield
    finally:
        _composing_on_cpu = previous


def _local_axis_size(axis_name, caller):
    try:
        return unrouted_lax.axis_size(axis_name)
    except (NameError, KeyError, ValueError) as error:
        raise ValueError(f"mpicoll.{caller}: axis_name={axis_name!r} is not a mapped axis here; "
                         "use it inside pmap or shard_map over the local devices") from error


def _reduction_arguments(x, op, comm, axis_name, caller):
    """(x as an array, the op checked for its dtype, the communicator, the local
    device count): the one check of op and comm on this path (the binds below
    take them as checked, runtime/dtypes.CheckedOp and comm.CommInfo)."""
    x = validate.as_array(x, caller)
    op = dtypes.checked_op(op, x.dtype, caller)
    return x, op, comm_layer.resolve(comm, caller), _local_axis_size(axis_name, caller)


def allreduce(x, op, comm, axis_name):
    x, op, info, local = _reduction_arguments(x, op, comm, axis_name, "allreduce")
    if meets(local):
        return combined_allreduce(x, op, info, axis_name)
    return _composed_allreduce(x, op, info, axis_name)


def combined_allreduce(x, op, info, axis_name, whole=False, local=None, groups=()):
    """The allreduce as a meeting.  whole: the meeting is the entire collective over
    axis_name (its every participant is a device of a rank of info), not mpicoll's
    ranks x a local axis: a global mesh's axes that span processes and their
    devices, or a process's devices alone.  local, groups: the devices that meet
    per rank, and each device's group where several groups meet apart."""
    if local is None:
        local = jax.local_device_count() if whole else unrouted_lax.axis_size(axis_name)
    split = x.size * x.dtype.itemsize > local_combine_bytes(local)
    return local_meeting.meet(x, "allreduce", info, local, op=dtypes.op_code(
        op, x.dtype, "allreduce"), split=split, axis_name=axis_name, whole=whole,
        groups=groups)


def _composed_allreduce(x, op, comm, axis_name):
    """The lax collective over the local devices, then the per-device MPI allreduce."""
    local = unrouted_lax.axis_size(axis_name)
    vma = _compat.check_vma_enabled()
    # psum's transpose is psum under pmap, and pvary (identity) with check_vma.
    per_rank = functools.partial(bind, SPECS["allreduce"], op=op, comm=comm,
                                 transpose_sums=not vma)
    if op.name != "sum":
        # Every device reduces the same gathered rows, so the result is typed
        # invariant over the local axis, as lax.pmax's is (its derivative then
        # reaches the device whose element won).
        gathered = (_compat.all_gather_invariant if vma else unrouted_lax.all_gather)(x, axis_name)
        combined = functools.reduce(dtypes.elementwise(op.name),
                                    [gathered[k] for k in range(local)])
        return per_rank(combined.astype(x.dtype))
    if local == 1 or x.size * x.dtype.itemsize < split_allreduce_bytes(local):
        return per_rank(unrouted_lax.psum(x, axis_name))
    flat = x.reshape(-1)
    padded = -flat.size % local
    flat = jnp.pad(flat, (0, padded))
    # this device's 1/L, summed locally
    mine = unrouted_lax.psum_scatter(flat, axis_name, tiled=True)
    mine = per_rank(mine)  # every device allreduces its own part across ranks, in parallel
    gather = _compat.all_gather_invariant if vma else unrouted_lax.all_gather
    full = gather(mine, axis_name, tiled=True)
    return full[:x.size].reshape(x.shape)




def allgather(x, comm, axis_name):
    x = validate.as_array(x, "allgather")
    info = comm_layer.resolve(comm, "allgather")
    local = _local_axis_size(axis_name, "allgather")
    if meets(local):
        return local_meeting.meet(x, "allgather", info, local, axis_name=axis_name)
    # lax.all_gather transposes to psum_scatter: the MPI part sums over ranks too.
    across_ranks = bind(SPECS["allgather"], x, comm=info, transpose_sums=True)
    everything = unrouted_lax.all_gather(across_ranks, axis_name)  # (L, size, *s)
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
    x = validate.as_array(x, "alltoall")
    info = comm_layer.resolve(comm, "alltoall")
    local = _local_axis_size(axis_name, "alltoall")
    parts = _participant_blocks(x, info, local, "alltoall")  # [dest rank, dest device]
    if meets(local):
        return local_meeting.meet(x, "alltoall", info, local, axis_name=axis_name)
    # Device k' receives, from every local device k, the rows meant for devices k':
    # [dest rank, src device].
    parts = unrouted_lax.all_to_all(parts, axis_name, split_axis=1, concat_axis=1)
    parts = bind(SPECS["alltoall"], parts, comm=info)  # [src rank, src device]
    return parts.reshape(x.shape)


def bcast(x, root, comm, axis_name):
    x = validate.as_array(x, "bcast")
    info = comm_layer.resolve(comm, "bcast")
    local = _local_axis_size(axis_name, "bcast")
    root = validate.check_root(
        root, info.size * local, "bcast",
        among=f"{info.size} rank(s) x {local} local device(s) = {info.size * local} participants")
    vma = _compat.check_vma_enabled()
    if meets(local):
        # Typed invariant, like the composition: the same value on every participant.
        return local_meeting.meet(x, "bcast", info, local, axis_name=axis_name, root=root,
                                  invariant=((axis_name,), ()) if vma else ())
    root_rank, root_device = divmod(root, local)
    mask = unrouted_lax.axis_index(axis_name) == root_device
    on_rank = unrouted_lax.psum(jnp.where(mask, x, jnp.zeros_like(x)), axis_name)
    return bind(SPECS["bcast"], on_rank.astype(x.dtype), comm=info, root=root_rank,
                transpose_sums=not vma)


def reduce_scatter(x, op, comm, axis_name):
    x, op, info, local = _reduction_arguments(x, op, comm, axis_name, "reduce_scatter")
    parts = _participant_blocks(x, info, local, "reduce_scatter")  # [dest rank, dest device]
    if meets(local):
        return local_meeting.meet(x, "reduce_scatter", info, local, axis_name=axis_name,
                                  op=dtypes.op_code(op, x.dtype, "reduce_scatter"))
    if op.name == "sum":
        # Device k keeps, for every rank, the rows meant for local device k, summed locally.
        mine = unrouted_lax.psum_scatter(parts, axis_name, scatter_dimension=1)  # [dest rank, ...]
    else:
        everything = unrouted_lax.all_to_all(parts, axis_name, split_axis=1, concat_axis=1)
        # [dest rank, source device]: combine over the local source devices
        mine = functools.reduce(dtypes.elementwise(op.name),
                                [everything[:, k] for k in range(local)])
        mine = mine.astype(x.dtype)
    vma = _compat.check_vma_enabled()
    return bind(SPECS["reduce_scatter"], mine, op=op, comm=info, transpose_sums=not vma)

"""JAX's own collectives over mpicoll.RANKS, run across the MPI ranks by mpicoll.

Inside jax.shard_map over mpicoll.mesh() (with or without a local device axis
d), a jax.lax collective whose axes include RANKS is answered when it binds,
by the mpicoll collective that does the same thing across ranks:

  jax.lax                      over RANKS                over (RANKS, d) or (d, RANKS)
  psum, pmean, pmax, pmin      allreduce                 allreduce(axis_name=d)
  all_gather (any axis, tiled) allgather                 allgather, then all_gather over d
  psum_scatter                 reduce_scatter            reduce_scatter(axis_name=d)
  all_to_all                   alltoall                  alltoall(axis_name=d)
  ppermute, pshuffle           sendrecv                  CPU: the devices meet, one
                                                         alltoallv of the pairs; GPU:
                                                         alltoall of one non-zero row
                                                         (in the mesh's order only)
  pbroadcast                   bcast                     CPU: the devices meet, one
                                                         bcast (GPU: refused)
  axis_index                   the rank                  rank * L + device (JAX's formula)
  axis_size, psum(1, .)        the number of ranks       (ranks x L)

Participants are ordered as the axes are named: (RANKS, d) is rank-major
(participant rank * L + device), (d, RANKS) device-major.  Binding mpicoll's
primitives puts the MPI effect in the jaxpr, so everything mpicoll guarantees
holds for these calls too (program order across ranks, the mismatch check,
the timeout, abort on error), and the transforms are mpicoll's: vmap, JVP and
transpose rules written to match JAX's for the same collective (the results,
gradients and check_vma types of the same body run in one process over a mesh
of size x L devices).

On a global mesh, axes that span whole processes (every device of each) meet
the local devices in mpicoll's handler: one MPI collective per process
(ops/local_meeting.py).  psum, pmean, pmax, pmin and all_gather take
axis_index_groups where each participant is one device of a process: the
groups become communicators (over_ranks/mesh_groups.py).

What cannot be mapped raises at trace time, naming what to use instead; the
lowering refusal in primitive/varying.py stays behind it, so nothing over RANKS acts on
one process silently.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

from ..ops import collectives, local_meeting, ranks_devices
from .. import _compat
from .._compat import unrouted_lax  # jax.lax over device axes, bypassing the router
from . import mesh_groups
from ..primitive import varying
from ..runtime import comm as comm_layer
from ..primitive.dispatch import bind
from .. import users_line_now
from ..primitive.define import WRITTEN_AS_PREFIX, routed_as
from ..ops.p2p import PROC_NULL, SENDRECV

RANKS = varying.RANKS

_REDUCTIONS = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min"}

# How a collective's participants lie on ranks and devices:
PER_DEVICE, RANKS_X_AXIS, WHOLE = (mesh_groups.PER_DEVICE, mesh_groups.RANKS_X_AXIS,
                                   mesh_groups.WHOLE)


class _Participants:
    """Who takes part in a collective over `axes`, and in which order.

    comm: the ranks' communicator (a CommInfo); count: the participants;
    layout: one of the three above.  For RANKS_X_AXIS: local_axis and its size
    local, and devices_first where the axes name the local axis first
    (participant k * ranks + r for device k of rank r, not r * local + k).  For
    WHOLE: local, the devices of the process that meet (all, or one group of
    them: groups names each device's group).  order: where it is not rank-major,
    the axes' index of each rank-major row (device k of rank r is row r * L + k,
    as mpicoll's handlers number them).
    """

    def __init__(self, comm, layout, count, local_axis=None, local=1, devices_first=False,
                 order=None, groups=()):
        self.comm, self.layout, self.count = comm, layout, count
        self.local_axis, self.local, self.devices_first = local_axis, local, devices_first
        self.groups = groups  # WHOLE: each local device's group, where several meet apart
        # order[r * L + k]: the index, in the axes' order, of device k of rank r
        if order is None and devices_first:
            j = np.arange(count)
            order = (j % local) * comm.size + j // local
        self.order = None if order is None or (np.asarray(order) == np.arange(count)).all() \
            else np.asarray(order)
        # rows_of[p]: the rank-major row of the participant at p in the axes' order
        self._rows_of = None if self.order is None else np.argsort(self.order)

    def rank_major(self, rows):
        """Rows indexed in the axes' order, reordered rank-major (row r * L + k)."""
        return rows if self.order is None else rows[self.order]

    def axes_order(self, rows):
        """Rows indexed rank-major, reordered as the axes name the participants."""
        return rows if self.order is None else rows[self._rows_of]

    def rank_major_index(self, participant):
        """The rank-major row (r * L + k) of a participant given in the axes' order."""
        return participant if self.order is None else int(self._rows_of[participant])

    def rank_major_rows(self):
        """rank_major_index of every participant, in the axes' order."""
        return tuple(range(self.count)) if self.order is None else tuple(
            int(row) for row in self._rows_of)

    def meets(self):
        """Whether the local devices meet in mpicoll's handler for a collective that
        moves blocks between participants (one MPI collective per process,
        ops/local_meeting.py): the whole layout, and the ranks x a local axis on CPU
        (where the composition would move each block once per participant)."""
        return self.layout == WHOLE or (self.layout == RANKS_X_AXIS
                                        and jax.default_backend() == "cpu")

    def meet(self, x, kind, **params):
        """local_meeting.meet over these participants (over ranks x a local axis,
        x typed varying over that axis too)."""
        local_axis = self.local_axis if self.layout == RANKS_X_AXIS else None
        return local_meeting.meet(x, kind, self.comm, self.local, groups=self.groups,
                                  axis_name=local_axis, **params)

    def index(self, axes):
        """This participant's index in the axes' order (traced where it depends on the device)."""
        if self.layout == WHOLE:
            return unrouted_lax.axis_index(axes)  # JAX's own: the mesh spans the processes
        rank = self.comm.rank
        if self.layout == PER_DEVICE:
            return jnp.int32(rank)
        device = unrouted_lax.axis_index(self.local_axis)
        ranks = self.comm.size
        return device * ranks + rank if self.devices_first else rank * self.local + device


def _over_ranks(axes, caller):
    """The participants over mpicoll.RANKS and at most one local axis of mpicoll.mesh()."""
    others = [axis for axis in axes if axis != RANKS]
    mesh_axes = _compat.manual_mesh_axes()
    if len(others) > 1 or any(axis not in mesh_axes for axis in others) or (
            len(axes) != len(set(axes))):
        raise NotImplementedError(
            f"jax.lax.{caller} over {tuple(axes)!r}: mpicoll runs collectives over "
            f"{RANKS!r} alone or with one local device axis of mpicoll.mesh(local_axis) "
            "(as (RANKS, axis) or (axis, RANKS)); an axis that is not a mesh axis here "
            "(e.g. a vmap axis name) cannot be combined with it")
    world = varying.world()
    if not others:
        who = _Participants(world, PER_DEVICE, world.size)
        who.split_from = ("RANKS", 0)  # what axis_index_groups split: COMM_WORLD, color 0
        return who
    local = unrouted_lax.axis_size(others[0])
    return _Participants(world, RANKS_X_AXIS, world.size * local, others[0], local,
                         devices_first=axes[0] != RANKS)


def _over_processes(axes, caller):
    """The participants of a collective over axes of a global mesh, or None where
    none of them spans processes (XLA's own collective then runs it)."""
    found = mesh_groups.global_mesh()
    if found is None:
        return None
    names, sizes = found
    if any(axis not in names for axis in axes) or len(axes) != len(set(axes)):
        return None  # JAX's own error
    processes, local = jax.process_count(), jax.local_device_count()
    layout, groups = mesh_groups.grouping(tuple(names), tuple(sizes), tuple(axes), processes, local)
    if layout is None:
        raise NotImplementedError(
            f"jax.lax.{caller} over {tuple(axes)!r} of the mesh {dict(zip(names, sizes))}: "
            f"mpicoll cannot run it across processes ({groups}). Give the mesh a process "
            "axis and a device axis, e.g. jax.make_mesh((jax.process_count(), "
            "jax.local_device_count()), ('proc', 'dev')), and collect over ('proc',) or "
            "('proc', 'dev')")
    color, key, *whole = groups[jax.process_index()]
    comm = mesh_groups.mesh_communicator(tuple(axes), tuple(names), tuple(sizes), color, key)
    if comm.size == 1 and layout == PER_DEVICE:
        return None  # one device: nothing to collect
    order, per_group, device_groups = whole or (None, 1, ())
    who = _Participants(comm, layout, comm.size * per_group, local=per_group, order=order,
                        groups=device_groups)
    who.split_from = ((tuple(names), tuple(sizes), tuple(axes)), color)
    return who



def _vma():
    return _compat.check_vma_enabled()


def _zeros_like(x):
    """Zeros with x's shape, dtype and check_vma type (varying wherever x varies)."""
    return lax.select(jnp.zeros(x.shape, bool), x, lax.full_like(x, 0))


def _allreduce(x, op, who):
    if who.layout == PER_DEVICE:
        # psum transposes to psum under pmap-style typing, to pvary with check_vma.
        return bind(collectives.ALLREDUCE, x, comm=who.comm, op=op, transpose_sums=not _vma())
    if who.layout == RANKS_X_AXIS:
        return ranks_devices.allreduce(x, op, who.comm, who.local_axis)
    return ranks_devices.combined_allreduce(x, op, who.comm, who.axes[0], whole=True,
                                            local=who.local, groups=who.groups)


def _all_gather(x, who, *, all_gather_dimension, tiled, invariant):
    # all_gather is typed varying and transposes to psum_scatter (transpose_sums);
    # all_gather_invariant is typed invariant and transposes to this rank's slice.
    is_varying = not (invariant and _vma())
    if who.meets():  # rank-major rows, in the axes' order
        typed = () if is_varying else (
            (tuple(who.axes), who.rank_major_rows()) if who.layout == WHOLE
            else ((who.local_axis,), ()))  # ranks x a local axis: rank * L + device
        rows = who.axes_order(who.meet(x, "allgather", invariant=typed))
    else:
        # (ranks, *s)
        rows = bind(collectives.ALLGATHER, x, comm=who.comm, transpose_sums=is_varying)
    if who.layout == RANKS_X_AXIS and not who.meets():
        gather = unrouted_lax.all_gather if is_varying else _compat.all_gather_invariant
        rows = gather(rows, who.local_axis)  # (L, ranks, *s)
        if not who.devices_first:
            rows = jnp.swapaxes(rows, 0, 1)
        rows = rows.reshape((who.count, *x.shape))
    out = jnp.moveaxis(rows, 0, all_gather_dimension)
    if tiled:
        shape = list(x.shape)
        shape[all_gather_dimension] *= who.count
        out = out.reshape(shape)
    return out


def _split(x, dimension, count, caller, what):
    """x with `dimension` split into `count` rows, the rows first."""
    size = x.shape[dimension]
    if size % count:
        raise ValueError(f"jax.lax.{caller}: {what} has size {size}, which the {count} "
                         "participants of the axes cannot share equally")
    shape = x.shape[:dimension] + (count, size // count) + x.shape[dimension + 1:]
    return jnp.moveaxis(x.reshape(shape), dimension, 0)


def _psum_scatter(x, who, *, scatter_dimension, tiled):
    if tiled:
        rows = _split(x, scatter_dimension, who.count, "psum_scatter",
                      f"scatter_dimension {scatter_dimension}")
    else:
        if x.shape[scatter_dimension] != who.count:
            raise ValueError(
                f"jax.lax.psum_scatter: scatter_dimension {scatter_dimension} has size "
                f"{x.shape[scatter_dimension]}; without tiled it must equal the number of "
                f"participants, {who.count}")
        rows = jnp.moveaxis(x, scatter_dimension, 0)
    rows = who.rank_major(rows)
    if who.layout == WHOLE:
        return who.meet(rows, "reduce_scatter")
    if who.layout == PER_DEVICE:
        return bind(collectives.REDUCE_SCATTER, rows, comm=who.comm, op="sum",
                    transpose_sums=not _vma())
    return ranks_devices.reduce_scatter(rows, "sum", who.comm, who.local_axis)


def _exchange(rows, who):
    """An alltoall on rows in the axes' order: row j goes to participant j, and
    row j of the result came from participant j."""
    rows = who.rank_major(rows)
    if who.layout == WHOLE:
        rows = who.meet(rows, "alltoall")
    elif who.layout == PER_DEVICE:
        rows = bind(collectives.ALLTOALL, rows, comm=who.comm)
    else:
        rows = ranks_devices.alltoall(rows, who.comm, who.local_axis)
    return who.axes_order(rows)


def _all_to_all(x, who, *, split_axis, concat_axis):
    # The primitive's form (lax.all_to_all has inserted and will squeeze the
    # axes of the untiled form): split_axis cut into one chunk per participant,
    # the chunks received concatenated along concat_axis in participant order.
    rows = _exchange(_split(x, split_axis, who.count, "all_to_all",
                            f"split_axis {split_axis}"), who)
    out = jnp.moveaxis(rows, 0, concat_axis)
    shape = list(rows.shape[1:])
    shape[concat_axis] *= who.count
    return out.reshape(shape)


def _checked_permutation(perm, count):
    pairs = [tuple(pair) for pair in perm]
    sources = [s for s, _ in pairs]
    destinations = [d for _, d in pairs]
    if (any(not 0 <= i < count for pair in pairs for i in pair)
            or len(set(sources)) != len(sources) or len(set(destinations)) != len(destinations)):
        raise ValueError(
            f"jax.lax.ppermute: perm={list(pairs)!r} is not a permutation of the {count} "
            f"participants: every index in range(0, {count}), each source and each "
            "destination at most once")
    return pairs


def _ppermute(x, who, *, perm):
    if who.devices_first:
        # JAX orders ppermute's participants as the mesh names its axes whatever
        # order they are given in (0.10) or refuses another order (0.12).
        raise ValueError(
            f"jax.lax.ppermute: name the axes in the mesh's order, ({RANKS!r}, "
            f"{who.local_axis!r}), not ({who.local_axis!r}, {RANKS!r}); the permutation's "
            "indices are then rank * local devices + device")
    pairs = _checked_permutation(perm, who.count)
    if who.layout == WHOLE and len(who.axes) > 1:
        # As JAX numbers ppermute's participants: by the mesh's order of the axes.
        names, _ = mesh_groups.global_mesh()
        in_mesh_order = tuple(sorted(who.axes, key=names.index))
        if in_mesh_order != who.axes:
            who = _over_processes(in_mesh_order, "ppermute")
    if who.layout == PER_DEVICE:
        rank = who.comm.rank
        dest = next((d for s, d in pairs if s == rank), PROC_NULL)
        source = next((s for s, d in pairs if d == rank), PROC_NULL)
        if dest == PROC_NULL and source == PROC_NULL:
            return varying.typed_input(_zeros_like(x), who.comm)
        out = bind(SENDRECV, x, comm=who.comm, static=(
            ("source", source), ("dest", dest), ("sendtag", 0), ("recvtag", 0),
            ("shape", tuple(x.shape))))
        return _zeros_like(out) if source == PROC_NULL else out
    if who.meets():
        # Every device runs one program, so its partners are data: the local devices
        # meet and their process sends each block once, to its destination's process.
        return who.meet(x, "permute", pairs=[(who.rank_major_index(s), who.rank_major_index(d))
                                             for s, d in pairs])
    # Elsewhere (GPUs, ranks x a local axis): each participant sends a row to its
    # destination only, in an alltoall (count x the bytes of a point-to-point exchange).
    destination = np.full(who.count, -1)
    source = np.full(who.count, -1)
    for s, d in pairs:
        destination[s], source[d] = d, s
    me = who.index(who.axes)
    mine = jnp.asarray(destination)[me]
    rows = jnp.where((jnp.arange(who.count) == mine).reshape((-1,) + (1,) * x.ndim),
                     x[None], jnp.zeros((), x.dtype))
    rows = _exchange(rows, who)
    sender = jnp.asarray(source)[me]
    return jnp.where(sender >= 0, rows[jnp.maximum(sender, 0)], jnp.zeros((), x.dtype))


def _pbroadcast(x, who, *, source):
    if not 0 <= source < who.count:
        raise ValueError(f"jax.lax.pbroadcast: source={source} is not one of the {who.count} "
                         "participants")
    if who.layout == PER_DEVICE:
        return bind(collectives.BCAST, x, comm=who.comm, root=source, transpose_sums=True)
    if not who.meets():
        raise NotImplementedError(
            "jax.lax.pbroadcast over the ranks and a local axis on GPUs: use it over "
            "mpicoll.RANKS alone, or mpicoll.bcast(x, root, axis_name=local_axis)")
    return who.meet(x, "bcast", root=who.rank_major_index(source))


# ---------------------------------------------------------------------------
# axis_index_groups: the collective within each group of participants, on a
# communicator per group split from COMM_WORLD (made once per mesh, axes and
# groups, collectively: every process traces the same program), its ranks in
# the group's order (all_gather's rows follow it, as XLA's replica groups do).

_GROUPED = ("psum", "pmax", "pmin", "all_gather")


def _in_groups(name, who, groups):
    """The participants of this participant's group."""
    if name not in _GROUPED:
        raise NotImplementedError(f"jax.lax.{name} over {who.axes!r} with axis_index_groups: "
                                  "mpicoll runs psum, pmean, pmax, pmin and all_gather in groups")
    groups = tuple(tuple(int(i) for i in group) for group in groups)
    members = sorted(i for group in groups for i in group)
    if members != list(range(who.count)) or len({len(g) for g in groups}) != 1:
        raise ValueError(
            f"jax.lax.{name}: axis_index_groups={[list(g) for g in groups]!r} must split the "
            f"{who.count} participants of {who.axes!r} into groups of one size, each index "
            "once")
    if who.layout != PER_DEVICE:
        return _in_groups_over_devices(name, who, groups)
    me = who.comm.rank  # one device per process: the communicator ranks are the indices
    number = next(g for g, group in enumerate(groups) if me in group)
    source, color = who.split_from
    comm = mesh_groups.group_communicator(source, groups, color * len(groups) + number,
                                          groups[number].index(me))
    grouped = _Participants(comm, PER_DEVICE, len(groups[number]))
    grouped.axes = who.axes
    return grouped



def _in_groups_over_devices(name, who, groups):
    """The participants of this device's group where the participants span several
    devices of each process: the groups as a finer grouping of the mesh's devices
    (mesh_groups.grouping), whose devices meet per group in mpicoll's handler, or
    go one device per process where each group takes one device of each."""
    if who.layout == RANKS_X_AXIS:  # mpicoll.mesh(): RANKS x a local axis, rank-major
        names, sizes = (RANKS, who.local_axis), (who.comm.size, who.local)
    else:
        (names, sizes, _), _ = who.split_from
    processes = MPI.COMM_WORLD.Get_size()  # world(): COMM_WORLD, process-major as the mesh
    layout, placed = mesh_groups.grouping(tuple(names), tuple(sizes), tuple(who.axes),
                                          processes, math.prod(sizes) // processes, groups)
    if layout is None:
        raise NotImplementedError(
            f"jax.lax.{name} over {who.axes!r} with axis_index_groups="
            f"{[list(g) for g in groups]!r}: mpicoll cannot run these groups across "
            f"processes ({placed}); use groups that take the same local devices of each "
            "process they span (or one device of each)")
    color, key, *whole = placed[MPI.COMM_WORLD.Get_rank()]
    comm = mesh_groups.grouped_communicator((names, sizes, tuple(who.axes), groups), color,
                                            key)
    order, per_group, device_groups = whole or (None, 1, ())
    grouped = _Participants(comm, layout, comm.size * per_group, local=per_group, order=order,
                            groups=device_groups)
    grouped.axes = who.axes
    return grouped


# lax.parallel's primitive -> its answer over participants that span ranks,
# (x, who, the primitive's params) -> the result.
_ROUTES = {
    **{name: (lambda x, who, params, op=op: _allreduce(x, op, who))
       for name, op in _REDUCTIONS.items()},
    **{name: (lambda x, who, params, invariant=invariant: _all_gather(
        x, who, all_gather_dimension=params["all_gather_dimension"], tiled=params["tiled"],
        invariant=invariant))
       for name, invariant in (("all_gather", False), ("all_gather_invariant", True))},
    "reduce_scatter": lambda x, who, params: _psum_scatter(
        x, who, scatter_dimension=params["scatter_dimension"], tiled=params["tiled"]),
    "all_to_all": lambda x, who, params: _all_to_all(
        x, who, split_axis=params["split_axis"], concat_axis=params["concat_axis"]),
    "ppermute": lambda x, who, params: _ppermute(x, who, perm=params["perm"]),
    "pbroadcast": lambda x, who, params: _pbroadcast(x, who, source=params["source"]),
}
_UNMAPPED = (
    "jax.lax.{name} over {axes!r} has no MPI form in mpicoll: across processes use "
    "psum/pmean/pmax/pmin, all_gather, psum_scatter, all_to_all, ppermute, pbroadcast, "
    "axis_index and axis_size, or mpicoll's own collectives (mpicoll.sendrecv, "
    "mpicoll.allgatherv, ...)")


def _axes(name, params):
    axes = params.get("axes", params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _participants(name, axes):
    """Who takes part in the collective `name` over `axes`, where some of them span
    MPI ranks: RANKS inside shard_map over mpicoll.mesh(), or axes of a global
    mesh that span processes.  None where none does (JAX runs it)."""
    mesh_axes = _compat.manual_mesh_axes()
    if RANKS in axes and RANKS in mesh_axes:
        return _over_ranks(axes, name)
    if name == "axis_index" or not set(axes) <= set(mesh_axes):
        return None  # a global mesh's indices are JAX's own; other axes, JAX's error
    if RANKS in mesh_axes:
        return _within_process(axes)
    return _over_processes(axes, name)


def _within_process(axes):
    """The participants of a collective over mpicoll.mesh()'s local axis alone:
    this process's devices, which meet in mpicoll's handler on CPU with no MPI
    peer.  The same mechanism as the collectives over the ranks, chained with
    them in program order: XLA's own collective there is not ordered with
    mpicoll's calls, and the two mixed in one program could deadlock
    (ops/ranks_devices.py); after jax.distributed it would also be gloo's, a TCP
    round trip inside the process.  On GPUs XLA's own stay."""
    if jax.default_backend() != "cpu":
        return None
    devices = unrouted_lax.axis_size(axes)
    if devices == 1:
        return None  # nothing to meet
    return _Participants(_this_process(tuple(axes)), WHOLE, devices, local=devices)


@functools.lru_cache(maxsize=None)
def _this_process(axes):
    return comm_layer.for_mesh_axes(MPI.COMM_SELF.Dup(), axes, "jax.lax")


def _route(name, args, params):
    """The answer to a lax.parallel primitive's bind: mpicoll's collective where
    its axes span MPI ranks (_participants); else NotImplemented."""
    axes = _axes(name, params)
    if name == "axis_index" and axes == (RANKS,) and RANKS in _compat.manual_mesh_axes():
        return varying.typed_input(jnp.int32(varying.world().rank))
    if any(isinstance(axis, int) for axis in axes):
        if RANKS in axes:
            raise NotImplementedError(f"jax.lax.{name}: positional axes cannot be combined "
                                      f"with {RANKS!r}; reduce them with jnp first")
        return NotImplemented
    who = _participants(name, axes)
    if who is None:
        return NotImplemented
    route = _ROUTES.get(name)
    if route is None:
        raise NotImplementedError(_UNMAPPED.format(name=name, axes=axes))
    who.axes = axes
    if params.get("axis_index_groups") is not None:
        who = _in_groups(name, who, params["axis_index_groups"])
    x, = args
    # Reports and mismatch messages name the collective as written (the scope
    # reaches the lowering of every mpicoll call it becomes, primitive/define.py).
    written_as = _written_as(name, axes, x)
    with jax.named_scope(written_as), routed_as(written_as, users_line_now()):
        return route(x, who, params)


def _written_as(name, axes, x):
    """'jax.lax.psum over (mpicoll.RANKS, 'dev') of float32[2] per device': what the
    user's shard_map body called, with the shape each device gives it."""
    shape = ",".join(str(length) for length in getattr(x, "shape", ()))
    dtype = getattr(getattr(x, "dtype", None), "name", "?")
    named = ", ".join(str(axis) if axis == RANKS else repr(axis) for axis in axes)
    return (f"{WRITTEN_AS_PREFIX}{_USER_NAMES.get(name, name)} over ({named}) of "
            f"{dtype}[{shape}] per device")


# The jax.lax function each routed primitive is bound by, where the names differ.
_USER_NAMES = {"psum_invariant": "psum", "reduce_scatter": "psum_scatter"}


def size_ranks_axis():
    """An install step (install.py): RANKS reports the number of ranks as its size."""
    _compat.size_axis(RANKS, lambda: varying.world().size)
    return f"{RANKS!r}"


def route_lax_collectives():
    """An install step (install.py): every lax.parallel primitive's bind asks _route first."""
    routed = _compat.route_lax_collectives(_route)
    common = [name for name in ("psum", "pmax", "pmin", "all_gather", "reduce_scatter",
                                "all_to_all", "ppermute", "pbroadcast", "axis_index")
              if name in routed]
    return f"{len(routed)} primitives ({', '.join(common)}, ...)"

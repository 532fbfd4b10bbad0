"""JAX's own collectives over mpicoll.RANKS, run across the MPI ranks by mpicoll.

Inside jax.shard_map over mpicoll.mesh() (with or without a local device axis
d), a jax.lax collective whose axes include RANKS is answered when it binds,
by the mpicoll collective that does the same thing across ranks:

  jax.lax                      over RANKS                over (RANKS, d) or (d, RANKS)
  psum, pmean, pmax, pmin      allreduce                 allreduce(axis_name=d)
  all_gather (any axis, tiled) allgather                 allgather, then all_gather over d
  psum_scatter                 reduce_scatter            reduce_scatter(axis_name=d)
  all_to_all                   alltoall                  alltoall(axis_name=d)
  ppermute, pshuffle           sendrecv                  alltoall of one non-zero row
                                                         (in the mesh's order only)
  pbroadcast                   bcast                     (refused)
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

What cannot be mapped raises at trace time, naming what to use instead; the
lowering refusal in _typing.py stays behind it, so nothing over RANKS acts on
one process silently.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _blocks, _compat, _ranks_devices, _typing
from ._dispatch import bind
from .p2p import PROC_NULL, SENDRECV

RANKS = _typing.RANKS

_REDUCTIONS = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min"}


class _Participants:
    """Who takes part in a collective over `axes`, and in which order.

    ranks: the number of ranks; local: the devices per rank taking part (1
    where the local axis is not among the axes); local_axis: its name or None;
    devices_first: the axes name the local axis first, so participant
    k * ranks + r (device k of rank r) instead of r * local + k.
    """

    def __init__(self, axes, caller):
        others = [axis for axis in axes if axis != RANKS]
        mesh_axes = _compat.manual_mesh_axes()
        if len(others) > 1 or any(axis not in mesh_axes for axis in others) or (
                len(axes) != len(set(axes))):
            raise NotImplementedError(
                f"jax.lax.{caller} over {tuple(axes)!r}: mpicoll runs collectives over "
                f"{RANKS!r} alone or with one local device axis of mpicoll.mesh(local_axis) "
                "(as (RANKS, axis) or (axis, RANKS)); an axis that is not a mesh axis here "
                "(e.g. a vmap axis name) cannot be combined with it")
        self.ranks = _typing.world().size
        self.local_axis = others[0] if others else None
        self.local = lax.axis_size(self.local_axis) if others else 1
        self.devices_first = bool(others) and axes[0] != RANKS
        self.count = self.ranks * self.local

    def rank_major(self, rows):
        """Rows indexed in the axes' order, reordered rank-major (row r * L + k)."""
        if not self.devices_first:
            return rows
        p = np.arange(self.count)
        return rows[(p % self.local) * self.ranks + p // self.local]

    def axes_order(self, rows):
        """Rows indexed rank-major, reordered as the axes name the participants."""
        if not self.devices_first:
            return rows
        q = np.arange(self.count)
        return rows[(q % self.ranks) * self.local + q // self.ranks]

    def index(self):
        """This participant's index in the axes' order (traced: it depends on the device)."""
        rank = _typing.world().rank
        if self.local_axis is None:
            return jnp.int32(rank)
        device = lax.axis_index(self.local_axis)
        return device * self.ranks + rank if self.devices_first else rank * self.local + device


def _vma():
    return _compat.check_vma_enabled()


def _zeros_like(x):
    """Zeros with x's shape, dtype and check_vma type (varying wherever x varies)."""
    return lax.select(jnp.zeros(x.shape, bool), x, lax.full_like(x, 0))


def _allreduce(x, op, who):
    if who.local_axis is None:
        # psum transposes to psum under pmap-style typing, to pvary with check_vma.
        return bind(_blocks.ALLREDUCE, x, comm=None, op=op, transpose_sums=not _vma())
    return _ranks_devices.allreduce(x, op, None, who.local_axis)


def _all_gather(x, who, *, all_gather_dimension, tiled, invariant):
    # all_gather is typed varying and transposes to psum_scatter (transpose_sums);
    # all_gather_invariant is typed invariant and transposes to this rank's slice.
    varying = not (invariant and _vma())
    rows = bind(_blocks.ALLGATHER, x, comm=None, transpose_sums=varying)  # (ranks, *s)
    if who.local_axis is not None:
        gather = lax.all_gather if varying else _compat.all_gather_invariant
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
    if who.local_axis is None:
        return bind(_blocks.REDUCE_SCATTER, rows, comm=None, op="sum", transpose_sums=not _vma())
    return _ranks_devices.reduce_scatter(rows, "sum", None, who.local_axis)


def _exchange(rows, who):
    """mpicoll's alltoall on rows in the axes' order: row j goes to participant j,
    and row j of the result came from participant j."""
    rows = who.rank_major(rows)
    if who.local_axis is None:
        rows = bind(_blocks.ALLTOALL, rows, comm=None)
    else:
        rows = _ranks_devices.alltoall(rows, None, who.local_axis)
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
    if who.local_axis is None:
        rank = _typing.world().rank
        dest = next((d for s, d in pairs if s == rank), PROC_NULL)
        source = next((s for s, d in pairs if d == rank), PROC_NULL)
        if dest == PROC_NULL and source == PROC_NULL:
            return _typing.typed_input(_zeros_like(x))
        out = bind(SENDRECV, x, comm=None, static=(
            ("source", source), ("dest", dest), ("sendtag", 0), ("recvtag", 0),
            ("shape", tuple(x.shape))))
        return _zeros_like(out) if source == PROC_NULL else out
    # Across ranks and devices every device runs one program, so its partners
    # are data: each participant sends a row to its destination only, in an
    # alltoall (count x the bytes of a point-to-point exchange).
    destination = np.full(who.count, -1)
    source = np.full(who.count, -1)
    for s, d in pairs:
        destination[s], source[d] = d, s
    me = who.index()
    mine = jnp.asarray(destination)[me]
    rows = jnp.where((jnp.arange(who.count) == mine).reshape((-1,) + (1,) * x.ndim),
                     x[None], jnp.zeros((), x.dtype))
    rows = _exchange(rows, who)
    sender = jnp.asarray(source)[me]
    return jnp.where(sender >= 0, rows[jnp.maximum(sender, 0)], jnp.zeros((), x.dtype))


def _pbroadcast(x, who, *, source):
    if who.local_axis is not None:
        raise NotImplementedError(
            "jax.lax.pbroadcast over the ranks and a local axis: use it over mpicoll.RANKS "
            "alone, or mpicoll.bcast(x, root, axis_name=local_axis)")
    if not 0 <= source < who.count:
        raise ValueError(f"jax.lax.pbroadcast: source={source} is not one of the {who.count} "
                         "ranks")
    return bind(_blocks.BCAST, x, comm=None, root=source, transpose_sums=True)


def _axis_index():
    return _typing.typed_input(jnp.int32(_typing.world().rank))


_MAPPED = {*_REDUCTIONS, "all_gather", "all_gather_invariant", "reduce_scatter", "all_to_all",
           "ppermute", "pbroadcast"}
_UNMAPPED = (
    "jax.lax.{name} over {axes!r} has no MPI form in mpicoll: over the ranks use "
    "psum/pmean/pmax/pmin, all_gather, psum_scatter, all_to_all, ppermute, pbroadcast, "
    "axis_index and axis_size, or mpicoll's own collectives (mpicoll.sendrecv, "
    "mpicoll.allgatherv, ...)")


def _axes(name, params):
    axes = params.get("axes", params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _route(name, args, params):
    """The answer to a lax.parallel primitive's bind: mpicoll's collective where its
    axes include RANKS inside a shard_map over mpicoll.mesh(); else NotImplemented."""
    axes = _axes(name, params)
    if RANKS not in axes or RANKS not in _compat.manual_mesh_axes():
        return NotImplemented
    if name == "axis_index":
        return _axis_index()
    if params.get("axis_index_groups") is not None:
        raise NotImplementedError(
            f"jax.lax.{name} over {axes!r} with axis_index_groups: for groups of ranks, "
            "call mpicoll's collective with comm=MPI.COMM_WORLD.Split(color)")
    if any(isinstance(axis, int) for axis in axes):
        raise NotImplementedError(f"jax.lax.{name}: positional axes cannot be combined with "
                                  f"{RANKS!r}; reduce them with jnp first")
    if name not in _MAPPED:
        raise NotImplementedError(_UNMAPPED.format(name=name, axes=axes))
    who = _Participants(axes, name)
    x, = args
    if name in _REDUCTIONS:
        return _allreduce(x, _REDUCTIONS[name], who)
    if name in ("all_gather", "all_gather_invariant"):
        return _all_gather(x, who, all_gather_dimension=params["all_gather_dimension"],
                           tiled=params["tiled"], invariant=name == "all_gather_invariant")
    if name == "reduce_scatter":
        return _psum_scatter(x, who, scatter_dimension=params["scatter_dimension"],
                             tiled=params["tiled"])
    if name == "all_to_all":
        return _all_to_all(x, who, split_axis=params["split_axis"],
                           concat_axis=params["concat_axis"])
    if name == "ppermute":
        return _ppermute(x, who, perm=params["perm"])
    return _pbroadcast(x, who, source=params["source"])


def _ranks_count():
    return _typing.world().size


_compat.size_axis(RANKS, _ranks_count)
_compat.route_lax_collectives(_route)

"""Collectives on arrays laid out over several of a process's local devices.

A `jax.Array` placed on several local devices (`jax.device_put` with a
`NamedSharding`, `jax.jit` with shardings, `jax.set_mesh` with Explicit axes)
is one logical array per process, and mpicoll's collective of it is the
collective of each process's logical array across the ranks.

How it runs: as a manual region, `jax.shard_map` over the array's own mesh
and spec, in which each device runs the collective on its own shard over its
own communicator.  Device d of every rank holds the same shard (the ranks lay
out their arrays alike, as they give them one shape), so every shard meets its
counterparts and no device moves another's bytes; XLA's partitioner never sees
mpicoll's custom call (a side-effecting call it cannot partition).  Devices
that hold the same shard (a mesh axis the spec does not name: replicated) split
it: each moves 1/R of it, and the R pieces are gathered back within the
process, so a replicated array crosses the network once per process, not once
per device.  A pytree's leaves over one mesh run in one region, each device's
shards fused into one MPI message per dtype (a small replicated leaf whole:
tree_region).  On CPU no XLA thread waits in MPI for a rank that has not
arrived: a per-device call runs on XLA's thread once every rank is in it, else
on the device's progress thread (as mpicoll.overlap() does), so XLA's own
collectives of the same program can always rendezvous (the argument of
docs/design.md, "Ranks x devices: why it cannot deadlock").

The result's layout, for x laid out as P(s0, s1, ...):

  allreduce, reduce, bcast, scan, exscan,   x's: P(s0, s1, ...)
  sendrecv, recv, the v-forms, alltoall
  allgather, gather                         a new leading ranks dimension,
                                            unsharded: P(None, s0, s1, ...)
  scatter, reduce_scatter                   x's without its first (ranks)
                                            dimension: P(s1, ...)

A dimension whose length changes across the ranks (the first one of
alltoall, scatter, reduce_scatter and the v-forms) must not be sharded over
devices; nor may the layout be one XLA chooses when the program is compiled
(automatic axes in a jit that has no mesh in context): mpicoll cannot see it
when it traces the call, and says so.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from .. import _compat
from .._compat import unrouted_lax  # jax.lax over device axes, bypassing the router

# Collectives whose output gains (+1) or loses (-1) a leading ranks dimension.
_LEADING_CHANGE = {"allgather": +1, "gather": +1, "scatter": -1, "reduce_scatter": -1}
# Collectives whose first dimension is the ranks' or differs between ranks.
_FIRST_DIMENSION_MOVES = ("alltoall", "scatter", "reduce_scatter", "gatherv", "allgatherv",
                          "scatterv", "alltoallv")


class Layout:
    """How x lies over this process's devices: a mesh, the spec (one entry per
    dimension) and the mesh axes over which it is replicated."""

    def __init__(self, mesh, spec, ndim):
        self.mesh = mesh
        entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
        self.spec = P(*entries)
        used = set()
        for entry in entries:
            used.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
        self.replicated = tuple(name for name in mesh.axis_names
                                if name not in used and mesh.shape[name] > 1)

    @property
    def replicas(self):
        return math.prod(self.mesh.shape[name] for name in self.replicated)

    def key(self):
        return (self.mesh, self.spec)


def layout_of(x, caller):
    """x's Layout where it spans several local devices outside a manual region, else None.

    x: an array, a tracer, or a template (jax.ShapeDtypeStruct, whose sharding
    is read).  Raises (the same on every rank, before any MPI call) for a
    layout mpicoll cannot see or run.
    """
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, SingleDeviceSharding) and not isinstance(x, jax.core.Tracer):
        # The common eager case first: one device's concrete array.
        return None if _compat.at_top_level() else _context_layout(x, caller)
    if _compat.is_batched(x):
        # Under vmap the call binds its batched primitive, whose lowering lays out the
        # batch as XLA does (define.py, _on_each_device).
        return None
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            return _traced_layout(mesh, sharding.spec, x.ndim, caller)
        return _context_layout(x, caller)
    if sharding is None or len(sharding.device_set) <= 1:
        return None if _compat.at_top_level() else _context_layout(x, caller)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise _global_array_refused(caller)
    if not isinstance(sharding, NamedSharding):
        raise NotImplementedError(
            f"mpicoll.{caller}: x is laid out over {len(sharding.device_set)} devices by a "
            f"{type(sharding).__name__}; mpicoll reads a NamedSharding's mesh and spec: "
            "place it with jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))")
    return Layout(sharding.mesh, sharding.spec, len(x.shape))


def _global_array_refused(caller):
    """The error for a value laid out over other processes' devices too.  mpicoll's
    collectives take each process's own array; what a global array's collective
    across its processes would mean is jax.lax's to say (over the global mesh's
    axes), so eager calls and traced ones refuse it alike."""
    return NotImplementedError(
        f"mpicoll.{caller}: x spans devices of other processes (a global array, after "
        "jax.distributed or mpicoll.distributed.initialize()); collect it with jax.lax "
        "collectives over the global mesh's axes inside jax.shard_map, or pass each "
        "process's own part (x.addressable_shards)")


def _context_layout(x, caller):
    """A value with no layout of its own, traced in a jit under jax.set_mesh: the
    program runs on the context mesh's devices, and x is replicated over them."""
    mesh = _compat.context_abstract_mesh()
    if mesh is None:
        return None
    return _traced_layout(mesh, P(), len(getattr(x, "shape", ())), caller)


def _traced_layout(mesh, spec, ndim, caller):
    free = [name for name, kind in zip(mesh.axis_names, mesh.axis_types)
            if kind != jax.sharding.AxisType.Manual and mesh.shape[name] > 1]
    if not free:
        return None  # inside shard_map or pmap: one device's shard
    if mesh.size > jax.local_device_count():
        # A traced value's mesh is abstract (no devices to ask), but one larger than
        # this process's devices spans other processes: a global array.
        raise _global_array_refused(caller)
    if len(free) != len([name for name in mesh.axis_names if mesh.shape[name] > 1]):
        raise NotImplementedError(
            f"mpicoll.{caller}: x is traced inside jax.shard_map over some of the mesh's "
            f"axes ({', '.join(mesh.manual_axes)}) but laid out over others "
            f"({', '.join(free)}); call it where every axis is manual (shard_map over the "
            "whole mesh) or none is")
    if any(kind == jax.sharding.AxisType.Auto for kind in mesh.axis_types):
        # XLA chooses an Auto axis's layout when it compiles: mpicoll sees none now,
        # so it asks for x replicated over those axes (XLA gathers it first).
        spec = _explicit_part(spec, mesh)
    return Layout(mesh, spec, ndim)


def shard_shape(layout, shape):
    """The shape of one device's shard of an array of `shape` laid out as `layout`."""
    out = []
    for length, entry in zip(shape, tuple(layout.spec) + (None,) * len(shape)):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        parts = math.prod(layout.mesh.shape[name] for name in names)
        if length % parts:
            raise ValueError(f"a dimension of length {length} does not split evenly over "
                             f"{parts} devices ({layout.spec})")
        out.append(length // parts)
    return tuple(out)


def _explicit_part(spec, mesh):
    """spec with the Auto axes of mesh left out (replicated over them)."""
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind == jax.sharding.AxisType.Explicit}
    kept = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        names = tuple(name for name in names if name in explicit)
        kept.append(names if len(names) > 1 else names[0] if names else None)
    return P(*kept)


def out_spec(name, layout):
    """The result's spec (module docstring's table)."""
    entries = tuple(layout.spec)
    change = _LEADING_CHANGE.get(name, 0)
    if change > 0:
        return P(None, *entries)
    if change < 0:
        return P(*entries[1:])
    return layout.spec


def check(name, x, layout):
    """Raise for a layout that cannot run, the same on every rank."""
    if name in _FIRST_DIMENSION_MOVES and x.ndim and tuple(layout.spec)[0] is not None:
        raise ValueError(
            f"mpicoll.{name}: x's first dimension is sharded over the local devices "
            f"({layout.spec}); it is the dimension that {name} exchanges between the ranks, "
            "so it must be whole on each device: shard another dimension, or none")


def run(name, x, layout, call, family):
    """The collective `call(shard)` of each device's shard, as one manual region over
    layout.mesh (traced: dispatch.py jits it for an eager call)."""
    check(name, x, layout)
    return region(name, layout, family, call)(x)


def region(name, layout, family, call):
    """jax.shard_map of the per-device call over the layout's mesh."""
    split = layout.replicated and family == "blocks"

    def per_device(shard):
        if split:
            piece, whole = _replica_piece(name, shard, layout)
            return whole(call(piece))
        return call(shard)

    return jax.shard_map(per_device, mesh=layout.mesh, in_specs=layout.spec,
                         out_specs=out_spec(name, layout), check_vma=False)


def tree_region(name, layouts, call, split_above):
    """jax.shard_map over the layouts' one mesh of call(shards), a blocks-family
    collective of a tuple of one device's shards (fused: dispatch.py).  A
    replicated shard of over `split_above` bytes is split as region() splits
    it; a smaller one travels whole on each replica, in the fused message, where
    a gather within the process would cost more than its bytes."""
    def per_device(shards):
        pieces, wholes = [], []
        for shard, layout in zip(shards, layouts):
            split = layout.replicated and shard.size * shard.dtype.itemsize > split_above
            piece, whole = (_replica_piece(name, shard, layout) if split
                            else (shard, lambda out: out))
            pieces.append(piece)
            wholes.append(whole)
        return tuple(whole(out) for whole, out in zip(wholes, call(tuple(pieces))))

    return jax.shard_map(per_device, mesh=layouts[0].mesh,
                         in_specs=(tuple(layout.spec for layout in layouts),),
                         out_specs=tuple(out_spec(name, layout) for layout in layouts),
                         check_vma=False)


def _replica_index(layout):
    index = 0
    for axis in layout.replicated:
        index = index * layout.mesh.shape[axis] + unrouted_lax.axis_index(axis)
    return index


def _replica_piece(name, shard, layout):
    """This replica's 1/R of the shard's elements, and the function that makes the
    call's result on that piece whole again (the R results gathered within the
    process): each replicated byte crosses the network once per process.

    Every blocks-family collective treats the elements after its leading ranks
    dimension (if any) position by position, so a slice of them is the same
    collective of fewer elements."""
    replicas = layout.replicas
    lead_in = 1 if name in ("alltoall", "scatter", "reduce_scatter") else 0
    lead = shard.shape[:lead_in]
    rest = shard.shape[lead_in:]
    count = math.prod(rest)
    if count < replicas:  # nothing worth splitting: each replica moves its own copy
        return shard, lambda out: out
    piece = -(-count // replicas)
    flat = shard.reshape(lead + (count,))
    if piece * replicas != count:
        pad = [(0, 0)] * lead_in + [(0, piece * replicas - count)]
        flat = jnp.pad(flat, pad)
    mine = lax.dynamic_slice_in_dim(flat, _replica_index(layout) * piece, piece, axis=lead_in)

    def whole(out):
        gathered = unrouted_lax.all_gather(out, layout.replicated, axis=out.ndim - 1, tiled=True)
        out_lead = out.shape[:-1]
        return lax.slice_in_dim(gathered, 0, count, axis=out.ndim - 1).reshape(out_lead + rest)

    return mine, whole

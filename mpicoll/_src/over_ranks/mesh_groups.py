"""Where a collective's participants lie on processes, and their communicators.

A global mesh (after mpicoll.distributed.initialize() or jax.distributed's own)
spans every process's devices, listed process-major; a collective over some of
its axes groups the devices, and grouping() says how: one device per process
(PER_DEVICE: the direct MPI collective on a communicator per set of processes),
the same devices of each process (WHOLE: all of them, or a group of them where
the axes take some, which meet in mpicoll's handler), or neither (refused).
The communicators are split from COMM_WORLD once per mesh shape and axes, and
per axis_index_groups.
"""

import functools
import math

import jax
import numpy as np
from mpi4py import MPI

from .. import _compat
from ..runtime import comm as comm_layer

PER_DEVICE = "per device"  # one device per rank each: device k of every rank of comm
RANKS_X_AXIS = "ranks x local axis"  # comm's ranks x a local mesh axis (mpicoll.mesh)
WHOLE = "whole"  # every device of every rank of comm, with no local axis of their own

# ---------------------------------------------------------------------------
# Global meshes: after mpicoll.distributed.initialize() (or jax.distributed's
# own), a mesh over every process's devices.  Its devices are listed
# process-major (device i is local device i % L of process i // L, checked when
# the program is lowered: primitive/define.py), so which devices a collective over
# some axes groups together follows from the mesh's shape alone.

def gloo_in_process():
    """Whether XLA's own CPU collectives go over gloo even between one process's
    devices: after jax.distributed (mpicoll.distributed.initialize() or JAX's own),
    at any process count.  Those hang under asynchronous dispatch (no bound on the
    programs in flight, docs/jax-vocabulary.md), so mpicoll's meeting runs them."""
    return jax.distributed.is_initialized() and jax.default_backend() == "cpu"


def global_mesh():
    """(axis names, sizes) of the mesh traced now if it spans every process's
    devices and mpicoll runs its collectives: several processes, or one after
    jax.distributed on CPU (gloo_in_process)."""
    if jax.process_count() == 1 and not gloo_in_process():
        return None
    names, sizes = _compat.current_mesh_shape()
    if math.prod(sizes) != jax.device_count():
        return None
    return names, sizes


def _along(names, sizes, axes, processes, local):
    """Each device's group (its coordinates off `axes`) and position along `axes`."""
    devices = np.arange(processes * local)
    coords = np.stack(np.unravel_index(devices, sizes), axis=1)
    rest = [j for j, name in enumerate(names) if name not in axes]
    along = [names.index(axis) for axis in axes]
    group_of = [tuple(row) for row in coords[:, rest]]
    position = np.ravel_multi_index(tuple(coords[:, along].T), [sizes[j] for j in along])
    return group_of, position


@functools.lru_cache(maxsize=None)
def grouping(names, sizes, axes, processes, local, index_groups=None):
    """How a collective over `axes` of a process-major mesh groups the devices:
    (layout, per process: (color, key)) for a communicator split from COMM_WORLD,
    with WHOLE also (order, devices per group, each local device's group or ()),
    or (None, why) when no layout fits.  index_groups: axis_index_groups, which
    split the participants along `axes` further (a participant's place: its
    place in its group's list, as XLA's replica groups order all_gather's rows)."""
    group_of, position = _along(names, sizes, axes, processes, local)
    if index_groups is not None:
        group_number = {p: g for g, group in enumerate(index_groups) for p in group}
        group_of = [group + (group_number[int(p)],) for group, p in zip(group_of, position)]
        position = np.asarray([index_groups[group_number[int(p)]].index(int(p))
                               for p in position])
    return _grouping(group_of, position, processes, local)


def _grouping(group_of, position, processes, local):
    devices = np.arange(processes * local)
    process, device = devices // local, devices % local
    members = {}
    for i, group in enumerate(group_of):
        members.setdefault(group, []).append(i)
    ranks_of = {group: frozenset(process[m]) for group, m in members.items()}
    # Each process's devices all in groups of the same processes: one communicator per process.
    per_process = [{ranks_of[group_of[i]] for i in devices[process == q]} for q in range(processes)]
    if any(len(sets) != 1 for sets in per_process):
        return None, "its groups split some process's devices between different processes"
    colors = {ranks: c for c, ranks in enumerate(sorted({next(iter(s)) for s in per_process},
                                                        key=sorted))}
    color = [colors[next(iter(per_process[q]))] for q in range(processes)]
    one_device_each = all(len(set(device[m])) == 1 and len(m) == len(ranks_of[g])
                          for g, m in members.items())
    if one_device_each:
        # Ordered as the axes order the processes: the same order for every device.
        orders = {}
        for m in members.values():
            m = np.asarray(m)
            order = tuple(process[m][np.argsort(position[m])])
            orders.setdefault(color[order[0]], set()).add(order)
        if all(len(found) == 1 for found in orders.values()):
            return PER_DEVICE, [(color[q], int(position[q * local])) for q in range(processes)]
    # Otherwise the same `devices` local devices of each process in every group
    # (all of them, or a group of them where the axes take some): they meet in
    # mpicoll's handler, each group apart (ops/local_meeting.py).
    shares = {(g, int(q)): tuple(sorted(device[m][process[m] == q]))
              for g, m in members.items() for q in set(process[m])}
    if len({len(v) for v in shares.values()}) != 1:
        return None, "its groups take different numbers of devices from different processes"
    if any(len({shares[(g, int(q))] for q in set(process[m])}) != 1
           for g, m in members.items()):
        return None, "its groups take different local devices on different processes"
    per_group = len(next(iter(shares.values())))
    # Each process's place in the axes' order of its group's participants,
    # rank-major (its communicator ranks the processes by index, each with its
    # devices in order): the same for every group of a process, as the
    # handler's program is.  A device's group: its group's rank among those of
    # its process, by their lowest device.
    result = []
    for q in range(processes):
        mine = sorted({group_of[i] for i in devices[process == q]},
                      key=lambda g: min(members[g]))
        orders = {tuple(int(p) for p in position[sorted(members[g])]) for g in mine}
        if len(orders) != 1:
            return None, "its groups order their participants differently"
        table = tuple(mine.index(group_of[q * local + k]) for k in range(local))
        result.append((color[q], q, orders.pop(), per_group,
                       table if len(mine) > 1 else ()))
    return WHOLE, result


@functools.lru_cache(maxsize=None)
def mesh_communicator(axes, names, sizes, color, key):
    """The communicator of the processes this process meets over `axes` (made once
    per mesh shape and axes, collectively: every process traces the same program)."""
    del names, sizes  # the cache key
    return comm_layer.for_mesh_axes(MPI.COMM_WORLD.Split(color, key), axes, "jax.lax")


@functools.lru_cache(maxsize=None)
def group_communicator(source, groups, color, key):
    """The communicator of one group of axis_index_groups: COMM_WORLD split by
    color, ranked by the key (the place in the group).  Made once per mesh, axes
    and groups, collectively (every process traces the same program)."""
    del source, groups  # the cache key
    return comm_layer.resolve(MPI.COMM_WORLD.Split(color, key), "jax.lax")


@functools.lru_cache(maxsize=None)
def grouped_communicator(key_of, color, key):
    """The communicator of this process's groups of axis_index_groups over several
    devices per process: COMM_WORLD split by color, ranked by key.  Made once per
    mesh, axes and groups (key_of), collectively."""
    del key_of  # the cache key
    return comm_layer.resolve(MPI.COMM_WORLD.Split(color, key), "jax.lax")

"""jax.experimental.multihost_utils on MPI, after mpicoll.distributed.initialize().

JAX's process_allgather and broadcast_one_to_all jit an identity or a sum whose
collective XLA's partitioner inserts, which runs on JAX's CPU collectives
(gloo); sync_global_devices and assert_equal are built on process_allgather.
initialize() puts these two in their place in JAX's module (so the other two,
which look them up there, follow): the same results and errors, moved by
mpicoll's collectives, so they are watched like every mpicoll call (a rank
that never reaches a sync_global_devices is named by the watchdog in seconds).
Host data: eager mpicoll calls on this process's first device.

    process_allgather (a process's own data)   mpicoll.allgather: stacked, or
                                               concatenated (tiled)
    process_allgather (a global array)         mpicoll.allgatherv of the shards
                                               each process holds first
    broadcast_one_to_all                       mpicoll.allreduce of the source's
                                               data and zeros elsewhere (JAX's
                                               sum: several sources add up)
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils as _jax_utils

from ..ops import collectives, vector

_JAX_OWN = {"process_allgather": _jax_utils.process_allgather,
            "broadcast_one_to_all": _jax_utils.broadcast_one_to_all}


_installed = False  # by install(), which mpicoll.distributed.initialize() calls


def _on_mpi():
    return _installed and jax.process_count() > 1


def _host(x):
    """x as this process's data on its first device, with JAX's dtype (as
    jax.device_put gives it: 64-bit types only under jax_enable_x64)."""
    return jax.device_put(np.asarray(x), jax.local_devices()[0])


def _gather_own(x, tiled):
    host = np.asarray(x)
    if host.ndim == 0 or not tiled:
        host = host[None]
    rows = np.asarray(collectives.allgather(_host(host)))  # (processes, *host.shape)
    return rows.reshape((-1, *rows.shape[2:]))


def _gather_global(x):
    """A global array's every element, on every process: each distinct shard is sent
    once, by the process of its first device (the same choice on every process)."""
    owners = {}
    for device, index in sorted(x.sharding.devices_indices_map(x.shape).items(),
                                key=lambda item: item[0].id):
        key = tuple((s.start, s.stop, s.step) for s in index)
        owners.setdefault(key, (device, index))
    by_process = {}
    for device, index in owners.values():
        by_process.setdefault(device.process_index, []).append((device, index))
    whole = np.empty(x.shape, x.dtype)
    sizes = [sum(whole[index].size for _, index in by_process.get(p, ()))
             for p in range(jax.process_count())]
    mine = {shard.device: shard.data for shard in x.addressable_shards}
    own = [np.asarray(mine[device]).reshape(-1)
           for device, _ in by_process.get(jax.process_index(), ())]
    flat = np.concatenate(own) if own else np.zeros(0, x.dtype)
    gathered = np.asarray(vector.allgatherv(_host(flat), tuple(sizes)))
    at = 0
    for p in range(jax.process_count()):
        for _, index in by_process.get(p, ()):
            size = whole[index].size
            whole[index] = gathered[at:at + size].reshape(whole[index].shape)
            at += size
    return whole


def process_allgather(in_tree, tiled=False):
    """JAX's process_allgather (same arguments, results and errors), on MPI."""
    if not _on_mpi():
        return _JAX_OWN["process_allgather"](in_tree, tiled=tiled)

    def gather(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not tiled:
                raise ValueError("Gathering global non-fully-addressable arrays only "
                                 "supports tiled=True")
            return _gather_global(x)
        return _gather_own(x, tiled)

    return jax.tree.map(gather, in_tree)


def broadcast_one_to_all(in_tree, is_source=None):
    """JAX's broadcast_one_to_all (same arguments, results and errors), on MPI."""
    if not _on_mpi():
        return _JAX_OWN["broadcast_one_to_all"](in_tree, is_source=is_source)
    if is_source is None:
        is_source = jax.process_index() == 0

    def spread(x):
        x = np.asarray(x)
        mine = _host(x if is_source else np.zeros_like(x))
        if mine.dtype == jnp.bool_:  # JAX's sum in bool: whether any source holds True
            return np.asarray(collectives.allreduce(mine, op="lor"))
        return np.asarray(collectives.allreduce(mine))

    return jax.tree.map(spread, in_tree)


def install():
    """Put the MPI versions in JAX's module (mpicoll.distributed.initialize)."""
    global _installed
    _installed = True
    _jax_utils.process_allgather = process_allgather
    _jax_utils.broadcast_one_to_all = broadcast_one_to_all

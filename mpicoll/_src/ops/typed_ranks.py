"""Typed ranks: the mesh whose first axis, RANKS, stands for the MPI ranks, and how
reverse-mode autodiff treats collectives outside it.

Inside jax.shard_map over mesh(), JAX types every value as varying or invariant
over RANKS and checks reverse mode through mpicoll's collectives; outside it,
set_autodiff chooses between refusing and mpi4jax's convention (docs/autodiff.md).
The typing itself, and the state these choices set, are primitive/varying.py's.
"""

import jax
import numpy as np
from jax.sharding import Mesh

from ..primitive import varying

# The mesh axis that stands for the MPI ranks: "mpicoll.RANKS".
RANKS = varying.RANKS


def mesh(local_axis=None, devices=None):
    """A jax.sharding.Mesh whose first axis, RANKS, stands for the MPI ranks.

    Inside jax.shard_map over it, in_specs=P(mpicoll.RANKS) marks this rank's
    data and P() a value that is the same on every rank: JAX then types which
    values vary over the ranks, so reverse-mode autodiff through mpicoll's
    collectives is checked (docs/autodiff.md), and the jax.lax collectives over
    RANKS (psum, all_gather, ppermute, axis_index, ...) run across the ranks on
    mpicoll's (docs/jax-vocabulary.md).

    Args:
        local_axis: None (the default), or the name of a second axis over this
            process's devices, for per-device data (P((mpicoll.RANKS,
            local_axis))) and the ranks x devices collectives
            (axis_name=local_axis).
        devices: the devices of the mesh; default all local devices with a
            local_axis, else the first local device.
    Returns:
        On every rank, a Mesh with the axis RANKS of size 1 (this process,
        standing for every rank), and with a local_axis a second axis over the
        devices: shape (1, number of devices).  No MPI call is made.
    Raises:
        ValueError: for a local_axis named like RANKS, or several devices
            without a local_axis.

    Example (2 ranks)::

        from jax.sharding import PartitionSpec as P
        mean = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, mpicoll.RANKS),
                                     mesh=mpicoll.mesh(), in_specs=P(mpicoll.RANKS),
                                     out_specs=P()))
        mean(jnp.array([rank + 1.0]))        # [1.5] on both
    """
    if local_axis == RANKS:
        raise ValueError(f"mpicoll.mesh: local_axis must differ from {RANKS!r}")
    if devices is None:
        devices = jax.local_devices() if local_axis is not None else jax.local_devices()[:1]
    devices = np.array(list(devices))
    if local_axis is None:
        if devices.size != 1:
            raise ValueError(f"mpicoll.mesh: {devices.size} devices need a local_axis name")
        return Mesh(devices.reshape(1), (RANKS,))
    return Mesh(devices.reshape(1, -1), (RANKS, local_axis))


def set_autodiff(mode):
    """Choose how reverse-mode autodiff treats collectives outside mpicoll.mesh().

    Inside jax.shard_map over mpicoll.mesh() JAX types which values are the same
    on every rank and reverse mode is checked whatever the mode; outside, nothing
    says which are, and this chooses between refusing and a convention
    (docs/autodiff.md).  Forward mode (jvp, jacfwd) is exact in both.

    Args:
        mode: "checked" (the default; MPICOLL_AUTODIFF sets the initial mode):
            transposing a collective outside shard_map over mpicoll.mesh()
            raises TypeError.  "convention": mpicoll's unchecked convention,
            mpi4jax's: a replicated result (allreduce, allgather, bcast) is one
            value, and parameters used with per-rank data need mpicoll.pvary,
            else the gradient is wrong rather than refused.
    Returns:
        The previous mode, "checked" or "convention".
    Raises:
        ValueError: for another mode.
    Note:
        It applies to collectives traced after it (a compiled program keeps
        its mode).  Set it the same on every rank.

    Example::

        previous = mpicoll.set_autodiff("convention")
        grads = jax.grad(global_loss)(params)    # global_loss: pvary(params) inside
        mpicoll.set_autodiff(previous)
    """
    if mode not in varying.AUTODIFF_MODES:
        raise ValueError(f"mpicoll.set_autodiff: mode must be one of {varying.AUTODIFF_MODES}, "
                         f"got {mode!r}")
    return varying.use_autodiff(mode)


def autodiff_mode():
    """The current autodiff mode, for collectives traced from now on (see set_autodiff).

    Returns:
        "checked" (the default) or "convention".

    Example::

        if mpicoll.autodiff_mode() == "checked":
            ...                              # differentiate inside shard_map over mpicoll.mesh()
    """
    return varying.current_autodiff()

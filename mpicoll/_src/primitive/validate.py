"""Argument checks that every rank agrees on, before any MPI call.

Bad arguments raise before any data moves, and usually identically on every
rank (the same code, the same shapes).  But a rejection can depend on this
rank's own data (e.g. scatter's x on a non-root rank), and then the other ranks
would run the call and wait for this one.  So a rank that rejects a call first
compares notes: its rejection takes the place of the call's fingerprint on the
call's communicator, where the other ranks' check of a new call (failures.py)
meets it.  If every rank rejected the call alike, the error is raised as it is;
if not, every rank raises the mismatch (JaxRuntimeError, as a mismatch found
while running).
"""

import operator

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat, users_line_now
from ..runtime import dtypes, comm as comm_layer
from . import varying
from ..observe import failures
from ..runtime.native import extension


def as_array(x, caller):
    """x as a JAX array (or tracer); TypeError for what JAX and MPI cannot move."""
    if isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return x
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        raise TypeError(f"mpicoll.{caller}: x has non-native byte order (dtype {dtype.str!r}); "
                        "JAX and MPI need native byte order: pass "
                        "x.astype(x.dtype.newbyteorder('='))")
    try:
        return jnp.asarray(x)
    except OverflowError as error:  # a Python int beyond the integer dtype JAX gives it
        raise TypeError(f"mpicoll.{caller}: x = {x!r} overflows ({error}); pass an array "
                        "with an explicit dtype that holds it") from error
    except (TypeError, ValueError) as error:
        raise TypeError(f"mpicoll.{caller}: x must be an array or a scalar, "
                        f"got {type(x).__name__}") from error


def static_int(value, name, caller):
    """value as an int known when the program is compiled (a root, a peer, a tag)."""
    try:
        return operator.index(value)
    except TypeError:
        if isinstance(value, jax.core.Tracer):
            raise TypeError(f"mpicoll.{caller}: {name} must be a static int, but it is traced "
                            "(an argument of a jitted function?): MPI needs it when the program "
                            "is compiled; make it static (jax.jit(f, static_argnums=...) or "
                            "static_argnames) or close over it") from None
        raise TypeError(f"mpicoll.{caller}: {name} must be an int, got "
                        f"{type(value).__name__}") from None


def check_root(root, size, caller, among=None):
    root = static_int(root, "root", caller)
    if not 0 <= root < size:
        among = among or f"a communicator of size {size}"
        raise ValueError(f"mpicoll.{caller}: root={root} is out of range for {among}")
    return root


def validated_params(spec, x, info, root, op, transpose_sums, static=()):
    """Check every argument (same outcome on every rank, no MPI traffic) -> (x, params).

    info: the resolved communicator (comm.CommInfo).  static: a family's own
    static arguments as (name, value) pairs (spec.check).
    """
    x = as_array(x, spec.name)
    dtypes.dtype_family(x.dtype, spec.name)
    root = check_root(root, info.size, spec.name) if spec.has_root else 0
    op_code = dtypes.op_code(op, x.dtype, spec.name) if spec.reduces else -1
    if spec.leading_axis_is_size and (x.ndim == 0 or x.shape[0] != info.size):
        raise ValueError(f"mpicoll.{spec.name}: x must have shape (comm size, ...) = "
                         f"({info.size}, ...), got {tuple(x.shape)}")
    params = dict(comm=info.slot, size=info.size, root=root, op=op_code,
                  transpose_sums=bool(transpose_sums), checked_ad=varying.autodiff_checked())
    if spec.check is not None:
        params.update(spec.check(x, info, **dict(static)))
    return x, params


def agreed(comm, caller, validate, *args):
    """validate(*args), whose errors every rank of comm agrees on (see above).

    comm: as a collective takes it, or already resolved (comm.CommInfo); only a
    rejection resolves it here.
    """
    try:
        return validate(*args)
    except (TypeError, ValueError) as error:
        _compare_rejection(comm, caller, error)
        raise


def alone(comm, caller, validate, *args):
    """validate(*args) for point-to-point: a rejection is this rank's alone (only two
    ranks of the communicator take part in a message)."""
    return validate(*args)


def _compare_rejection(comm, caller, error):
    if failures.check_mode() == "off":  # nobody checks: the other ranks are not listening
        return
    try:
        info = comm_layer.resolve(comm, caller)
    except (TypeError, ValueError):  # no communicator to compare on (identical on every rank)
        return
    jax.effects_barrier()  # this rank's pending collectives are not running meanwhile
    # The program would run on one device, or on each local device under
    # pmap/shard_map, each talking on its own communicator.
    devices = 1 if _compat.at_top_level() else _compat.devices_running_this_trace()
    where = users_line_now()
    rejected = f"rejected: {error}" + (f", called at {where}" if where else "")
    for device in range(min(devices, len(info.per_device))):
        mismatch = extension.compare_call(info.slot, device, rejected)
        if mismatch:
            raise jax.errors.JaxRuntimeError(mismatch) from error


def each_leaf(tree, leaves, fn, indices=None):
    """[fn(leaf) for the leaves at indices (default: all)]; an error names the leaf's path."""
    results = []
    for index in range(len(leaves)) if indices is None else indices:
        try:
            results.append(fn(leaves[index]))
        except (TypeError, ValueError) as error:
            path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][index]
            raise type(error)(f"{error} (in the pytree leaf x{jax.tree_util.keystr(path)})") \
                from error
    return results


def check_leaves(spec, tree, leaves, *, info, root=0, op=None):
    """validated_params for every leaf: once per distinct (dtype, leading axis), in tree order."""
    distinct = {}
    for index, leaf in enumerate(leaves):
        distinct.setdefault((leaf.dtype, leaf.shape[:1]), index)
    each_leaf(tree, leaves, lambda leaf: validated_params(spec, leaf, info, root, op, False),
              indices=distinct.values())

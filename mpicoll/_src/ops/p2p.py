"""Point-to-point: send, recv and sendrecv as ordered primitives.

They are specs of the shared mechanism (primitive/define.py), family
"peer": the handler reads [source, dest, send tag, recv tag] from `args`.  They
carry the same ordered MPI effect as the collectives, so on every rank MPI
sees them in program order, also under jit and in loops.  That is the whole
deadlock-freedom rule: a blocking MPI_Send may wait until its receive is
posted, so each rank's program must post sends and receives in an order that
matches its peers' (or use sendrecv, which does both at once).

The source and tag a receive matched (ANY_SOURCE, ANY_TAG) are kept per local
device by the handler and read by `status_p`, an ordered call placed right
after it (return_status=True).

Autodiff: sendrecv is linear, and its transpose is the reverse sendrecv
(source and dest swapped).  send and recv alone are not differentiable: the
receiving rank has no tangent input, so the tangent messages would not match.
"""

import operator

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from .. import _compat
from ..runtime import dtypes
from ..primitive import sharded, validate
from ..primitive.dispatch import bind, on_each_device, overlapping, per_device_overlap
from ..primitive.define import define, effectful_primitive, mpi_effect, ordered_ffi_call
from ..primitive.spec import Collective

ANY_SOURCE = MPI.ANY_SOURCE
ANY_TAG = MPI.ANY_TAG
PROC_NULL = MPI.PROC_NULL
TAG_UB = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)  # the same bound on every communicator


def _rank_arg(value, name, info, caller, any_source=False):
    value = validate.static_int(value, name, caller)
    if value == PROC_NULL or (any_source and value == ANY_SOURCE) or 0 <= value < info.size:
        return value
    allowed = "mpicoll.PROC_NULL" + (", mpicoll.ANY_SOURCE" if any_source else "")
    raise ValueError(f"mpicoll.{caller}: {name}={value} is out of range for a communicator of "
                     f"size {info.size} (a rank 0..{info.size - 1}, or {allowed})")


def _tag_arg(value, name, caller, any_tag=False):
    value = validate.static_int(value, name, caller)
    if 0 <= value <= TAG_UB or (any_tag and value == ANY_TAG):
        return value
    allowed = " or mpicoll.ANY_TAG" if any_tag else ""
    raise ValueError(f"mpicoll.{caller}: {name}={value} is out of range (0..{TAG_UB}{allowed})")


def _shape_arg(shape, caller):
    try:
        shape = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"mpicoll.{caller}: the receive shape must be a tuple of ints, "
                        f"got {shape!r}") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"mpicoll.{caller}: negative dimension in the receive shape {shape}")
    return shape


# ---------------------------------------------------------------------------
# The specs.  Their output is the received array (send: an empty placeholder).

def _check_send(x, info, dest, tag):
    return dict(ffi_args=(PROC_NULL, _rank_arg(dest, "dest", info, "send"),
                          _tag_arg(tag, "tag", "send"), 0))


def _check_recv(x, info, source, tag, shape):
    return dict(ffi_args=(_rank_arg(source, "source", info, "recv", any_source=True),
                          PROC_NULL, 0, _tag_arg(tag, "tag", "recv", any_tag=True)),
                recv_shape=_shape_arg(shape, "recv"))


def _check_sendrecv(x, info, source, dest, sendtag, recvtag, shape):
    return dict(ffi_args=(_rank_arg(source, "source", info, "sendrecv", any_source=True),
                          _rank_arg(dest, "dest", info, "sendrecv"),
                          _tag_arg(sendtag, "sendtag", "sendrecv"),
                          _tag_arg(recvtag, "recvtag", "sendrecv", any_tag=True)),
                recv_shape=_shape_arg(shape, "sendrecv"), send_shape=tuple(x.shape))


def _batch_first(x, dim):
    return jnp.moveaxis(x, dim, 0)  # the message is the whole batch, batch axis first


def _send_batch(x, dim, params):
    return _batch_first(x, dim), params, None  # the placeholder output is not batched


def _sendrecv_batch(x, dim, params):
    x = _batch_first(x, dim)
    batch = x.shape[0]
    return x, {**params, "recv_shape": (batch, *params["recv_shape"]),
               "send_shape": tuple(x.shape)}, 0


def _reverse_sendrecv(ct, params):
    """The transpose: each message travels back, from its receiver to its sender."""
    source, dest, sendtag, recvtag = params["ffi_args"]
    if source == ANY_SOURCE:
        raise NotImplementedError("mpicoll.sendrecv: cannot transpose a receive from "
                                  "ANY_SOURCE (the reverse message needs a definite dest)")
    # The reverse receive takes any tag from the (definite) reverse source.
    reverse = (dest, source, recvtag if recvtag != ANY_TAG else sendtag, ANY_TAG)
    return SENDRECV.run(ct, params, ffi_args=reverse, recv_shape=params["send_shape"],
                        send_shape=params["recv_shape"])


def _not_linear(ct, params):
    raise NotImplementedError("unreachable: send/recv have no JVP")


_NOT_DIFFERENTIABLE = ("send and recv are not differentiable (the receiving rank has no "
                       "tangent input, so tangent messages would not match); use sendrecv, "
                       "whose transpose is the reverse sendrecv")

SEND = define(Collective(
    "send",
    out_shape=lambda shape, params: (0,),
    transpose=_not_linear,
    family="peer",
    check=_check_send,
    batch=_send_batch,
    not_differentiable=_NOT_DIFFERENTIABLE,
))

RECV = define(Collective(
    "recv",
    out_shape=lambda shape, params: params["recv_shape"],
    transpose=_not_linear,
    family="peer",
    check=_check_recv,
    not_differentiable=_NOT_DIFFERENTIABLE,
))

SENDRECV = define(Collective(
    "sendrecv",
    out_shape=lambda shape, params: params["recv_shape"],
    transpose=_reverse_sendrecv,
    family="peer",
    check=_check_sendrecv,
    batch=_sendrecv_batch,
))


# ---------------------------------------------------------------------------
# The status of the last receive on this device: int32 [source, tag].

def _status_lowering(ctx):
    return ordered_ffi_call(ctx, "mpicoll_status", numbered=False)  # reads, compares nothing


status_p = effectful_primitive(
    "mpicoll_status",
    lambda: (_compat.ShapedArray((2,), np.dtype(np.int32)), {mpi_effect}), _status_lowering)


def _with_status(out, return_status):
    if not return_status:
        return out
    status = status_p.bind()
    return out, status[0], status[1]


def _plain(value):
    """A concrete integer array (e.g. a received source) as an int, for the eager cache key."""
    if isinstance(value, (jax.Array, np.ndarray, np.integer)) and not isinstance(
            value, jax.core.Tracer):
        try:
            return operator.index(value)
        except TypeError:
            pass  # the check reports it
    return value


def _template(template, caller):
    shape, dtype = getattr(template, "shape", None), getattr(template, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"mpicoll.{caller}: the template must have .shape and .dtype (an "
                        f"array or jax.ShapeDtypeStruct), got {type(template).__name__}")
    dtype = np.dtype(dtype)
    if dtype not in dtypes.DTYPE_FAMILIES:
        raise TypeError(f"mpicoll.{caller}: the template has unsupported dtype {dtype}; "
                        f"supported dtypes: {', '.join(map(str, dtypes.DTYPE_FAMILIES))}")
    return _shape_arg(shape, caller), dtype


# ---------------------------------------------------------------------------
# Public API (mpi4py's names and argument order).

@_compat.api_boundary
def send(x, dest, tag=0, *, comm=None):
    """Send x to rank dest of comm (MPI_Send), in program order.

    Args:
        x: one array (not a pytree) of a supported dtype (those of the
            collectives), or a Python scalar.
        dest: the receiving rank (a static int), or PROC_NULL (nothing is sent).
        tag: the message tag, a static int >= 0.
        comm: an mpi4py intracommunicator; None means MPI.COMM_WORLD.
    Returns:
        None.  Not differentiable (NotImplementedError under jax.grad or jvp);
        sendrecv is.
    Raises:
        TypeError, ValueError: on this rank, before any MPI call, for an
            unsupported dtype, a dest or tag out of range, or a communicator that
            is not one (point-to-point checks are not compared across ranks).

    Example (2 ranks)::

        if rank == 0:
            mpicoll.send(jnp.arange(3.0), dest=1)
        else:
            x = mpicoll.recv(jnp.zeros(3), source=0)   # [0., 1., 2.]
    """
    layout = sharded.layout_of(x, "send")
    if layout is not None:  # each device sends its shard, to the same device of dest
        on_each_device(lambda shard: _per_device(send, shard, dest, tag, comm=comm) or (),
                       (x,), layout, ())
        return None
    bind(SEND, x, comm=comm, static=(("dest", _plain(dest)), ("tag", _plain(tag))))


def _per_device(function, *args, **kwargs):
    """function(*args) on one device's shard, on its progress thread where on CPU
    (primitive/sharded.py says why)."""
    with overlapping(per_device_overlap()):
        return function(*args, **kwargs)


@_compat.api_boundary
def recv(template, source, tag=0, *, comm=None, return_status=False):
    """Receive an array shaped like template from rank source of comm (MPI_Recv).

    Args:
        template: an array or a jax.ShapeDtypeStruct: the shape and dtype of
            the message (only they are read).
        source: the sending rank (a static int), ANY_SOURCE, or PROC_NULL.
        tag: the message tag (a static int), or ANY_TAG.
        comm: an mpi4py intracommunicator; None means MPI.COMM_WORLD.
        return_status: also return which message was received.
    Returns:
        The received array (template's shape and dtype); with return_status,
        (x, source, tag), the last two int32 scalars.  A receive from
        PROC_NULL returns zeros.  A shorter message than the template raises
        (jax.errors.JaxRuntimeError naming both sizes); a longer one is
        MPI's truncation error.  Not differentiable.
    Raises:
        TypeError, ValueError: on this rank, before any MPI call, for a
            template without shape and dtype, an unsupported dtype, a source or
            tag out of range, or a communicator that is not one.

    Example (2 ranks)::

        x, source, tag = mpicoll.recv(jnp.zeros(3), mpicoll.ANY_SOURCE,
                                      return_status=True)
    """
    shape, dtype = _template(template, "recv")
    layout = sharded.layout_of(template, "recv")
    if layout is not None:  # each device receives its shard, from the same device of source
        part = jax.ShapeDtypeStruct(sharded.shard_shape(layout, shape), dtype)
        spec = layout.spec
        outs = on_each_device(
            lambda: _per_device(recv, part, source, tag, comm=comm, return_status=True),
            (), layout, (spec, jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec()))
        return outs if return_status else outs[0]
    out = bind(RECV, jnp.zeros((0,), dtype), comm=comm,
                            static=(("source", _plain(source)), ("tag", _plain(tag)),
                                    ("shape", shape)))
    return _with_status(out, return_status)


@_compat.api_boundary
def sendrecv(x, source, dest, sendtag=0, recvtag=ANY_TAG, *, comm=None, recv_like=None,
             return_status=False):
    """Send x to dest and receive from source in one call (MPI_Sendrecv).

    Args:
        x: one array (not a pytree) of a supported dtype, or a Python scalar.
        source: the rank received from (a static int), ANY_SOURCE or
            PROC_NULL.
        dest: the rank sent to (a static int) or PROC_NULL.
        sendtag: the tag sent, a static int >= 0 (default 0).
        recvtag: the tag received, a static int, or ANY_TAG (the default).
        comm: an mpi4py intracommunicator; None means MPI.COMM_WORLD.
        recv_like: an array or jax.ShapeDtypeStruct of x's dtype giving the
            received shape (default: x's).
        return_status: also return (source, tag) of the received message.
    Returns:
        The received array; with return_status, (x, source, tag) as for recv.
        From PROC_NULL: zeros.  Linear: under jax.grad its transpose sends
        the cotangent back the other way; it works under jit and vmap.
    Raises:
        TypeError, ValueError: on this rank, before any MPI call, for an
            unsupported dtype, recv_like of another dtype, a rank or tag out of
            range, or a communicator that is not one.

    Example (a ring on every rank)::

        right = mpicoll.sendrecv(x, source=(rank - 1) % size, dest=(rank + 1) % size)
    """
    x = validate.as_array(x, "sendrecv")
    shape = tuple(x.shape)
    if recv_like is not None:
        shape, dtype = _template(recv_like, "sendrecv")
        if dtype != x.dtype:
            raise TypeError(f"mpicoll.sendrecv: recv_like has dtype {dtype}, but x has "
                            f"{x.dtype}; both sides of a sendrecv move one dtype")
    layout = sharded.layout_of(x, "sendrecv")
    if layout is not None:  # each device exchanges its shard with the same device of its peers
        part = jax.ShapeDtypeStruct(sharded.shard_shape(layout, shape), x.dtype)
        outs = on_each_device(
            lambda shard: _per_device(sendrecv, shard, source, dest, sendtag, recvtag,
                                      comm=comm, recv_like=part, return_status=True),
            (x,), layout, (layout.spec, jax.sharding.PartitionSpec(),
                           jax.sharding.PartitionSpec()))
        return outs if return_status else outs[0]
    out = bind(SENDRECV, x, comm=comm, static=(
        ("source", _plain(source)), ("dest", _plain(dest)), ("sendtag", _plain(sendtag)),
        ("recvtag", _plain(recvtag)), ("shape", shape)))
    return _with_status(out, return_status)

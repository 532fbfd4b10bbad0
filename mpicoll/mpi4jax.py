"""mpi4jax 0.9's public API over mpicoll's: `import mpicoll.mpi4jax as mpi4jax`.

The same function names, argument order, keywords and defaults, and the same
results, including mpi4jax's rank-dependent ones: off root, gather and reduce
return their input unchanged, and scatter takes a block-shaped x.  Like
mpi4jax >= 0.8 the functions return arrays, not tokens (ordering is automatic),
and passing `token=` raises.  `comm` is an mpi4py intracommunicator, `op` an
mpi4py `MPI.Op` (names such as "sum" work too), `status` an `MPI.Status` that
recv/sendrecv fill in.  Everything else is mpicoll's; the README lists the
differences.  Its collectives follow mpicoll's autodiff convention (as
with mpicoll.set_autodiff("convention")), as mpi4jax differentiates anywhere.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import io_callback
from mpi4py import MPI

from . import _native, _typing, _validate, api, comm as comm_layer, p2p

__version__ = "0.9.1"  # the mpi4jax API this module follows


def _mpi4jax_autodiff(function):
    """mpi4jax differentiates allreduce and sendrecv anywhere, by the convention
    mpicoll's "convention" mode is (an allreduce's cotangent passes through): a
    program written for it expects that, so the adapter's calls follow it."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with _typing.convention_autodiff():
            return function(*args, **kwargs)
    return call


_NOTSET = object()

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "recv", "reduce",
           "scan", "scatter", "send", "sendrecv", "has_cuda_support", "has_sycl_support"]


# What each function returns, to say how a pre-0.8 call (with a token) is written now.
_RETURNS_NOTHING = ("barrier", "send")


def _no_token(name, token):
    if token is not _NOTSET:
        before, now = ((f"token = mpi4jax.{name}(..., token=token)", f"mpi4jax.{name}(...)")
                       if name in _RETURNS_NOTHING else
                       (f"result, token = mpi4jax.{name}(..., token=token)",
                        f"result = mpi4jax.{name}(...)"))
        raise RuntimeError(
            f"mpicoll.mpi4jax.{name}: tokens are not passed explicitly (as in mpi4jax >= 0.8, "
            f"ordering is automatic): write `{now}` instead of `{before}`")


def _rank(comm, name):
    return comm_layer.resolve(comm, name).rank


def has_cuda_support():
    """True if this mpicoll build has CUDA handlers (GPU arrays work)."""
    return "cuda" in _native.PLATFORMS


def has_sycl_support():
    """False: mpicoll has no SYCL (Intel GPU) handlers."""
    return False


@_mpi4jax_autodiff
def allreduce(x, op, *, comm=None, token=_NOTSET):
    """op over every rank's x, on every rank."""
    _no_token("allreduce", token)
    return api.allreduce(x, op, comm=comm)


@_mpi4jax_autodiff
def allgather(x, *, comm=None, token=_NOTSET):
    """(size, *x.shape): every rank's x, by rank."""
    _no_token("allgather", token)
    return api.allgather(x, comm=comm)


def _leading_axis_is_size(x, comm, name, what):
    """mpi4jax's own shape check: local to the rank that calls (as in mpi4jax, a
    rank that alone passes a wrong shape raises alone; mpicoll's checks, which
    every rank agrees on, run after it)."""
    x = _validate.as_array(x, name)
    size = comm_layer.resolve(comm, name).size
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(f"{what} input must have shape (nproc, ...) = ({size}, ...), "
                         f"got {tuple(x.shape)} (mpicoll.mpi4jax.{name})")
    return x


@_mpi4jax_autodiff
def alltoall(x, *, comm=None, token=_NOTSET):
    """x: (size, *s); out[j] = x[rank] of rank j."""
    _no_token("alltoall", token)
    x = _leading_axis_is_size(x, comm, "alltoall", "Alltoall")
    return api.alltoall(x, comm=comm)


def barrier(*, comm=None, token=_NOTSET):
    """Wait for every rank (in program order)."""
    _no_token("barrier", token)
    api.barrier(comm=comm)


@_mpi4jax_autodiff
def bcast(x, root, *, comm=None, token=_NOTSET):
    """root's x on every rank (x sets the shape and dtype elsewhere)."""
    _no_token("bcast", token)
    return api.bcast(x, root, comm=comm)


@_mpi4jax_autodiff
def gather(x, root, *, comm=None, token=_NOTSET):
    """On root (size, *x.shape), every rank's x; elsewhere x unchanged."""
    _no_token("gather", token)
    gathered = api.gather(x, root, comm=comm)
    return gathered if _rank(comm, "gather") == root else x


@_mpi4jax_autodiff
def reduce(x, op, root, *, comm=None, token=_NOTSET):
    """On root op over every rank's x; elsewhere x unchanged."""
    _no_token("reduce", token)
    reduced = api.reduce(x, op, root, comm=comm)
    return reduced if _rank(comm, "reduce") == root else x


@_mpi4jax_autodiff
def scatter(x, root, *, comm=None, token=_NOTSET):
    """Rank r gets root's x[r]; x is (size, *s) on root and s-shaped elsewhere."""
    _no_token("scatter", token)
    info = comm_layer.resolve(comm, "scatter")
    if info.rank == root:
        x = _leading_axis_is_size(x, comm, "scatter", "Scatter")
    else:
        # mpicoll's scatter takes (size, *s) everywhere; only root's content is read.
        x = _validate.as_array(x, "scatter")
        x = jnp.broadcast_to(x, (info.size, *x.shape))
    return api.scatter(x, root, comm=comm)


@_mpi4jax_autodiff
def scan(x, op, *, comm=None, token=_NOTSET):
    """Rank r gets op over the x of ranks 0..r."""
    _no_token("scan", token)
    return api.scan(x, op, comm=comm)


@_mpi4jax_autodiff
def send(x, dest, *, tag=0, comm=None, token=_NOTSET):
    """Send x to dest."""
    _no_token("send", token)
    p2p.send(x, dest, tag, comm=comm)


def _fill_status(status, dtype, count, source, tag):
    def fill(source, tag):
        status.Set_source(int(source))
        status.Set_tag(int(tag))
        try:
            from mpi4py.util import dtlib
            status.Set_elements(dtlib.from_numpy_dtype(dtype), count)
        except (ImportError, ValueError, KeyError, TypeError):
            pass  # a dtype mpi4py has no MPI type for (bfloat16): source and tag only
    if isinstance(source, jax.core.Tracer):
        io_callback(fill, None, source, tag, ordered=True)
    else:
        fill(source, tag)


@_mpi4jax_autodiff
def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=_NOTSET):
    """A new array shaped like x with the message from source (x is not read)."""
    _no_token("recv", token)
    x = _validate.as_array(x, "recv")
    if status is None:
        return p2p.recv(x, source, tag, comm=comm)
    out, received_from, received_tag = p2p.recv(x, source, tag, comm=comm, return_status=True)
    _fill_status(status, x.dtype, x.size, received_from, received_tag)
    return out


@_mpi4jax_autodiff
def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None, token=_NOTSET):
    """Send sendbuf to dest and receive an array shaped like recvbuf from source."""
    _no_token("sendrecv", token)
    recvbuf = _validate.as_array(recvbuf, "sendrecv")
    result = p2p.sendrecv(sendbuf, source, dest, sendtag, recvtag, comm=comm, recv_like=recvbuf,
                          return_status=status is not None)
    if status is None:
        return result
    out, received_from, received_tag = result
    _fill_status(status, recvbuf.dtype, recvbuf.size, received_from, received_tag)
    return out

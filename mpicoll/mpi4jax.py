"""mpi4jax 0.9's public API over mpicoll's: `import mpicoll.mpi4jax as mpi4jax`.

The same function names, argument order, keywords and defaults, and the same
results, including mpi4jax's rank-dependent ones: off root, gather and reduce
return their input unchanged, and scatter takes a block-shaped x.  Like
mpi4jax >= 0.8 the functions return arrays, not tokens (ordering is automatic).
A call that passes `token=` (None too) takes mpi4jax <= 0.7's form instead and
returns `(result, token)` (send and barrier: the token), with a token that keeps
jitted kernels on JAX's fast path (_Token).  With MPICOLL_AS_MPI4JAX=1,
`import mpi4jax` gives this module (_mpicoll_as_mpi4jax.py, at the repository
root).  `comm` is an mpi4py intracommunicator, `op` an
mpi4py `MPI.Op` (names such as "sum" work too), `status` an `MPI.Status` that
recv/sendrecv fill in.  Everything else is mpicoll's; docs/mpi4jax.md lists the
differences.  Its collectives follow mpicoll's autodiff convention (as
with mpicoll.set_autodiff("convention")), as mpi4jax differentiates anywhere.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import io_callback
from mpi4py import MPI

from ._src._compat import core as _compat_core
from ._src.runtime import native, comm as comm_layer
from ._src.primitive import spec, varying, validate
from ._src.ops import collectives, p2p

__version__ = "0.9.1"  # the mpi4jax API this module follows


def _mpi4jax_autodiff(function):
    """mpi4jax differentiates allreduce and sendrecv anywhere, by the convention
    mpicoll's "convention" mode is (an allreduce's cotangent passes through): a
    program written for it expects that, so the adapter's calls follow it."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with varying.convention_autodiff():
            return function(*args, **kwargs)
    return call


class _NotSet:
    """The default of token=: no token given (mpi4jax >= 0.8's form)."""

    def __repr__(self):
        return "<no token>"


_NOTSET = _NotSet()

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "recv", "reduce",
           "scan", "scatter", "send", "sendrecv", "has_cuda_support", "has_sycl_support"]


# --- The token era: mpi4jax <= 0.7's form, for calls that pass token= ------------------

# The functions that return nothing in mpi4jax 0.9's form (the token alone in 0.7's).
_RETURNS_NOTHING = ("barrier", "send")


class _Token:
    """The token of the token era: an empty pytree (as None is), one instance.

    Programs of the token era pass the last token into and out of every jitted
    kernel.  A pytree without leaves adds no argument and no result to the
    kernel, which stays on JAX's C++ dispatch path: measured on jax 0.10.2, CPU,
    2 ranks on 2 cores, a 5 us kernel costs 1.08-1.14x with it, 1.28-1.43x with
    an empty bool array (an extra result) and ~19x (96 us) with a JAX token
    (jax.lax.create_token()), which that path does not take
    (benchmarks/token_cost.py, in `make bench`).  It orders nothing: mpicoll's
    calls run in program order without it.
    """

    def __repr__(self):
        return "<mpicoll.mpi4jax token>"


_MPICOLL_TOKEN = _Token()
jax.tree_util.register_pytree_node(_Token, lambda token: ((), None),
                                   lambda aux, leaves: _MPICOLL_TOKEN)


def _is_token(token):
    """mpicoll's token, or JAX's own (traced or not)."""
    if isinstance(token, _Token):
        return True
    try:
        return jax.typeof(token) == _compat_core.abstract_token
    except TypeError:
        return False


def _describe(value):
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    return type(value).__name__ + (f" of shape {tuple(shape)} and dtype {dtype}"
                                   if shape is not None and dtype is not None else "")


def _token_era(function):
    """Give `function` mpi4jax <= 0.7's form for the calls that pass token= (None too).

    Such a call returns (result, token), or the token alone for send and barrier;
    the token returned is the one given (so that a loop's carry keeps its type),
    or _MPICOLL_TOKEN for None.  The token orders nothing: every call runs in
    program order on every rank, as without one.  A call without token= is
    mpi4jax 0.9's and returns the result alone.  The token keyword is taken
    here: `function`'s own token parameter is there for its signature
    (mpi4jax's) and is never passed.
    """
    name = function.__name__
    token_only = name in _RETURNS_NOTHING

    @functools.wraps(function)
    def call(*args, token=_NOTSET, **kwargs):
        if token is _NOTSET:
            return function(*args, **kwargs)
        if token is None:
            token = _MPICOLL_TOKEN
        elif not _is_token(token):
            # Checked on the token's type alone: the same on every rank, before any MPI call.
            raise TypeError(
                f"mpicoll.mpi4jax.{name}: token= must be None, a token an earlier call "
                f"returned, or a JAX token (jax.lax.create_token()); got {_describe(token)}")
        result = function(*args, **kwargs)
        return token if token_only else (result, token)
    return call


def _rank(comm, name):
    return comm_layer.resolve(comm, name).rank


# What the functions have in common, put into each docstring by _contract.
_COMM = """an mpi4py intracommunicator; None (the default) means
            MPI.COMM_WORLD (mpi4jax 0.9 takes a Clone() of it; mpicoll talks on
            private duplicates, the same isolation from your own mpi4py calls)."""

_TOKEN = """not needed: as in mpi4jax >= 0.8, the calls run in program
            order on every rank.  Passed (None too), the call takes mpi4jax
            <= 0.7's form and returns (result, token) -- send and barrier the
            token alone --, the token given or, for None, mpicoll's token: an
            empty pytree, which a jitted kernel passes on at no cost.  A JAX
            token (jax.lax.create_token()) is accepted too."""

_OP = """an mpi4py MPI.Op (MPI.SUM, MPI.MAX, ...) or its name ("sum");
            the ops and dtypes of mpicoll.allreduce."""

_RAISES = """TypeError: for a token= that is not None, a token of this module or
            a JAX token: on every rank alike, before any MPI call.
        TypeError, ValueError: as mpicoll.{name} raises them: the same on
            every rank and before any MPI call, for an unsupported dtype, an
            op invalid for it, a root out of range, or a comm that is not an
            intracommunicator."""

_RAISES_PEER = """TypeError: for a token= that is not None, a token of this module or
            a JAX token: on every rank alike, before any MPI call.
        TypeError, ValueError: as mpicoll.{name} raises them, on this rank
            alone (a message has two ranks) and before any MPI call, for an
            unsupported dtype, a rank or tag out of range, or a comm that is
            not an intracommunicator."""


_contract = spec.documented({"comm": _COMM, "token": _TOKEN, "op": _OP, "raises": _RAISES,
                             "raises_peer": _RAISES_PEER}, boundary=False)


def has_cuda_support():
    """Whether this mpicoll build has CUDA handlers, so that GPU arrays work.

    Returns:
        True for a build with CUDA handlers (MPICOLL_CUDA, docs/install.md),
        else False.  `python -m mpicoll info` shows the platforms and the GPU
        transport in use.

    Example::

        if not mpi4jax.has_cuda_support():
            x = jax.device_put(x, jax.devices("cpu")[0])   # keep the data on the host
    """
    return "cuda" in native.PLATFORMS


def has_sycl_support():
    """Whether SYCL (Intel GPU) arrays work: never, in mpicoll.

    Returns:
        False (mpicoll has no SYCL handlers).

    Example::

        mpi4jax.has_sycl_support()           # False
    """
    return False


@_contract
@_token_era
@_mpi4jax_autodiff
def allreduce(x, op, *, comm=None, token=_NOTSET):
    """op over every rank's x, on every rank (MPI_Allreduce).

    Args:
        x: an array (or, unlike mpi4jax, a pytree of arrays).
        op: {op}
        comm: {comm}
        token: {token}
    Returns:
        On every rank, op over every rank's x (shape and dtype of x).  With
        MPI.SUM it is differentiable anywhere, as in mpi4jax: its transpose
        passes the cotangent through (mpicoll's "convention" autodiff mode).
    Raises:
        {raises}

    Example (2 ranks)::

        mpi4jax.allreduce(jnp.array([rank + 1.0]), op=MPI.SUM)  # [3.] on both
    """
    return collectives.allreduce(x, op, comm=comm)


@_contract
@_token_era
@_mpi4jax_autodiff
def allgather(x, *, comm=None, token=_NOTSET):
    """Every rank's x, stacked by rank, on every rank (MPI_Allgather).

    Args:
        x: an array, the same shape and dtype on every rank.
        comm: {comm}
        token: {token}
    Returns:
        On every rank, shape (size, *x.shape) with row r = rank r's x.
    Raises:
        {raises}

    Example (2 ranks)::

        mpi4jax.allgather(jnp.array(rank))   # [0, 1] on both
    """
    return collectives.allgather(x, comm=comm)


def _leading_axis_is_size(x, comm, name, what):
    """mpi4jax's own shape check: local to the rank that calls (as in mpi4jax, a
    rank that alone passes a wrong shape raises alone; mpicoll's checks, which
    every rank agrees on, run after it)."""
    x = validate.as_array(x, name)
    size = comm_layer.resolve(comm, name).size
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(f"{what} input must have shape (nproc, ...) = ({size}, ...), "
                         f"got {tuple(x.shape)} (mpicoll.mpi4jax.{name})")
    return x


@_contract
@_token_era
@_mpi4jax_autodiff
def alltoall(x, *, comm=None, token=_NOTSET):
    """Every rank sends x[j] to rank j (MPI_Alltoall).

    Args:
        x: shape (size, *s) (size: comm's size).
        comm: {comm}
        token: {token}
    Returns:
        On rank r, shape x.shape with row j = rank j's x[r].
    Raises:
        {raises}
        ValueError: on this rank alone (mpi4jax's own check and message),
            when x's leading axis is not comm's size.

    Example (2 ranks)::

        mpi4jax.alltoall(jnp.array([10 * rank, 10 * rank + 1]))  # rank 0: [0, 10]; 1: [1, 11]
    """
    x = _leading_axis_is_size(x, comm, "alltoall", "Alltoall")
    return collectives.alltoall(x, comm=comm)


@_contract
@_token_era
def barrier(*, comm=None, token=_NOTSET):
    """Block until every rank of comm has reached this point (MPI_Barrier), in program order.

    Args:
        comm: {comm}
        token: {token}
    Returns:
        None; with token=, the token (mpi4jax <= 0.7's form).
    Raises:
        {raises}

    Example::

        mpi4jax.barrier()
    """
    collectives.barrier(comm=comm)


@_contract
@_token_era
@_mpi4jax_autodiff
def bcast(x, root, *, comm=None, token=_NOTSET):
    """Root's x on every rank (MPI_Bcast).

    Args:
        x: an array; on the other ranks only its shape and dtype are used.
        root: the rank whose x is sent (a static int).
        comm: {comm}
        token: {token}
    Returns:
        On every rank, root's x.
    Raises:
        {raises}

    Example (2 ranks)::

        mpi4jax.bcast(jnp.full(3, rank), root=1)   # [1, 1, 1] on both
    """
    return collectives.bcast(x, root, comm=comm)


@_contract
@_token_era
@_mpi4jax_autodiff
def gather(x, root, *, comm=None, token=_NOTSET):
    """Every rank's x, stacked by rank, on root (MPI_Gather).

    Args:
        x: an array, the same shape and dtype on every rank.
        root: the rank that receives the stack (a static int).
        comm: {comm}
        token: {token}
    Returns:
        On root, shape (size, *x.shape) with row r = rank r's x; on the other
        ranks x unchanged (mpi4jax's convention; mpicoll.gather gives zeros
        of the stack's shape there).
    Raises:
        {raises}

    Example (2 ranks)::

        mpi4jax.gather(jnp.array([rank]), root=0)  # rank 0: [[0], [1]]; rank 1: [1]
    """
    gathered = collectives.gather(x, root, comm=comm)
    return gathered if _rank(comm, "gather") == root else x


@_contract
@_token_era
@_mpi4jax_autodiff
def reduce(x, op, root, *, comm=None, token=_NOTSET):
    """op over every rank's x, on root (MPI_Reduce).

    Args:
        x: an array, the same shape and dtype on every rank.
        op: {op}
        root: the rank that receives the result (a static int).
        comm: {comm}
        token: {token}
    Returns:
        On root, op over every rank's x; on the other ranks x unchanged
        (mpi4jax's convention; mpicoll.reduce gives zeros there).
    Raises:
        {raises}

    Example (2 ranks)::

        mpi4jax.reduce(jnp.array([rank + 1.0]), op=MPI.SUM, root=0)  # rank 0: [3.]; 1: [2.]
    """
    reduced = collectives.reduce(x, op, root, comm=comm)
    return reduced if _rank(comm, "reduce") == root else x


@_contract
@_token_era
@_mpi4jax_autodiff
def scatter(x, root, *, comm=None, token=_NOTSET):
    """Rank r gets root's x[r] (MPI_Scatter).

    Args:
        x: on root shape (size, *s); on the other ranks shape s (its values
            are not read), as in mpi4jax.  mpicoll broadcasts it to (size, *s)
            there: one extra buffer of size blocks on non-root ranks.
        root: the rank whose x is scattered (a static int).
        comm: {comm}
        token: {token}
    Returns:
        On rank r, root's x[r] (shape s).
    Raises:
        {raises}
        ValueError: on root alone (mpi4jax's own check and message), when
            x's leading axis is not comm's size.

    Example (2 ranks)::

        x = jnp.array([[10, 11], [20, 21]]) if rank == 0 else jnp.zeros(2, int)
        mpi4jax.scatter(x, root=0)           # rank 0: [10, 11]; rank 1: [20, 21]
    """
    info = comm_layer.resolve(comm, "scatter")
    if info.rank == root:
        x = _leading_axis_is_size(x, comm, "scatter", "Scatter")
    else:
        # mpicoll's scatter takes (size, *s) everywhere; only root's content is read.
        x = validate.as_array(x, "scatter")
        x = jnp.broadcast_to(x, (info.size, *x.shape))
    return collectives.scatter(x, root, comm=comm)


@_contract
@_token_era
@_mpi4jax_autodiff
def scan(x, op, *, comm=None, token=_NOTSET):
    """Inclusive prefix reduction in rank order (MPI_Scan).

    Args:
        x: an array, the same shape and dtype on every rank.
        op: {op}
        comm: {comm}
        token: {token}
    Returns:
        On rank r, op over the x of ranks 0..r.
    Raises:
        {raises}

    Example (2 ranks)::

        mpi4jax.scan(jnp.array(rank + 1), op=MPI.SUM)   # rank 0: 1; rank 1: 3
    """
    return collectives.scan(x, op, comm=comm)


@_contract
@_token_era
@_mpi4jax_autodiff
def send(x, dest, *, tag=0, comm=None, token=_NOTSET):
    """Send x to rank dest (MPI_Send), in program order.

    Args:
        x: an array.
        dest: the receiving rank (a static int), or MPI.PROC_NULL.
        tag: the message tag, a static int >= 0 (default 0).
        comm: {comm}
        token: {token}
    Returns:
        None; with token=, the token (mpi4jax <= 0.7's form).
    Raises:
        {raises_peer}

    Example (2 ranks)::

        if rank == 0:
            mpi4jax.send(jnp.arange(3.0), dest=1)
        else:
            x = mpi4jax.recv(jnp.zeros(3), source=0)   # [0., 1., 2.]
    """
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


@_contract
@_token_era
@_mpi4jax_autodiff
def recv(x, source=MPI.ANY_SOURCE, *, tag=MPI.ANY_TAG, comm=None, status=None, token=_NOTSET):
    """Receive a message shaped like x from rank source (MPI_Recv).

    Args:
        x: an array giving the message's shape and dtype (not read).
        source: the sending rank (a static int), MPI.ANY_SOURCE (the
            default) or MPI.PROC_NULL.
        tag: the message tag (a static int), or MPI.ANY_TAG (the default).
        comm: {comm}
        status: an MPI.Status to fill with the message's source and tag (and
            element count, where mpi4py knows the dtype); under jax.jit it is
            filled when the result is ready.
        token: {token}
    Returns:
        A new array of x's shape and dtype holding the message (zeros from
        MPI.PROC_NULL, where mpi4jax leaves the buffer as it is).
    Raises:
        {raises_peer}

    Example (2 ranks)::

        status = MPI.Status()
        if rank == 1:
            x = mpi4jax.recv(jnp.zeros(3), source=0, status=status)   # status.Get_source() == 0
    """
    x = validate.as_array(x, "recv")
    if status is None:
        return p2p.recv(x, source, tag, comm=comm)
    out, received_from, received_tag = p2p.recv(x, source, tag, comm=comm, return_status=True)
    _fill_status(status, x.dtype, x.size, received_from, received_tag)
    return out


@_contract
@_token_era
@_mpi4jax_autodiff
def sendrecv(sendbuf, recvbuf, source, dest, *, sendtag=0, recvtag=MPI.ANY_TAG, comm=None,
             status=None, token=_NOTSET):
    """Send sendbuf to dest and receive from source in one call (MPI_Sendrecv).

    Args:
        sendbuf: the array sent.
        recvbuf: an array giving the received shape (not read); it must have
            sendbuf's dtype (mpi4jax allows another).
        source: the rank received from (a static int), MPI.ANY_SOURCE or
            MPI.PROC_NULL.
        dest: the rank sent to (a static int) or MPI.PROC_NULL.
        sendtag: the tag sent, a static int >= 0 (default 0).
        recvtag: the tag received, or MPI.ANY_TAG (the default).
        comm: {comm}
        status: an MPI.Status to fill with the received message's source and
            tag, as for recv.
        token: {token}
    Returns:
        A new array of recvbuf's shape holding the message.  Differentiable
        anywhere, as in mpi4jax (its transpose is the reverse sendrecv), and
        in forward mode too, where mpi4jax raises.
    Raises:
        {raises_peer}

    Example (a ring on every rank)::

        left = mpi4jax.sendrecv(x, x, source=(rank - 1) % size, dest=(rank + 1) % size)
    """
    recvbuf = validate.as_array(recvbuf, "sendrecv")
    result = p2p.sendrecv(sendbuf, source, dest, sendtag, recvtag, comm=comm, recv_like=recvbuf,
                          return_status=status is not None)
    if status is None:
        return result
    out, received_from, received_tag = result
    _fill_status(status, recvbuf.dtype, recvbuf.size, received_from, received_tag)
    return out

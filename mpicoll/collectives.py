"""MPI collectives as ordered JAX primitives.

One mechanism serves every collective: a `Collective` spec says how the output
shape follows from the input shape and the communicator size, whether the op
takes a root and a reduction op, and which FFI target runs it.  `_make_primitive`
turns a spec into a JAX primitive (abstract evaluation, eager evaluation, and a
lowering to an FFI custom call that threads the MPI ordering token), and
`_bind` validates the arguments identically on every rank before binding.
"""

import dataclasses
import operator
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from . import _compat, _dtypes_and_ops, comm as comm_layer


class MPIEffect(_compat.Effect):
    """The ordered effect of every mpicoll collective: program order on every rank."""

    def __str__(self):
        return "MPI"


mpi_effect = MPIEffect()
_compat.register_ordered_effect(MPIEffect)


@dataclasses.dataclass(frozen=True)
class Collective:
    """The specification of one collective; everything else is shared."""
    name: str
    out_shape: Callable[[tuple, int], tuple]  # (input shape, comm size) -> output shape
    has_root: bool = False
    reduces: bool = False
    leading_axis_is_size: bool = False  # x must have shape (size, ...)

    @property
    def target(self):
        return f"mpicoll_{self.name}"


def _same(shape, size):
    return shape


def _stacked(shape, size):
    return (size, *shape)


def _unstacked(shape, size):
    return shape[1:]


BCAST = Collective("bcast", _same, has_root=True)
SCATTER = Collective("scatter", _unstacked, has_root=True, leading_axis_is_size=True)
REDUCE = Collective("reduce", _same, has_root=True, reduces=True)
ALLREDUCE = Collective("allreduce", _same, reduces=True)
GATHER = Collective("gather", _stacked, has_root=True)
ALLGATHER = Collective("allgather", _stacked)
ALLTOALL = Collective("alltoall", _same, leading_axis_is_size=True)


# ---------------------------------------------------------------------------
# The shared mechanism.

def _make_primitive(spec):
    primitive = Primitive(spec.target)

    def abstract_eval(x, *, comm, size, root, op):
        return _compat.ShapedArray(spec.out_shape(x.shape, size), x.dtype), {mpi_effect}

    def lowering(ctx, x, *, comm, size, root, op):
        token = _compat.token_in(ctx, mpi_effect)
        call = jax.ffi.ffi_lowering(spec.target, has_side_effect=True)
        token, out = call(_compat.with_token_avals(ctx), token, x,
                          comm=np.int64(comm), root=np.int64(root), op=np.int64(op))
        _compat.set_token_out(ctx, mpi_effect, token)
        return [out]

    primitive.def_impl(lambda *args, **params: _compat.apply_primitive(primitive, *args, **params))
    primitive.def_effectful_abstract_eval(abstract_eval)
    _compat.register_lowering(primitive, lowering, platform="cpu")
    return primitive


PRIMITIVES = {spec.name: _make_primitive(spec)
              for spec in (BCAST, SCATTER, REDUCE, ALLREDUCE, GATHER, ALLGATHER, ALLTOALL)}


def _as_array(x, caller):
    if isinstance(x, jax.Array) or hasattr(x, "aval"):
        return x
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as error:
        raise TypeError(f"mpicoll.{caller}: x must be an array or a scalar, "
                        f"got {type(x).__name__}") from error


def _check_root(root, size, caller):
    try:
        root = operator.index(root)
    except TypeError:
        raise TypeError(f"mpicoll.{caller}: root must be an int, got {type(root).__name__}") \
            from None
    if not 0 <= root < size:
        raise ValueError(f"mpicoll.{caller}: root={root} is out of range for a communicator "
                         f"of size {size}")
    return root


def _bind(spec, x, *, comm, root=0, op=None):
    """Validate (same outcome on every rank, no MPI traffic) and bind the primitive."""
    info = comm_layer.resolve(comm, spec.name)
    x = _as_array(x, spec.name)
    _dtypes_and_ops.dtype_family(x.dtype, spec.name)
    root = _check_root(root, info.size, spec.name) if spec.has_root else 0
    op_code = _dtypes_and_ops.op_code(op, x.dtype, spec.name) if spec.reduces else -1
    if spec.leading_axis_is_size and (x.ndim == 0 or x.shape[0] != info.size):
        raise ValueError(f"mpicoll.{spec.name}: x must have shape (comm size, ...) = "
                         f"({info.size}, ...), got {tuple(x.shape)}")
    return PRIMITIVES[spec.name].bind(x, comm=info.slot, size=info.size, root=root, op=op_code)


# ---------------------------------------------------------------------------
# Barrier: no data, only the ordering token.

barrier_p = Primitive("mpicoll_barrier")
barrier_p.multiple_results = True
barrier_p.def_impl(lambda **params: _compat.apply_primitive(barrier_p, **params))
barrier_p.def_effectful_abstract_eval(lambda *, comm: ([], {mpi_effect}))


def _barrier_lowering(ctx, *, comm):
    token = _compat.token_in(ctx, mpi_effect)
    (token,) = jax.ffi.ffi_lowering("mpicoll_barrier", has_side_effect=True)(
        _compat.with_token_avals(ctx), token, comm=np.int64(comm))
    _compat.set_token_out(ctx, mpi_effect, token)
    return []


_compat.register_lowering(barrier_p, _barrier_lowering, platform="cpu")


# ---------------------------------------------------------------------------
# Public API (MPI's names and argument order).

def bcast(x, root=0, *, comm=None):
    """Root's x on every rank (MPI_Bcast). Output shape: x.shape."""
    return _bind(BCAST, x, comm=comm, root=root)


def scatter(x, root=0, *, comm=None):
    """Rank r gets root's x[r]; x has shape (size, *s) on every rank (MPI_Scatter). Output: s."""
    return _bind(SCATTER, x, comm=comm, root=root)


def reduce(x, op="sum", root=0, *, comm=None):
    """Reduction of x over ranks on root, zeros elsewhere (MPI_Reduce). Output: x.shape."""
    return _bind(REDUCE, x, comm=comm, root=root, op=op)


def allreduce(x, op="sum", *, comm=None):
    """Reduction of x over ranks on every rank (MPI_Allreduce). Output: x.shape."""
    return _bind(ALLREDUCE, x, comm=comm, op=op)


def gather(x, root=0, *, comm=None):
    """Stack of every rank's x, by rank, on root; zeros elsewhere (MPI_Gather). Output: (size, *x.shape)."""
    return _bind(GATHER, x, comm=comm, root=root)


def allgather(x, *, comm=None):
    """Stack of every rank's x, by rank, on every rank (MPI_Allgather). Output: (size, *x.shape)."""
    return _bind(ALLGATHER, x, comm=comm)


def alltoall(x, *, comm=None):
    """out[j] on rank r is x[r] of rank j; x has shape (size, *s) (MPI_Alltoall). Output: x.shape."""
    return _bind(ALLTOALL, x, comm=comm)


def barrier(*, comm=None):
    """Block until every rank of comm reaches this point (MPI_Barrier), in program order."""
    info = comm_layer.resolve(comm, "barrier")
    barrier_p.bind(comm=info.slot)

"""Which dtypes mpicoll moves, which reduction ops it knows, and which pairs are valid.

The C++ side maps each dtype to its MPI datatype and each op code to its MPI_Op
(float16/bfloat16 reductions use native user-defined operators, since MPI has
no 16-bit float types); the dtypes and their families, the ops, their codes and
valid dtype families come from the extension's tables (csrc/dtypes.def,
csrc/reduce_ops.def).
"""

from typing import NamedTuple

import jax.numpy as jnp
import ml_dtypes  # installed with jaxlib; gives numpy its bfloat16
import numpy as np
from mpi4py import MPI

from .native import extension

BOOL = "bool"
INTEGER = "integer"
FLOATING = "floating"
COMPLEX = "complex"

# The dtypes mpicoll supports, by family, from the extension's table
# (csrc/dtypes.def): the one list of them.  bfloat16 is ml_dtypes' numpy type.
def _numpy_dtype(name):
    try:
        return np.dtype(name)
    except TypeError:  # not numpy's own: bfloat16
        return np.dtype(getattr(ml_dtypes, name))


DTYPE_FAMILIES = {_numpy_dtype(name): family for name, family in extension.dtypes().items()}
assert set(DTYPE_FAMILIES.values()) <= {BOOL, INTEGER, FLOATING, COMPLEX}, \
    "the extension names an unknown dtype family"


def dtype_names():
    """The supported dtypes as prose for docstrings and errors: "bool, int8, ..."."""
    return ", ".join(str(dtype) for dtype in DTYPE_FAMILIES)

# The reduction ops, their codes and the dtype families each is defined for,
# from the extension's table (csrc/reduce_ops.def): the one list of them.
_REDUCTION_OPS = dict(sorted(extension.reduction_ops().items(), key=lambda item: item[1][0]))
OP_CODES = {name: code for name, (code, _) in _REDUCTION_OPS.items()}
OP_FAMILIES = {name: tuple(families) for name, (_, families) in _REDUCTION_OPS.items()}
OP_NAMES = {code: name for name, code in OP_CODES.items()}
SUM = OP_CODES["sum"]
assert all(set(families) <= {BOOL, INTEGER, FLOATING, COMPLEX}
           for families in OP_FAMILIES.values()), "the extension names an unknown dtype family"

# mpi4py's predefined op for each (MPI.SUM for "sum", ...).
_MPI4PY_OPS = tuple((getattr(MPI, name.upper()), name) for name in OP_FAMILIES)

# The same reductions as elementwise jax.numpy functions, for combining on a
# device (the ranks x devices compositions).
_ELEMENTWISE = {
    "sum": "add", "prod": "multiply", "min": "minimum", "max": "maximum",
    "land": "logical_and", "lor": "logical_or", "lxor": "logical_xor",
    "band": "bitwise_and", "bor": "bitwise_or", "bxor": "bitwise_xor",
}
assert set(_ELEMENTWISE) == set(OP_FAMILIES), "a reduction op without an elementwise form"


def elementwise(name):
    """The jax.numpy function that combines two operands like reduction op `name`."""
    return getattr(jnp, _ELEMENTWISE[name])


# Every op object mpi4py predefines (MAXLOC, REPLACE, OP_NULL, ...), by name:
# an MPI.Op prints as its address, so errors name it from here.
_MPI4PY_OP_NAMES = [(value, f"MPI.{name}") for name, value in vars(MPI).items()
                    if isinstance(value, MPI.Op)]


def _describe_mpi_op(op):
    for mpi_op, name in _MPI4PY_OP_NAMES:
        if op == mpi_op:
            return name
    return "a user-defined MPI.Op"


def dtype_family(dtype, caller):
    """The family of a supported dtype; TypeError naming the caller otherwise."""
    family = DTYPE_FAMILIES.get(np.dtype(dtype))
    if family is None:
        supported = ", ".join(str(d) for d in DTYPE_FAMILIES)
        raise TypeError(f"mpicoll.{caller}: x has unsupported dtype {np.dtype(dtype)}; "
                        f"supported dtypes: {supported}")
    return family


class CheckedOp(NamedTuple):
    """A reduction op already checked for one dtype: a composition that checks the
    user's op first (before combining on the devices with elementwise()) hands
    this on, and op_code returns its code without checking it again."""
    name: str
    code: int
    dtype: np.dtype


def op_name(op, caller):
    """Normalize an op given as a name or an mpi4py MPI.Op to its lowercase name."""
    if isinstance(op, CheckedOp):
        return op.name
    if isinstance(op, MPI.Op):
        for mpi_op, name in _MPI4PY_OPS:
            if op == mpi_op:
                return name
        supported = ", ".join(f"MPI.{name.upper()}" for name in OP_FAMILIES)
        raise ValueError(f"mpicoll.{caller}: op={_describe_mpi_op(op)} is not supported; "
                         f"supported: {supported} (or their names: {', '.join(OP_FAMILIES)})")
    if isinstance(op, str) and op.lower() in OP_FAMILIES:
        return op.lower()
    raise ValueError(f"mpicoll.{caller}: unknown op={op!r}; supported: "
                     f"{', '.join(OP_FAMILIES)} (or the matching mpi4py MPI.Op)")


def checked_op(op, dtype, caller):
    """op (a name, an mpi4py MPI.Op or a CheckedOp) checked for dtype -> CheckedOp;
    ValueError/TypeError if invalid."""
    dtype = np.dtype(dtype)
    if isinstance(op, CheckedOp) and op.dtype == dtype:
        return op
    name = op_name(op, caller)
    family = dtype_family(dtype, caller)
    if family not in OP_FAMILIES[name]:
        valid = [n for n, fams in OP_FAMILIES.items() if family in fams]
        raise TypeError(f"mpicoll.{caller}: op={name!r} is not defined for dtype "
                        f"{dtype} ({family}); valid ops for it: {', '.join(valid)}")
    return CheckedOp(name, OP_CODES[name], dtype)


def op_code(op, dtype, caller):
    """The handler's code for op on dtype; ValueError/TypeError if invalid."""
    return checked_op(op, dtype, caller).code

"""Which dtypes mpicoll moves, which reduction ops it knows, and which pairs are valid.

The C++ side maps each dtype to its MPI datatype and each op code to its MPI_Op
(float16/bfloat16 reductions use native user-defined operators, since MPI has
no 16-bit float types); the op codes themselves come from the extension.
"""

import ml_dtypes  # installed with jaxlib; gives numpy its bfloat16
import numpy as np
from mpi4py import MPI

from ._native import extension

BOOL = "bool"
INTEGER = "integer"
FLOATING = "floating"
COMPLEX = "complex"

# The dtypes mpicoll supports, by family.
DTYPE_FAMILIES = {
    np.dtype(np.bool_): BOOL,
    **{np.dtype(t): INTEGER for t in (np.int8, np.int16, np.int32, np.int64,
                                      np.uint8, np.uint16, np.uint32, np.uint64)},
    **{np.dtype(t): FLOATING for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)},
    **{np.dtype(t): COMPLEX for t in (np.complex64, np.complex128)},
}

# Reduction op name -> the dtype families it is defined for.
OP_FAMILIES = {
    "sum": (INTEGER, FLOATING, COMPLEX),
    "prod": (INTEGER, FLOATING, COMPLEX),
    "min": (BOOL, INTEGER, FLOATING),
    "max": (BOOL, INTEGER, FLOATING),
    "land": (BOOL, INTEGER),
    "lor": (BOOL, INTEGER),
    "lxor": (BOOL, INTEGER),
    "band": (BOOL, INTEGER),
    "bor": (BOOL, INTEGER),
    "bxor": (BOOL, INTEGER),
}

OP_CODES = extension.op_codes()
assert set(OP_CODES) == set(OP_FAMILIES), "extension and Python disagree on the ops"

_MPI4PY_OPS = (
    (MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MIN, "min"), (MPI.MAX, "max"),
    (MPI.LAND, "land"), (MPI.LOR, "lor"), (MPI.LXOR, "lxor"),
    (MPI.BAND, "band"), (MPI.BOR, "bor"), (MPI.BXOR, "bxor"),
)


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


def op_name(op, caller):
    """Normalize an op given as a name or an mpi4py MPI.Op to its lowercase name."""
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


def op_code(op, dtype, caller):
    """The handler's code for op on dtype; ValueError/TypeError if invalid."""
    name = op_name(op, caller)
    family = dtype_family(dtype, caller)
    if family not in OP_FAMILIES[name]:
        valid = [n for n, fams in OP_FAMILIES.items() if family in fams]
        raise TypeError(f"mpicoll.{caller}: op={name!r} is not defined for dtype "
                        f"{np.dtype(dtype)} ({family}); valid ops for it: {', '.join(valid)}")
    return OP_CODES[name]

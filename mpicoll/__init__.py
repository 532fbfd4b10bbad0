"""mpicoll: MPI collectives as JAX primitives.

Each collective runs inside jax.jit as an XLA FFI custom call that hands XLA's
own buffers to MPI, ordered by a JAX effect token so that every rank issues its
collectives in program order.
"""

__version__ = "0.1.0"

from .collectives import (  # noqa: E402
    allgather,
    allreduce,
    alltoall,
    barrier,
    bcast,
    gather,
    pvary,
    reduce,
    scatter,
)
from .comm import default_comm  # noqa: E402
from . import topology  # noqa: E402
from .failures import check_mode, clear_error, set_check_mode, set_timeout  # noqa: E402
from . import failures as _failures  # noqa: E402

_failures.configure_from_environment()

__all__ = ["allgather", "allreduce", "alltoall", "barrier", "bcast", "check_mode", "clear_error",
           "default_comm", "gather", "pvary", "reduce", "scatter", "set_check_mode", "set_timeout"]

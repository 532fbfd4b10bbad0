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
    exscan,
    gather,
    pvary,
    reduce,
    reduce_scatter,
    scan,
    scatter,
)
from .p2p import ANY_SOURCE, ANY_TAG, PROC_NULL, recv, send, sendrecv  # noqa: E402
from .vector import allgatherv, alltoallv, gatherv, scatterv  # noqa: E402
from .comm import default_comm  # noqa: E402
from . import topology  # noqa: E402
from .overlap import overlap  # noqa: E402
from .failures import check_mode, clear_error, set_check_mode, set_timeout  # noqa: E402
from . import failures as _failures  # noqa: E402

_failures.configure_from_environment()

__all__ = ["ANY_SOURCE", "ANY_TAG", "PROC_NULL", "allgather", "allgatherv", "allreduce",
           "alltoall", "alltoallv", "barrier", "bcast", "check_mode", "clear_error", "default_comm",
           "exscan", "gather", "gatherv", "overlap", "pvary", "recv", "reduce", "reduce_scatter", "scan",
           "scatter", "scatterv", "send", "sendrecv", "set_check_mode", "set_timeout"]

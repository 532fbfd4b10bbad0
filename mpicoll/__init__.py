"""mpicoll: MPI collectives as JAX primitives.

Each collective runs inside jax.jit as an XLA FFI custom call that hands XLA's
own buffers to MPI, ordered by a JAX effect token so that every rank issues its
collectives in program order.
"""

__version__ = "0.1.0"

from .collectives import (  # noqa: E402
    RANKS,
    allgather,
    allreduce,
    alltoall,
    autodiff_mode,
    barrier,
    bcast,
    dispatch_mode,
    exscan,
    gather,
    mesh,
    pvary,
    reduce,
    reduce_scatter,
    scan,
    scatter,
    set_autodiff,
    set_dispatch,
)
from .p2p import ANY_SOURCE, ANY_TAG, PROC_NULL, recv, send, sendrecv  # noqa: E402
from .vector import allgatherv, alltoallv, gatherv, scatterv  # noqa: E402
from .comm import default_comm  # noqa: E402
from . import topology  # noqa: E402
from .overlap import overlap  # noqa: E402
from .failures import check_mode, clear_error, set_check_mode, set_timeout  # noqa: E402
from . import collectives as _collectives, failures as _failures  # noqa: E402
from ._native import thread_mode  # noqa: E402

_failures.configure_from_environment()
set_autodiff(_failures.choice_from_environment("MPICOLL_AUTODIFF", ("checked", "convention")))
# Unset: device-order where it is available (collectives.py), else tokens.
_dispatch = _failures.choice_from_environment("MPICOLL_DISPATCH",
                                              ("default", "device-order", "tokens"))
set_dispatch(_dispatch if _dispatch != "default" else
             ("device-order" if _collectives.DEVICE_ORDER_AVAILABLE else "tokens"))
del _dispatch

__all__ = ["ANY_SOURCE", "ANY_TAG", "PROC_NULL", "RANKS", "allgather", "allgatherv", "allreduce",
           "alltoall", "alltoallv", "autodiff_mode", "barrier", "bcast", "check_mode",
           "clear_error", "default_comm", "dispatch_mode", "exscan", "gather", "gatherv", "mesh",
           "overlap", "pvary", "recv", "reduce", "reduce_scatter", "scan", "scatter", "scatterv", "send", "sendrecv",
           "set_autodiff", "set_check_mode", "set_dispatch", "set_timeout", "thread_mode"]

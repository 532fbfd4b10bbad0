"""mpicoll: MPI collectives as JAX primitives.

Each collective runs inside jax.jit as an XLA FFI custom call that hands XLA's
own buffers to MPI, ordered by a JAX effect token so that every rank issues its
collectives in program order.
"""

__version__ = "0.1.0"

import sys as _sys

# `python -m mpicoll stacks|flight|trace` (mpicoll/__main__.py) read files or
# signal a running job: the package is then imported without MPI and JAX, so
# they run on a login node, or in a shell beside the job they inspect (Open MPI
# 4.1 refuses to start a singleton inside a job's process tree).
_OFFLINE = _sys.argv[:1] == ["-m"] and _sys.argv[1:2] in (["stacks"], ["flight"], ["trace"])

if not _OFFLINE:
    from ._src.runtime.settings import current as _current_settings  # reads MPICOLL_*
    from ._src.ops.collectives import (
        allgather, allreduce, alltoall, barrier, bcast, exscan, gather, pvary, reduce, reduce_scatter,
        scan, scatter)
    from ._src.primitive.varying import RANKS, autodiff_mode, mesh, set_autodiff
    from ._src.primitive.device_order import dispatch_mode, set_dispatch
    from ._src.ops.p2p import ANY_SOURCE, ANY_TAG, PROC_NULL, recv, send, sendrecv
    from ._src.ops.vector import allgatherv, alltoallv, gatherv, scatterv
    from ._src.runtime.comm import default_comm
    from . import topology
    from ._src.primitive.overlap import overlap
    from ._src.observe.failures import (
        check_mode, clear_error, set_check_mode, set_stall_report, set_timeout)
    from ._src.runtime.settings import override as override_settings
    from ._src.observe.tracing import start_trace, stop_trace, trace
    from ._src.runtime.native import thread_mode
    from ._src.survive import RankLost, State, fault_tolerant, lost_ranks, shrink
    from ._src.over_ranks import lax  # importing it routes jax.lax collectives over RANKS
    del lax  # reached as over_ranks.lax, not as a public name of mpicoll
    # The subpackages, already mpicoll's attributes by the imports above.
    from ._src import _compat, observe, primitive

    # The settings the modules above do not apply themselves: abort on error, the
    # check mode and the timeout (autodiff and dispatch start from the settings in
    # primitive/varying.py and primitive/device_order.py).
    observe.failures.configure(_current_settings())

    # XLA's CPU pool at two threads per local device where the cores are fewer
    # (unless the user set PJRT_NPROC, or JAX started its backends before this
    # import): with fewer, XLA's own dispatch of multi-device programs can starve
    # the device part a collective waits for (primitive/device_order.py,
    # chain_safe; 2 ranks x 2 devices on 2 cores hung a gradient step in 1 of 2
    # runs, issue 43).
    primitive.device_order.size_xla_cpu_pool(warn_if_late=True)

    # Errors show the caller's frames, not mpicoll's: JAX's traceback filtering (on by
    # default, JAX_TRACEBACK_FILTERING=off shows everything) leaves mpicoll's out too.
    _compat.hide_frames_under(__path__[0])

__all__ = ["ANY_SOURCE", "ANY_TAG", "PROC_NULL", "RANKS", "RankLost", "State", "allgather", "allgatherv", "allreduce",
           "alltoall", "alltoallv", "autodiff_mode", "barrier", "bcast", "check_mode",
           "clear_error", "default_comm", "dispatch_mode", "exscan", "fault_tolerant", "gather", "gatherv", "lost_ranks", "mesh",
           "overlap", "override_settings", "pvary", "recv", "reduce", "reduce_scatter", "scan", "scatter", "scatterv", "send", "sendrecv",
           "set_autodiff", "set_check_mode", "shrink", "set_dispatch", "set_stall_report", "set_timeout", "start_trace",
           "stop_trace", "thread_mode", "trace"]

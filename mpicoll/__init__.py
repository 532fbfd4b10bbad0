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
# (`python -m mpicoll`: argv[0] is "-m" while the package imports; the installed
# `mpicoll` command: its own path.)
_OFFLINE = (_sys.argv[1:2] in (["stacks"], ["flight"], ["trace"])
            and (_sys.argv[:1] == ["-m"] or _sys.argv[0].rsplit("/", 1)[-1] == "mpicoll"))

if not _OFFLINE:
    try:  # the MPICOLL_* settings first: a bad value is one line, not a traceback of mpicoll's
        from ._src.runtime import settings as _settings  # noqa: F401
    except ValueError as _error:
        if type(_error).__name__ != "SettingError":
            raise
        raise ValueError(f"mpicoll: {_error} (docs/settings.md)") from None
    from ._src.ops.collectives import (
        allgather, allreduce, alltoall, barrier, bcast, exscan, gather, pvary, reduce, reduce_scatter,
        scan, scatter)
    from ._src.ops.typed_ranks import autodiff_mode, set_autodiff
    from ._src.ops.scheduling import dispatch_mode, overlap, set_dispatch
    from ._src.ops.p2p import ANY_SOURCE, ANY_TAG, PROC_NULL, recv, send, sendrecv
    from ._src.ops.vector import allgatherv, alltoallv, gatherv, scatterv
    from ._src.runtime.comm import default_comm
    from . import topology  # noqa: F401 (mpicoll.topology, a public module)
    from ._src.observe.failures import (
        check_mode, clear_error, set_check_mode, set_stall_report, set_timeout)
    from ._src.runtime.settings import override as override_settings
    from ._src.observe.tracing import start_trace, stop_trace, trace
    from ._src.runtime.native import thread_mode
    from ._src.survive import RankLost, State, fault_tolerant, lost_ranks, shrink

    # Every change mpicoll makes to JAX, XLA and the process, in one declared
    # order (_src/install.py; `python -m mpicoll info` lists them).
    from ._src.install import install as _install, on_first_use_of_ranks as _first_use_of_ranks
    _install()

    # The first use of the mesh vocabulary is seen here, at the package's door:
    # mpicoll.mesh(), mpicoll.RANKS (__getattr__ below; also `from mpicoll import
    # RANKS`) and mpicoll.distributed.initialize() (its own module).  It routes
    # jax.lax over the ranks (_src/install.py), which code that never names them
    # never pays.
    import functools as _functools
    from ._src.ops import typed_ranks as _typed_ranks

    @_functools.wraps(_typed_ranks.mesh)
    def mesh(local_axis=None, devices=None):
        _first_use_of_ranks()
        return _typed_ranks.mesh(local_axis, devices)

__all__ = ["ANY_SOURCE", "ANY_TAG", "PROC_NULL", "RANKS", "RankLost", "State", "allgather", "allgatherv", "allreduce",
           "alltoall", "alltoallv", "autodiff_mode", "barrier", "bcast", "check_mode",
           "clear_error", "default_comm", "dispatch_mode", "exscan", "fault_tolerant", "gather", "gatherv", "lost_ranks", "mesh",
           "overlap", "override_settings", "pvary", "recv", "reduce", "reduce_scatter", "scan", "scatter", "scatterv", "send", "sendrecv",
           "set_autodiff", "set_check_mode", "shrink", "set_dispatch", "set_stall_report", "set_timeout", "start_trace",
           "stop_trace", "thread_mode", "trace"]


def __getattr__(name):
    if name == "RANKS" and not _OFFLINE:
        _first_use_of_ranks()
        globals()["RANKS"] = _typed_ranks.RANKS  # later reads are a plain attribute
        return _typed_ranks.RANKS
    raise AttributeError(f"module 'mpicoll' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"RANKS"})

"""JAX's own CPU collectives (the ones XLA's partitioner inserts into a plain `jit`) on
mpicoll's MPI.

jaxlib's MPItrampoline loads mpicoll's MPI ABI library at `import jax` under an MPI
launcher (_mpicoll_jax_mpi.py, beside the package, sets MPITRAMPOLINE_LIB at
start-up); mpicoll.distributed.initialize() calls choose() before JAX's backends
start, which, where every rank can, connects the library to mpicoll's extension
(csrc/mpiabi/jax_calls.cc: a duplicate of COMM_WORLD for XLA's collectives) and
sets jax_cpu_collectives_implementation to "mpi".  Else JAX's gloo carries them,
and choose() says why (`python -m mpicoll info` shows it):

* MPICOLL_JAX_COLLECTIVES=gloo (the opt-out);
* MPI at MPI_THREAD_SERIALIZED (an MPI built without MPI_THREAD_MULTIPLE): XLA
  calls it from its own threads, where the program's mpi4py calls may overlap;
* processes with different CPU device counts (XLA's groups of devices over the
  processes, mpiabi/xla_groups.h, are made for one count L);
* the trampoline did not load mpicoll's library (no MPI launcher's variables at
  start-up, a MPITRAMPOLINE_LIB of the user's, `python -S`, or an install without
  the .pth file), or the installed jaxlib is not one the library's names were
  checked against (_mpicoll_jax_mpi.VERIFIED_JAXLIB).

The ranks agree on the choice first (one allreduce), so that all or none connect.
"""

import os

from mpi4py import MPI

from ..runtime import native, settings

_chosen = None  # ("mpi" or "gloo", why), once choose() has run


def _problem_here():
    """Why this rank cannot run JAX's collectives on mpicoll's MPI, or None."""
    if settings.current().jax_collectives == "gloo":
        return "MPICOLL_JAX_COLLECTIVES=gloo"
    if native.SERIALIZED:
        return ("MPI runs at MPI_THREAD_SERIALIZED: XLA's collectives would call it from "
                "XLA's threads while the program's own Python may call it too")
    try:
        import _mpicoll_jax_mpi
    except ImportError:
        return "_mpicoll_jax_mpi.py (beside the package) is not installed"
    path = _mpicoll_jax_mpi.library_path()
    version = _mpicoll_jax_mpi.jaxlib_version()
    if version not in _mpicoll_jax_mpi.VERIFIED_JAXLIB:
        return (f"jaxlib {version} is not one mpicoll's MPI ABI library was checked against "
                f"({', '.join(_mpicoll_jax_mpi.VERIFIED_JAXLIB)}; tools/mpiabi_names.py)")
    if os.environ.get("MPITRAMPOLINE_LIB") != path:
        given = os.environ.get("MPITRAMPOLINE_LIB")
        return ("jaxlib's MPItrampoline was pointed at another library "
                f"(MPITRAMPOLINE_LIB={given})" if given else
                "jaxlib's MPItrampoline has no library (MPITRAMPOLINE_LIB was not set when "
                "the process started: not under an MPI launcher, or no mpicoll_jax_mpi.pth)")
    problem = native.extension.jax_mpi_library_problem(path)
    return problem or None


def choose():
    """On every rank, before JAX's backends start: JAX's CPU collectives on mpicoll's MPI
    where every rank can, else on gloo; returns (transport, why)."""
    global _chosen
    import jax

    from ..primitive import device_order

    local = device_order.cpu_devices_asked()
    problems, counts = zip(*MPI.COMM_WORLD.allgather((_problem_here(), local)))
    if len(set(counts)) > 1 and not any(problems):
        listed = ", ".join(map(str, counts))
        problems = [f"the processes have different CPU device counts ({listed}): XLA's "
                    "groups of devices are made for one count"] * len(counts)
    first = next(((rank, p) for rank, p in enumerate(problems) if p), None)
    if first is None:
        import _mpicoll_jax_mpi  # (importable: _problem_here said so on every rank)

        connected = native.extension.connect_jax_mpi(_mpicoll_jax_mpi.library_path(), local)
        if connected:  # the same on every rank (one build): no rank has connected
            raise RuntimeError(f"mpicoll.distributed.initialize: {connected}")
        jax.config.update("jax_cpu_collectives_implementation", "mpi")
        _chosen = ("mpi", "mpicoll's MPI (a duplicate of COMM_WORLD)")
    else:
        rank, why = first
        where = "" if all(p == why for p in problems) else f" (rank {rank})"
        _chosen = ("gloo", f"{why}{where}")
    return _chosen


def transport():
    """(transport, why) of JAX's own CPU collectives in this process: "mpi" or "gloo", or
    (None, why) before mpicoll.distributed.initialize()."""
    if _chosen is None:
        return None, "JAX's own (gloo) where JAX's multi-process runtime runs; mpicoll's " \
            "MPI after mpicoll.distributed.initialize()"
    return _chosen

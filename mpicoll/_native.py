"""Load the FFI extension, check it matches mpi4py's MPI, register the targets."""

import atexit

import jax
from mpi4py import MPI  # initializes MPI (THREAD_MULTIPLE unless the user chose otherwise)

try:
    from . import _mpicoll_ffi as extension
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(
        "mpicoll's compiled extension is missing or cannot load "
        f"({error}). Build it with `make install`, or "
        "`MPICC=/path/to/mpicc pip install --no-build-isolation -e .`") from error


def _check_same_mpi():
    """mpicoll must use the MPI library that mpi4py loaded: handles are not portable."""
    built = extension.build_info()
    vendor, version = MPI.get_vendor()
    if built["mpi_vendor"] != vendor or tuple(built["mpi_version"][:1]) != tuple(version[:1]):
        runtime = MPI.Get_library_version().splitlines()[0].strip()
        built_as = f"{built['mpi_vendor']} {'.'.join(map(str, built['mpi_version']))}"
        raise ImportError(
            f"mpicoll was built against {built_as}, but mpi4py is using "
            f"{vendor} {'.'.join(map(str, version))} ({runtime}). Rebuild mpicoll with the "
            "MPI compiler wrapper of the MPI that mpi4py loads: `make install MPI=...`, or "
            "`MPICC=/path/to/that/mpicc pip install --no-build-isolation --force-reinstall "
            "-e .`")


_check_same_mpi()
THREAD_LEVEL = extension.initialize()
if THREAD_LEVEL < MPI.THREAD_MULTIPLE:
    raise ImportError(
        "mpicoll needs MPI_THREAD_MULTIPLE: XLA runs collectives on its own threads while "
        f"Python may call MPI too, but MPI provides thread level {THREAD_LEVEL}. "
        "Do not lower mpi4py.rc.thread_level, and use an MPI built with thread support.")

for _name, _capsule in extension.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


@atexit.register
def _flush_pending_collectives():
    # Registered after mpi4py initialized MPI, so it runs before MPI_Finalize:
    # collectives still queued in XLA complete instead of meeting a finalized MPI.
    jax.effects_barrier()

"""Load the FFI extension, check it matches mpi4py's MPI, register the targets."""

import atexit
import os

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

# The platforms this build has handlers for: ("cpu",) or ("cpu", "cuda").
PLATFORMS = tuple(extension.build_info()["platforms"])

# jax.ffi's names for them (its examples register GPU handlers as "CUDA").
_FFI_PLATFORM_NAMES = {"cpu": "cpu", "cuda": "CUDA"}
for _platform in PLATFORMS:
    for _name, _capsule in extension.registrations(_platform).items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_FFI_PLATFORM_NAMES[_platform])


# --- GPU transport -------------------------------------------------------------
# Chosen once, here: device pointers straight to MPI when the MPI library says it
# is CUDA-aware (or MPICOLL_GPU_TRANSPORT=cuda-aware forces it), else pinned host
# staging.  MPICOLL_GPU_CHUNK_BYTES sets the staging pipeline's chunk (0 = none).
GPU_TRANSPORTS = ("auto", "staged", "cuda-aware")
DEFAULT_GPU_CHUNK_BYTES = 4 << 20


def cuda_aware_mpi():
    """True/False as MPIX_Query_cuda_support() says, None where the MPI cannot tell."""
    query = getattr(extension, "cuda_aware_mpi", None)
    return query() if query else None


def _choose_gpu_transport():
    """(transport, reason, chunk bytes) from the environment and the MPI library."""
    asked = os.environ.get("MPICOLL_GPU_TRANSPORT", "auto").strip().lower() or "auto"
    if asked not in GPU_TRANSPORTS:
        raise ImportError(f"mpicoll: MPICOLL_GPU_TRANSPORT={asked!r}; use one of "
                          f"{', '.join(GPU_TRANSPORTS)}")
    raw_chunk = os.environ.get("MPICOLL_GPU_CHUNK_BYTES", str(DEFAULT_GPU_CHUNK_BYTES))
    try:
        chunk = int(raw_chunk)
        if chunk < 0:
            raise ValueError
    except ValueError:
        raise ImportError(f"mpicoll: MPICOLL_GPU_CHUNK_BYTES={raw_chunk!r} must be a "
                          "non-negative integer (bytes; 0 = no pipelining)") from None
    if asked != "auto":
        return asked, f"MPICOLL_GPU_TRANSPORT={asked}", chunk
    aware = cuda_aware_mpi()
    if aware:
        return "cuda-aware", "the MPI library is CUDA-aware (MPIX_Query_cuda_support)", chunk
    why = ("the MPI library is not CUDA-aware" if aware is False
           else "the MPI library cannot say whether it is CUDA-aware")
    return "staged", f"{why}: pinned host staging", chunk


GPU_TRANSPORT, GPU_TRANSPORT_REASON, GPU_CHUNK_BYTES = _choose_gpu_transport()
if "cuda" in PLATFORMS:
    extension.set_gpu_transport(GPU_TRANSPORT == "cuda-aware", GPU_CHUNK_BYTES)


@atexit.register
def _flush_pending_collectives():
    # Registered after mpi4py initialized MPI, so it runs before MPI_Finalize:
    # collectives still queued in XLA complete instead of meeting a finalized MPI.
    jax.effects_barrier()

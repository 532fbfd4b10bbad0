"""Load the FFI extension, check it matches mpi4py's MPI, register the targets."""

import atexit
import importlib
import re

import jax
# Initializes MPI at mpi4py's thread level: MPI_THREAD_MULTIPLE unless the user
# chose another (MPI4PY_RC_THREAD_LEVEL, or mpi4py.rc.thread_level before this).
from mpi4py import MPI

from . import settings

# What a user runs to (re)build the extension against the MPI they run with.
_REBUILD = ("`make install` (with `MPICC=/path/to/mpicc` for a given MPI), or "
            "`MPICC=/path/to/mpicc pip install --no-cache-dir --force-reinstall .` "
            "(`-e .` for a checkout)")

# The shared-library names of the common MPIs' libmpi, for messages.
_LIBMPI_FAMILIES = {
    "libmpi.so.40": "Open MPI 3.x-5.x",
    "libmpi.so.12": "MPICH 3.1+ (or Intel MPI, MVAPICH, Cray MPICH)",
    "libmpich.so.12": "MPICH as Debian and Ubuntu package it",
    "libmpi.so.20": "Open MPI 2.x",
}


def load_error_message(error_text):
    """Why the extension failed to load, and the fix, from the ImportError's text."""
    undefined = re.search(r"undefined symbol: (\S+)", error_text)
    if undefined and re.match(r"_ZN3MPI|P?MPIX?_|ompi_|MPIR_|MPID_|opal_", undefined[1]):
        symbol = undefined[1]
        cause = ("its build pulled in MPI's C++ bindings (mpicxx.h), which the C wrapper "
                 "does not link" if symbol.startswith("_ZN3MPI") else
                 "the MPI library loaded now is not the one it was compiled against")
        return (f"mpicoll's compiled extension was built against a different MPI or with MPI "
                f"C++ bindings: undefined symbol {symbol} ({cause}). Rebuild it against the "
                f"MPI you run with: {_REBUILD}. setup.py compiles with -DOMPI_SKIP_MPICXX "
                f"-DMPICH_SKIP_MPICXX so that the C++ bindings stay out. ({error_text})")
    missing = re.search(r"(\S*mpi\S*\.so[.\d]*): cannot open shared object file", error_text)
    if missing:
        library = missing[1]
        family = _LIBMPI_FAMILIES.get(library.rsplit("/", 1)[-1])
        return (f"mpicoll's compiled extension needs {library}"
                + (f" ({family})" if family else "")
                + ", the MPI library it was built against, and the dynamic loader cannot find "
                "it. Make that MPI available where you run (`module load` it, or add its lib "
                "directory to LD_LIBRARY_PATH), or rebuild mpicoll against the MPI you have: "
                f"{_REBUILD}. ({error_text})")
    return ("mpicoll's compiled extension is missing or cannot load "
            f"({error_text}). Build it with {_REBUILD}.")


def _import_extension():
    """The extension built against the MPI that mpi4py loaded: its name carries the MPI
    family (setup.py's mpi_family), so venvs of one checkout built against different
    MPIs (make install MPI=openmpi beside the default) each import their own."""
    package = __package__.split(".")[0]  # the extension sits in mpicoll/
    family = "openmpi" if MPI.Get_library_version().startswith("Open MPI") else "mpich"
    # Another family's build, or an older unnamed one, if that is all there is:
    # _check_same_mpi then says which MPI it was built against.
    names = [f"_mpicoll_ffi_{family}", *(f"_mpicoll_ffi_{other}" for other in
                                         ("mpich", "openmpi") if other != family), "_mpicoll_ffi"]
    for name in names:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as missing:
            if missing.name != f"{package}.{name}":
                raise
    raise ModuleNotFoundError(f"No module named '{package}._mpicoll_ffi_{family}'",
                              name=f"{package}._mpicoll_ffi_{family}")


try:
    extension = _import_extension()
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(load_error_message(str(error))) from error


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
            f"MPI compiler wrapper of the MPI that mpi4py loads: {_REBUILD}")


_check_same_mpi()
THREAD_LEVEL = extension.initialize()
_THREAD_LEVEL_NAMES = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
                       MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                       MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
                       MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
if THREAD_LEVEL < MPI.THREAD_SERIALIZED:
    raise ImportError(
        "mpicoll needs MPI_THREAD_MULTIPLE, or MPI_THREAD_SERIALIZED with one local device "
        "per process: XLA runs collectives on its own threads, but MPI provides "
        f"{_THREAD_LEVEL_NAMES.get(THREAD_LEVEL, THREAD_LEVEL)}. Set MPI4PY_RC_THREAD_LEVEL "
        "(or mpi4py.rc.thread_level) to 'multiple' (mpi4py's default) or 'serialized', and "
        "use an MPI built with thread support.")
# The serialized mode (MPI_THREAD_SERIALIZED, one local device per process):
# MPI skips the locking MULTIPLE costs every call, so mpicoll makes sure no two
# MPI calls overlap.  Its own calls take one lock in the extension, and each
# dispatch of a program with collectives completes before it returns
# (primitive/device_order.py), so no mpicoll MPI call is in flight while Python runs and
# the user's own mpi4py calls cannot overlap one.  Several local devices would
# call MPI from several threads at once: comm.py refuses them at first use.
SERIALIZED = THREAD_LEVEL < MPI.THREAD_MULTIPLE
extension.set_serialized_mpi(SERIALIZED)


def thread_mode():
    """How mpicoll calls MPI in this process: "multiple" or "serialized".

    It follows the thread level mpi4py initialized MPI with (docs/design.md,
    "Thread level").  "multiple" (MPI_THREAD_MULTIPLE, mpi4py's default): any
    number of local devices, whose threads call MPI at once under pmap and
    shard_map.  "serialized" (MPI_THREAD_SERIALIZED, by
    MPI4PY_RC_THREAD_LEVEL=serialized in the job's environment or
    mpi4py.rc.thread_level = "serialized" before MPI is initialized): one
    local device per process, no two MPI calls overlap, and each dispatch of
    a program with collectives returns once the program has finished, so the
    caller's own mpi4py calls are safe between mpicoll's; small messages run
    faster with an MPI whose MULTIPLE level costs every call (MPICH).  A
    lower level makes `import mpicoll` raise ImportError.

    Returns:
        "multiple" or "serialized", fixed for the process.

    Example::

        import mpi4py
        mpi4py.rc.thread_level = "serialized"    # before the first `from mpi4py import MPI`
        import mpicoll
        mpicoll.thread_mode()                    # "serialized"
    """
    return "serialized" if SERIALIZED else "multiple"

# The platforms this build has handlers for: ("cpu",) or ("cpu", "cuda").
PLATFORMS = tuple(extension.build_info()["platforms"])

# jax.ffi's names for them (its examples register GPU handlers as "CUDA").
_FFI_PLATFORM_NAMES = {"cpu": "cpu", "cuda": "CUDA"}


def register_ffi_targets():
    """Register the extension's handlers with XLA's FFI registry (an install step, install.py)."""
    count = 0
    for platform in PLATFORMS:
        for name, capsule in extension.registrations(platform).items():
            jax.ffi.register_ffi_target(name, capsule, platform=_FFI_PLATFORM_NAMES[platform])
            count += 1
    return f"{count} handlers for {', '.join(PLATFORMS)}"


# --- GPU transport -------------------------------------------------------------
# Chosen once, here: device pointers straight to MPI when the MPI library says it
# is CUDA-aware (or MPICOLL_GPU_TRANSPORT=cuda-aware forces it), else pinned host
# staging.  MPICOLL_GPU_CHUNK_BYTES sets the staging pipeline's chunk (0 = none).
GPU_TRANSPORTS = settings.GPU_TRANSPORTS
DEFAULT_GPU_CHUNK_BYTES = settings.DEFAULT_GPU_CHUNK_BYTES


def cuda_aware_mpi():
    """True/False as MPIX_Query_cuda_support() says, None where the MPI cannot tell."""
    return extension.cuda_aware_mpi()


def _choose_gpu_transport(current):
    """(transport, reason, chunk bytes) from the settings in force and the MPI library."""
    asked, chunk = current.gpu_transport, current.gpu_chunk_bytes
    if asked != "auto":
        return asked, f"MPICOLL_GPU_TRANSPORT={asked}", chunk
    aware = cuda_aware_mpi()
    if aware:
        return "cuda-aware", "the MPI library is CUDA-aware (MPIX_Query_cuda_support)", chunk
    why = ("the MPI library is not CUDA-aware" if aware is False
           else "the MPI library cannot say whether it is CUDA-aware")
    return "staged", f"{why}: pinned host staging", chunk


GPU_TRANSPORT, GPU_TRANSPORT_REASON, GPU_CHUNK_BYTES = _choose_gpu_transport(settings.current())
if "cuda" in PLATFORMS:
    extension.set_gpu_transport(GPU_TRANSPORT == "cuda-aware", GPU_CHUNK_BYTES)


# The local meeting's allgather pipeline (csrc/meeting/meeting.cc): 0 = automatic.
extension.set_gather_pieces(settings.current().gather_pieces)


def flush_pending_collectives_at_exit():
    """An install step (install.py): at exit, collectives still queued in XLA
    complete before MPI_Finalize instead of meeting a finalized MPI (registered
    after mpi4py initialized MPI, so it runs before mpi4py's finalization)."""
    atexit.register(jax.effects_barrier)
    return "jax.effects_barrier() before MPI_Finalize"

"""Build the XLA FFI extension with the MPI compiler wrapper.

The wrapper is ``$MPICC`` if set, else ``mpicc`` on PATH; it supplies the MPI
headers and libraries of the implementation mpi4py will load at run time (a
cluster's module-loaded MPI, a distribution's, or a PyPI wheel's).  The source
is C++, compiled with ``-x c++`` and linked against libstdc++, so no separate
C++ wrapper is needed.  Nothing here looks for CUDA.

The FFI headers come from jaxlib: the installed one with ``--no-build-isolation``
(what the Makefile does), else the one pip puts in the isolated build
environment ([build-system] requires in pyproject.toml).  They are XLA's FFI C
API, versioned and kept ABI-compatible, so an extension built against one jaxlib
loads in another.
"""

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Compiled as C++, mpi.h would pull in MPI's deprecated C++ bindings (Open MPI 4's
# mpicxx.h, MPICH's mpicxx.h): the extension would then need libmpi_cxx, which the
# C wrapper does not link, and fail at import with an undefined _ZN3MPI... symbol.
# (Open MPI 5 dropped the bindings; MPICH and Intel MPI still have them.)
MPI_C_ONLY = ["-DOMPI_SKIP_MPICXX", "-DMPICH_SKIP_MPICXX"]


def find_mpicc():
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        sys.exit("mpicoll: no MPI compiler wrapper found; set MPICC or put mpicc on PATH "
                 "(on a cluster: `module load` an MPI first; `make install` installs the "
                 "PyPI mpich wheel when none is found)")
    return mpicc


def ffi_include_dir():
    """jaxlib's bundled headers (what jax.ffi.include_dir() returns), without importing jax."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("mpicoll: building needs jaxlib (for the XLA FFI headers). `pip install .` "
                 "gets it in its isolated build environment; with --no-build-isolation, "
                 "install jax and jaxlib first")
    include = os.path.join(list(spec.submodule_search_locations)[0], "include")
    if not os.path.isfile(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
        sys.exit(f"mpicoll: jaxlib has no FFI headers under {include} (jaxlib too old?)")
    return include


def compile_command(mpicc, sources, target):
    """The compiler command line that builds the extension `target` from `sources`."""
    return [
        *shlex.split(mpicc), "-x", "c++", "-std=c++17", "-O3", "-fPIC",
        "-fvisibility=hidden", "-shared", "-Wall", *MPI_C_ONLY,
        "-isystem", ffi_include_dir(), "-I", sysconfig.get_paths()["include"],
        *sources, "-o", target, "-lstdc++",
    ]


class MPIBuildExt(build_ext):
    def build_extension(self, ext):
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        command = compile_command(find_mpicc(), ext.sources, target)
        print(" ".join(command), flush=True)
        subprocess.check_call(command)


setup(
    ext_modules=[Extension("mpicoll._mpicoll_ffi", ["mpicoll/csrc/collectives.cc"])],
    cmdclass={"build_ext": MPIBuildExt},
)

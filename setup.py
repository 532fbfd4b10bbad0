"""Build the XLA FFI extension with the MPI compiler wrapper.

The wrapper is ``$MPICC`` if set, else ``mpicc`` on PATH; it supplies the MPI
headers and libraries of the implementation mpi4py will load at run time.  The
source is C++, compiled with ``-x c++`` and linked against libstdc++, so no
separate C++ wrapper is needed.

GPU support (the CUDA handlers in csrc/cuda_memory.h) is compiled in when
MPICOLL_CUDA=1, or, with MPICOLL_CUDA unset, when both cuda.h and a CUDA
plugin of jaxlib are found; MPICOLL_CUDA=0 leaves it out.  It needs only the
header: the CUDA driver is loaded at run time, so no CUDA library is linked.
"""

import os
import shlex
import shutil
import subprocess
import glob
import importlib.util
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def find_mpicc():
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        sys.exit("mpicoll: no MPI compiler wrapper found; set MPICC or put mpicc on PATH "
                 "(`make install` installs the PyPI mpich wheel when none is found)")
    return mpicc


def find_cuda_include():
    """A directory holding cuda.h: $CUDA_HOME/$CUDA_PATH, beside nvcc, /usr/local/cuda, pip's nvidia."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    candidates = [os.path.join(root, "include") for root in roots if root]
    for site in sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    return next((d for d in candidates if os.path.isfile(os.path.join(d, "cuda.h"))), None)


def cuda_flags():
    """Compiler flags for GPU support, or [] for a CPU-only build (see the module docstring)."""
    wanted = os.environ.get("MPICOLL_CUDA", "").strip()
    if wanted == "0":
        return []
    plugin = any(importlib.util.find_spec(name) for name in
                 ("jax_cuda13_plugin", "jax_cuda12_plugin"))
    include = find_cuda_include()
    if wanted != "1" and not (plugin and include):
        return []
    if include is None:
        sys.exit("mpicoll: MPICOLL_CUDA=1 but no cuda.h found; set CUDA_HOME to the CUDA "
                 "toolkit (the directory holding include/cuda.h)")
    print(f"mpicoll: building with CUDA support (cuda.h from {include})", flush=True)
    return ["-DMPICOLL_CUDA", "-isystem", include]


class MPIBuildExt(build_ext):
    def build_extension(self, ext):
        import jax.ffi  # the FFI headers must match the jaxlib that loads the extension

        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        command = [
            *shlex.split(find_mpicc()), "-x", "c++", "-std=c++17", "-O3", "-fPIC",
            "-fvisibility=hidden", "-shared", "-Wall",
            # Open MPI 4 / MPICH 4 headers otherwise pull in the MPI C++ bindings.
            "-DOMPI_SKIP_MPICXX", "-DMPICH_SKIP_MPICXX",
            "-isystem", jax.ffi.include_dir(), "-I", sysconfig.get_paths()["include"],
            *cuda_flags(), *ext.sources, "-o", target, "-lstdc++", "-ldl",
        ]
        print(" ".join(command), flush=True)
        subprocess.check_call(command)


setup(
    ext_modules=[Extension("mpicoll._mpicoll_ffi", ["mpicoll/csrc/collectives.cc"],
                           depends=["mpicoll/csrc/cuda_memory.h"])],
    cmdclass={"build_ext": MPIBuildExt},
)

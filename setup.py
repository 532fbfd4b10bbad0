"""Build the XLA FFI extension with the MPI compiler wrapper.

The wrapper is ``$MPICC`` if set, else ``mpicc`` on PATH; it supplies the MPI
headers and libraries of the implementation mpi4py will load at run time.  The
source is C++, compiled with ``-x c++`` and linked against libstdc++, so no
separate C++ wrapper is needed.  Nothing here looks for CUDA.
"""

import os
import shlex
import shutil
import subprocess
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


class MPIBuildExt(build_ext):
    def build_extension(self, ext):
        import jax.ffi  # the FFI headers must match the jaxlib that loads the extension

        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        command = [
            *shlex.split(find_mpicc()), "-x", "c++", "-std=c++17", "-O3", "-fPIC",
            "-fvisibility=hidden", "-shared", "-Wall",
            "-isystem", jax.ffi.include_dir(), "-I", sysconfig.get_paths()["include"],
            *ext.sources, "-o", target, "-lstdc++",
        ]
        print(" ".join(command), flush=True)
        subprocess.check_call(command)


setup(
    ext_modules=[Extension("mpicoll._mpicoll_ffi", ["mpicoll/csrc/collectives.cc"])],
    cmdclass={"build_ext": MPIBuildExt},
)

"""Build the XLA FFI extension with the MPI compiler wrapper.

The wrapper is ``$MPICC`` if set, else ``mpicc`` on PATH; it supplies the MPI
headers and libraries of the implementation mpi4py will load at run time (a
cluster's module-loaded MPI, a distribution's, or a PyPI wheel's).  The source
is C++, compiled with ``-x c++`` and linked against libstdc++, so no separate
C++ wrapper is needed.

GPU support (the CUDA handlers in csrc/entries/cuda.cc) is compiled in when
MPICOLL_CUDA=1, or, with MPICOLL_CUDA unset, when both cuda.h and a CUDA
plugin of jaxlib are found (in the build environment: with build isolation,
set MPICOLL_CUDA=1); MPICOLL_CUDA=0 leaves it out.  It needs only the header:
the CUDA driver is loaded at run time, so no CUDA library is linked.

The FFI headers come from jaxlib: the installed one with ``--no-build-isolation``
(what the Makefile does), else the one pip puts in the isolated build
environment ([build-system] requires in pyproject.toml).  They are XLA's FFI C
API, versioned and kept ABI-compatible, so an extension built against one jaxlib
loads in another.
"""

import glob
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

import setuptools.dist
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


def mpi_family(mpicc):
    """"openmpi" or "mpich" (MPICH and its derivatives, and any other): the extension's
    name carries it, so that venvs of one checkout built against different MPIs each
    import their own build (an editable install builds in place)."""
    try:
        shown = subprocess.run([*shlex.split(mpicc), "--showme:version"], capture_output=True,
                               text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "mpich"
    return "openmpi" if shown.returncode == 0 and "Open MPI" in shown.stdout + shown.stderr \
        else "mpich"


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


def compile_command(mpicc, sources, target, link=True):
    """The compiler command line that builds the extension `target` from `sources`
    (link=False: the object file `target` from one source)."""
    output = (["-shared", *sources, "-o", target, "-lstdc++", "-ldl"] if link
              else ["-c", *sources, "-o", target])
    return [
        *shlex.split(mpicc), "-x", "c++", "-std=c++17", "-O3", "-fPIC",
        "-fvisibility=hidden", "-Wall", *MPI_C_ONLY,
        f"-DMPICOLL_MODULE=_mpicoll_ffi_{mpi_family(mpicc)}",
        "-isystem", ffi_include_dir(), "-I", sysconfig.get_paths()["include"],
        *cuda_flags(), *output,
    ]


class MPIBuildExt(build_ext):
    """Each translation unit compiled to an object, as many at once as there are cores
    (the units are independent; one compiler call for all took 52 s here against
    36 s for the old single unit), then one link."""

    def build_extension(self, ext):
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        mpicc = find_mpicc()
        if ext.name == MPIABI_LIBRARY:
            # The MPI ABI library jaxlib's MPItrampoline loads (csrc/mpiabi/abi.h): no MPI
            # of its own and no Python, so plain C++ (the wrapper's compiler; --as-needed
            # keeps out the libmpi the wrapper adds, so one build serves every MPI).
            command = [*shlex.split(mpicc), "-x", "c++", "-std=c++17", "-O2", "-fPIC",
                       "-fvisibility=hidden", "-Wall", "-shared", "-Wl,--as-needed",
                       *ext.sources, "-o", target]
            print(" ".join(command), flush=True)
            subprocess.check_call(command)
            return
        objects_dir = os.path.join(self.build_temp, "mpicoll-objects")
        os.makedirs(objects_dir, exist_ok=True)
        objects = [os.path.join(objects_dir, source.replace("/", "_") + ".o")
                   for source in ext.sources]
        commands = [compile_command(mpicc, [source], obj, link=False)
                    for source, obj in zip(ext.sources, objects)]
        parallel = max(1, min(len(commands), os.cpu_count() or 1))
        pending = list(commands)
        running = []
        while pending or running:
            while pending and len(running) < parallel:
                command = pending.pop(0)
                print(" ".join(command), flush=True)
                running.append((command, subprocess.Popen(command)))
            command, process = running.pop(0)
            if process.wait() != 0:
                for _, other in running:
                    other.wait()
                raise subprocess.CalledProcessError(process.returncode, command)
        link = [*shlex.split(mpicc), "-shared", *objects, "-o", target, "-lstdc++", "-ldl"]
        print(" ".join(link), flush=True)
        subprocess.check_call(link)


# The extension's translation units (one module; see csrc/module.cc on why
# several) and the headers and tables they include.
CSRC = "mpicoll/csrc"
SOURCES = [f"{CSRC}/{name}" for name in (
    "module.cc", "module_watch.cc", "module_tables.cc", "module_survive.cc",
    "module_testing.cc", "entries/cpu.cc", "entries/cuda.cc",
    "entries/host_staged.cc", "meeting/meeting.cc", "mpiabi/jax_calls.cc")]
# The MPI ABI library for jaxlib's MPItrampoline (JAX's own CPU collectives on
# mpicoll's MPI): built as an extension for its place in the package, though
# Python never imports it; the same for any MPI (_mpicoll_jax_mpi.py names it).
MPIABI_LIBRARY = "mpicoll._mpicoll_mpiabi"
MPIABI_SOURCES = [f"{CSRC}/mpiabi/library.cc", f"{CSRC}/mpiabi/unsupported.cc"]
DEPENDS = sorted(glob.glob(f"{CSRC}/**/*.h", recursive=True) + glob.glob(f"{CSRC}/**/*.def", recursive=True))

# The MPICOLL_AS_MPI4JAX switch (_mpicoll_as_mpi4jax.py): a .pth file in site-packages,
# which Python reads at every start-up.  Installed as a data file, relative to the
# installation prefix, so that editable installs (`make install`) get it too: they
# leave out whatever a build puts in build_lib, but pip installs a wheel's data files.
# The path is site-packages' in a venv, a --user or a conda prefix.
SITE_PACKAGES = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


class Distribution(setuptools.dist.Distribution):
    """setuptools' editable wheel (editable_wheel._run_install) asks the distribution
    for has_data, a name only the install command has, and so leaves data files out
    of editable installs (setuptools 84): answer it."""

    def has_data(self):
        return self.has_data_files()

if __name__ == "__main__":  # also when pip's build backend runs it; not when a test imports it
    setup(
        ext_modules=[Extension(f"mpicoll._mpicoll_ffi_{mpi_family(find_mpicc())}", SOURCES,
                               depends=DEPENDS),
                     Extension(MPIABI_LIBRARY, MPIABI_SOURCES, depends=DEPENDS)],
        cmdclass={"build_ext": MPIBuildExt},
        data_files=[(SITE_PACKAGES, ["mpicoll_as_mpi4jax.pth", "mpicoll_jax_mpi.pth"])],
        distclass=Distribution,
    )

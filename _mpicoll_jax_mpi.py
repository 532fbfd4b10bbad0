"""JAX's own CPU collectives on mpicoll's MPI: point jaxlib's MPItrampoline at mpicoll's library.

jaxlib embeds MPItrampoline, which reads MPITRAMPOLINE_LIB once, when jaxlib is
loaded (at `import jax`), and loads the MPI ABI library it names; with
jax_cpu_collectives_implementation "mpi" XLA's CPU collectives then call it.
mpicoll's library (mpicoll/csrc/mpiabi/) forwards them to the job's MPI once
mpicoll.distributed.initialize() connects it.  The variable must be set before
jaxlib loads, whatever the program imports first, so the install puts
`mpicoll_jax_mpi.pth` into site-packages: Python runs its line at start-up,
which calls prepare() only in a process an MPI launcher started (one of
LAUNCHER_RANK_VARIABLES set), where MPITRAMPOLINE_LIB is not set already (a
library of the user's wins) and MPICOLL_JAX_COLLECTIVES is not "gloo".
prepare() sets the variable and nothing else: the trampoline then loads the
library (no MPI in it, a millisecond) and it stays idle unless a program
connects it.  Only for a jaxlib of VERIFIED_JAXLIB: the trampoline ends the
process at `import jax` if the library lacks a name it resolves, so a jaxlib
whose names were not checked against mpicoll's table keeps gloo (and
tests/test_jax_collectives.py fails, saying to run tools/mpiabi_names.py).

This module sits outside the mpicoll package and imports nothing beyond the
standard library: it runs in every Python process an MPI launcher starts.
"""

import importlib.machinery
import os

VARIABLE = "MPITRAMPOLINE_LIB"
OPT_OUT = "MPICOLL_JAX_COLLECTIVES"  # "gloo": JAX's own transport (docs/settings.md)
# The launchers' variables that give a process its rank (MPICH/Hydra, Open MPI, PMIx, SLURM).
LAUNCHER_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
PTH = "mpicoll_jax_mpi.pth"
# The jaxlibs whose trampoline's names are all in csrc/mpiabi/names.def (checked
# with tools/mpiabi_names.py; both embed MPItrampoline 5.3.1, 634 names).
VERIFIED_JAXLIB = ("0.10.2", "0.12.0.1")


def library_path():
    """mpicoll's MPI ABI library for this interpreter's build (it may not exist)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpicoll",
                        "_mpicoll_mpiabi" + importlib.machinery.EXTENSION_SUFFIXES[0])


def jaxlib_version():
    """The installed jaxlib's version, read from its version.py without importing it
    (None where there is none)."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            found = re.search(r'^_version\s*=\s*"([^"]+)"', f.read(), re.M)
    except OSError:
        return None
    return found[1] if found else None


def wanted(environ=os.environ):
    """Whether this process should point the trampoline at mpicoll's library."""
    return (any(name in environ for name in LAUNCHER_RANK_VARIABLES)
            and VARIABLE not in environ
            and environ.get(OPT_OUT, "").strip().lower() != "gloo")


def prepare(environ=os.environ):
    """Set MPITRAMPOLINE_LIB to mpicoll's library where it exists; returns the path or None."""
    path = library_path()
    if not os.path.isfile(path) or jaxlib_version() not in VERIFIED_JAXLIB:
        return None
    environ[VARIABLE] = path
    return path

"""MPICOLL_AS_MPI4JAX=1: `import mpi4jax` gives `mpicoll.mpi4jax`, in every Python process.

The install puts `mpicoll_as_mpi4jax.pth` into site-packages (setup.py's data
files); Python runs its one line at start-up, which imports this module and
calls install() only when the variable is on.  Off (unset, "", 0, false, no,
off), nothing is imported and nothing changes: an installed mpi4jax is what
`import mpi4jax` finds.  On, a finder placed first on sys.meta_path answers for
the name `mpi4jax` alone, so it wins over an installed mpi4jax and over any
`mpi4jax` folder on PYTHONPATH (docs/mpi4jax.md).

This module sits outside the mpicoll package, and imports nothing beyond the
standard library: it runs in every Python process of the environment, and
importing mpicoll starts JAX and MPI.  mpicoll.mpi4jax is imported only when a
program imports mpi4jax.
"""

import importlib
import importlib.machinery
import os
import sys

VARIABLE = "MPICOLL_AS_MPI4JAX"
NAME = "mpi4jax"
TARGET = "mpicoll.mpi4jax"
PTH = "mpicoll_as_mpi4jax.pth"
# mpicoll's rule for a flag (runtime/settings.py's _flag): these mean off.
_OFF = ("", "0", "false", "no", "off")


def enabled(environ=os.environ):
    """Whether the variable asks for the switch (mpicoll's flag rule: "1", "yes", "on", ...)."""
    return environ.get(VARIABLE, "").strip().lower() not in _OFF


class _Alias:
    """Loads `mpi4jax` as mpicoll.mpi4jax itself: the same module object, with its
    own name and spec, so `mpi4jax is mpicoll.mpi4jax`."""

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module):
        # importlib returns whatever sys.modules holds for the name after this call.
        sys.modules[module.__name__] = importlib.import_module(TARGET)


class Finder:
    """The meta-path finder for the name `mpi4jax` (its submodules are not mapped:
    mpi4jax 0.9's only ones are private, mpi4jax._src)."""

    _loader = _Alias()

    def find_spec(self, name, path=None, target=None):
        if name != NAME:
            return None
        return importlib.machinery.ModuleSpec(NAME, self._loader, origin=TARGET)

    def invalidate_caches(self):
        pass


def installed():
    """Whether this process's `import mpi4jax` goes to mpicoll.mpi4jax (the finder is on sys.meta_path)."""
    return any(isinstance(finder, Finder) for finder in sys.meta_path)


def install():
    """Put the finder first on sys.meta_path (once); called by the .pth file when enabled()."""
    if not installed():
        sys.meta_path.insert(0, Finder())

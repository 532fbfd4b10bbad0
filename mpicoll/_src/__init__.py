"""mpicoll's internals, behind one door (as jax/_src is JAX's): the public modules
are mpicoll, mpicoll.mpi4jax, mpicoll.distributed and mpicoll.topology.

  runtime/     the extension, MPI and its communicators, dtypes, settings
  primitive/   the machinery that makes a collective a JAX primitive
  ops/         the public functions: the collectives (each spec beside its functions),
               the typed ranks' mesh and autodiff mode, overlap and dispatch order
  over_ranks/  jax.lax collectives over the ranks, global meshes, multihost_utils
  observe/     failures, stalls, the flight recorder, the timeline, stacks
  _compat/     every private JAX API mpicoll uses
  survive.py   surviving a lost rank (ULFM)
  install.py   every change to JAX, XLA and the process at import, in order
"""

import functools
import os
import sys

# mpicoll's own folder (with a trailing separator): frames below it are
# mpicoll's, left out of tracebacks, call sites and reports.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@functools.lru_cache(maxsize=None)
def _not_users_folders():
    import jax  # not at this package's import, which must not import JAX
    jax_dir = os.path.dirname(jax.__file__)
    return (PACKAGE_DIR, jax_dir + os.sep,
            os.path.join(os.path.dirname(jax_dir), "jaxlib") + os.sep)


def users_line_now():
    """"file:line (function)" of the innermost frame on this thread's Python stack
    outside mpicoll, JAX and jaxlib: the user's line that runs mpicoll now (a
    call being traced, compiled or refused), or None."""
    skipped = _not_users_folders()
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skipped) and not name.startswith("<"):
            return f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None

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

import os

# mpicoll's own folder (with a trailing separator): frames below it are
# mpicoll's, left out of tracebacks, call sites and reports.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

"""Every change mpicoll makes to JAX, XLA and this Python process, in one place and order.

Importing mpicoll's modules defines its primitives and registers their own
rules (lowering, batching, JVP, transpose: JAX's extension points, used as any
library uses them) and changes nothing else.  Whatever changes how JAX, XLA or
the process behave is a step below, applied once by install() at the end of
`import mpicoll`, in the order of STEPS; `python -m mpicoll info` lists each
step with what it did in this process (installed()).

Why this order:
  xla-cpu-pool      first: it must come before anything starts JAX's backends.
  ffi-targets, ordered-effect
                    what every lowering of an mpicoll primitive needs.
  runtime-token-fast-path, serialized-dispatch, dispatch-order
                    how dispatched programs are ordered (primitive/device_order.py);
                    the serialized check raises ImportError where it cannot hold.
  lax-refused-over-ranks, ranks-axis-size, lax-routed
                    jax.lax over mpicoll.RANKS: the refusal behind the router first,
                    so no moment exists where a lax collective over RANKS could
                    reach XLA unrefused.
  traceback-filter  mpicoll's frames out of the tracebacks users see.
  pending-collectives-at-exit
                    before failure-handling, so its exit notices run first (atexit
                    runs in reverse order) and the flush last, before MPI_Finalize.
  failure-handling  last: its hooks (abort on error, the watchdog, the exit
                    notices) watch a fully imported mpicoll.

Two changes are made later, not at import, by mpicoll.distributed.initialize()
(the user asked for JAX's multi-process runtime), each through later():
  gloo-on-loopback  where every rank is on one node, JAX's CPU backend makes
                    gloo's collectives listening on 127.0.0.1 (_compat/backends.py)
  multihost-on-mpi  JAX's multihost_utils get mpicoll's collectives
                    (over_ranks/multihost.py)
"""

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Step:
    name: str                 # what `python -m mpicoll info` calls it
    changes: str              # what it changes, in one line
    apply: Callable[[], str]  # makes the change; returns what it did in this process


def _steps():
    # Imported here, not at the top: install() runs once every module is loaded.
    from . import PACKAGE_DIR, _compat
    from .observe import failures
    from .over_ranks import lax as lax_over_ranks
    from .primitive import define, device_order, varying
    from .runtime import native, settings

    def ordered_effect():
        _compat.register_ordered_effect(define.MPIEffect)
        return "MPIEffect"

    def traceback_filter():
        _compat.hide_frames_under(PACKAGE_DIR)
        return f"frames under {PACKAGE_DIR}"

    return (
        Step("xla-cpu-pool", "PJRT_NPROC: XLA's CPU pool at two threads per local device "
             "where the cores are fewer",
             lambda: device_order.size_xla_cpu_pool(warn_if_late=True)),
        Step("ffi-targets", "XLA's FFI registry: mpicoll's handlers",
             native.register_ffi_targets),
        Step("ordered-effect", "JAX's ordered effects: mpicoll's, so each rank issues its "
             "collectives in program order", ordered_effect),
        Step("runtime-token-fast-path", "JAX's runtime tokens: no copy of the token that "
             "is already on a program's devices", device_order.install_runtime_token_fast_path),
        Step("serialized-dispatch", "JAX's dispatch: at MPI_THREAD_SERIALIZED each "
             "dispatch waits for its program", device_order.complete_serialized_dispatches),
        Step("dispatch-order", "JAX's lowering and dispatch: CPU programs carry their "
             "ordering token inside (set_dispatch)", device_order.install_device_order),
        Step("lax-refused-over-ranks", "the lowering rules of jax.lax's collectives: one "
             "over RANKS that was not routed raises", varying.refuse_unrouted_lax_over_ranks),
        Step("ranks-axis-size", "JAX's axis sizes: RANKS has the number of ranks",
             lax_over_ranks.size_ranks_axis),
        Step("lax-routed", "bind of jax.lax's collective primitives: over RANKS they run "
             "mpicoll's collectives", lax_over_ranks.route_lax_collectives),
        Step("traceback-filter", "JAX's traceback filtering: mpicoll's frames left out",
             traceback_filter),
        Step("pending-collectives-at-exit", "atexit: collectives still queued in XLA "
             "complete before MPI_Finalize", native.flush_pending_collectives_at_exit),
        Step("failure-handling", "sys/threading excepthooks, atexit, SIGUSR1/2, the "
             "watchdog thread", lambda: failures.configure(settings.current())),
    )


_installed = []  # (Step, what it did), in order
_installed_later = []  # the same, for the steps made after import (later())


def install():
    """Apply every step, in order, once (mpicoll/__init__.py)."""
    if _installed:
        return
    for step in _steps():
        _installed.append((step, step.apply() or "done"))


def later(name, changes, apply):
    """Apply a change made after import (mpicoll.distributed.initialize), once, and list it."""
    if any(step.name == name for step, _ in _installed_later):
        return
    step = Step(name, changes, apply)
    _installed_later.append((step, step.apply() or "done"))


def installed():
    """The steps applied in this process at import: [(name, what it changes, what it did)]."""
    return [(step.name, step.changes, outcome) for step, outcome in _installed]


def installed_later():
    """The changes made since import (later()), as installed() lists them."""
    return [(step.name, step.changes, outcome) for step, outcome in _installed_later]

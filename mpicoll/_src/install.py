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
  traceback-filter  mpicoll's frames out of the tracebacks users see.
  pending-collectives-at-exit
                    before failure-handling, so its exit notices run first (atexit
                    runs in reverse order) and the flush last, before MPI_Finalize.
  failure-handling  last: its hooks (abort on error, the watchdog, the exit
                    notices) watch a fully imported mpicoll.

JAX's own collectives are changed only for a program that uses mpicoll's mesh
vocabulary: the first use of mpicoll.RANKS (the attribute, as `from mpicoll import
RANKS` reads it), mpicoll.mesh() or mpicoll.distributed.initialize() applies
these steps, in this order, once (on_first_use_of_ranks()):
  lax-refused-over-ranks, ranks-axis-size, lax-routed
                    jax.lax over mpicoll.RANKS and global meshes: the refusal behind
                    the router first, so no moment exists where a lax collective over
                    RANKS could reach XLA unrefused.
Until then every lax.parallel primitive binds and lowers as JAX's own, and a
psum costs what it costs without mpicoll.

The other changes made later, not at import, are mpicoll.distributed.initialize()'s
(the user asked for JAX's multi-process runtime), each through later():
  gloo-on-loopback  where every rank is on one node, JAX's CPU backend makes
                    gloo's collectives listening on 127.0.0.1 (_compat/backends.py)
  multihost-on-mpi  JAX's multihost_utils get mpicoll's collectives
                    (over_ranks/multihost.py)
"""

import dataclasses
import threading
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
    from .primitive import define, device_order
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
        Step("traceback-filter", "JAX's traceback filtering: mpicoll's frames left out",
             traceback_filter),
        Step("pending-collectives-at-exit", "atexit: collectives still queued in XLA "
             "complete before MPI_Finalize", native.flush_pending_collectives_at_exit),
        Step("failure-handling", "sys/threading excepthooks, atexit, SIGUSR1/2, the "
             "watchdog thread", lambda: failures.configure(settings.current())),
    )


# What the first use of mpicoll's mesh vocabulary applies (on_first_use_of_ranks).
FIRST_USE_OF_RANKS = ("the first use of mpicoll.RANKS, mpicoll.mesh() or "
                      "mpicoll.distributed.initialize()")


def _lax_over_ranks_steps():
    from .over_ranks import lax as lax_over_ranks
    from .primitive import varying

    return (
        Step("lax-refused-over-ranks", "the lowering rules of jax.lax's collectives: one "
             "over RANKS that was not routed raises", varying.refuse_unrouted_lax_over_ranks),
        Step("ranks-axis-size", "JAX's axis sizes: RANKS has the number of ranks",
             lax_over_ranks.size_ranks_axis),
        Step("lax-routed", "bind of jax.lax's collective primitives: over RANKS and "
             "global meshes they run mpicoll's collectives", lax_over_ranks.route_lax_collectives),
    )


_installed = []  # (Step, what it did), in order
_installed_later = []  # the same, for the steps made after import: (Step, what it did, by what)
_first_use_lock = threading.Lock()  # two threads' first uses apply the steps once


def install():
    """Apply every step, in order, once (mpicoll/__init__.py)."""
    if _installed:
        return
    for step in _steps():
        _installed.append((step, step.apply() or "done"))


def later(name, changes, apply, by="mpicoll.distributed.initialize()"):
    """Apply a change made after import, once, and list it with what made it."""
    if any(step.name == name for step, _, _ in _installed_later):
        return
    step = Step(name, changes, apply)
    _installed_later.append((step, step.apply() or "done", by))


_routed = False  # set once every step of _lax_over_ranks_steps() is applied


def on_first_use_of_ranks():
    """Apply the steps of jax.lax over RANKS and global meshes, once (mpicoll.RANKS,
    mpicoll.mesh(), mpicoll.distributed.initialize() call it; cheap after)."""
    global _routed
    if _routed:
        return
    with _first_use_lock:
        if _routed:
            return
        for step in _lax_over_ranks_steps():
            later(step.name, step.changes, step.apply, by=FIRST_USE_OF_RANKS)
        _routed = True


def installed():
    """The steps applied in this process at import: [(name, what it changes, what it did)]."""
    return [(step.name, step.changes, outcome) for step, outcome in _installed]


def installed_later():
    """The changes made since import: [(name, what it changes, what it did, by what)]."""
    return [(step.name, step.changes, outcome, by) for step, outcome, by in _installed_later]


def on_first_use():
    """The steps not applied yet that the first use of mpicoll's mesh vocabulary would
    apply: [(name, what it changes)] (none once applied)."""
    return [] if _routed else [(step.name, step.changes) for step in _lax_over_ranks_steps()]

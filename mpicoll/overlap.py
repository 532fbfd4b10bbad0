"""Overlapped collectives: calls that run while XLA keeps computing.

Inside `with mpicoll.overlap():`, collectives traced under `jax.jit` lower to
overlapped FFI handlers: the handler queues the MPI call on a progress thread
of its local device and returns at once (an FFI future), so XLA runs the work
that does not depend on the result meanwhile.  The progress thread runs its
calls in the order their handlers were invoked, which the ordered MPI effect
makes program order on every rank; a synchronous call first waits for the
queued ones.  Opt-in because the hand-off costs microseconds that a small
collective alone would feel (benchmarks/overlap.py measures both).
"""

import contextlib
import threading

_state = threading.local()


@contextlib.contextmanager
def overlap(enabled=True):
    """Collectives traced inside this block (under jit, on CPU) overlap independent computation."""
    previous = active()
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def active():
    """Whether collectives traced now are overlapped."""
    return getattr(_state, "enabled", False)

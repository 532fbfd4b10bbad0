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
    """A block whose collectives, traced under jax.jit on CPU, overlap independent computation.

    Collectives traced inside it (every collective, pytrees, point-to-point)
    lower to overlapped handlers: each queues its MPI call on a progress thread
    of its local device and returns at once, so XLA runs the work that does not
    depend on the result meanwhile.  MPI still sees every rank's calls in
    program order (one thread per device runs its queue in order, and a
    synchronous call first waits for it).  Opt-in: the hand-off costs about
    3 us per call, which a small collective with nothing to overlap feels
    (docs/overlap.md).

    Args:
        enabled: True (the default); False traces the block's collectives
            synchronously, e.g. inside an outer overlap() block.
    Returns:
        A context manager.  It is read when a collective is traced, so use it
        inside the jitted function; eager calls stay synchronous inside it.
    Raises:
        NotImplementedError: when a collective traced inside it is lowered for
            a GPU.
    Note:
        Every rank must overlap the same calls: the checks across ranks
        compare it, and ranks that differ raise the mismatch error.

    Example::

        @jax.jit
        def step(params, x, y):
            grads = jax.grad(loss)(params, x, y)         # a list, one entry per layer
            with mpicoll.overlap():                       # these calls overlap computation
                for layer in reversed(range(len(grads))):  # last layer first: backprop's order
                    grads[layer] = mpicoll.allreduce(grads[layer])
            return update(params, grads)
    """
    previous = active()
    _state.enabled = bool(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def active():
    """Whether collectives traced now are overlapped."""
    return getattr(_state, "enabled", False)

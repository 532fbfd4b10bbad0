"""How the collectives traced from now on are scheduled: overlapped with the
computation around them (overlap) and ordered after the previous program
(set_dispatch, dispatch_mode).

These are the public choices; what reads them lies below: the overlapped
lowering in primitive/dispatch.py and primitive/define.py, the dispatch
order's hooks in primitive/device_order.py.

Overlapped calls: inside `with mpicoll.overlap():`, collectives traced under
`jax.jit` lower to overlapped FFI handlers: the handler queues the MPI call on
a progress thread of its local device and returns at once (an FFI future), so
XLA runs the work that does not depend on the result meanwhile.  The progress
thread runs its calls in the order their handlers were invoked, which the
ordered MPI effect makes program order on every rank; a synchronous call first
waits for the queued ones.  Opt-in because the hand-off costs microseconds that
a small collective alone would feel (benchmarks/overlap.py measures both).
"""

from ..primitive import device_order
from ..primitive.dispatch import overlapping


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
    return overlapping(enabled)


def set_dispatch(mode):
    """Choose how programs traced from now on are ordered after the previous ones.

    Every rank issues its MPI calls in program order in both modes; they differ
    in how a program waits for the one before it, and so in what a dispatch
    costs (docs/design.md, "Dispatch").

    Args:
        mode: "device-order" (the default where available; MPICOLL_DISPATCH
            sets the initial mode): a CPU program carries no runtime token,
            JAX dispatches it on its C++ fast path and XLA's execution queues
            order it: single-device programs or multi-device ones (pmap,
            shard_map), whichever kind is lowered first in the process (the
            other kind keeps runtime tokens and is fenced; multi-device
            programs only where XLA's pool has two threads per local device:
            the cores, or PJRT_NPROC).  "tokens": every program with a collective
            takes and returns JAX's runtime token (JAX's Python dispatch path,
            about 180 us per call), as GPU programs and the serialized thread
            mode always do.
    Returns:
        The previous mode, "device-order" or "tokens".
    Raises:
        ValueError: for another mode, or for "device-order" where it is not
            available (at MPI_THREAD_SERIALIZED, or with a JAX whose internals
            mpicoll does not recognize).
    Note:
        A compiled program keeps the mode it was lowered with.  An MPI error
        raised while a device-order program is dispatched from JAX's cache
        comes as ValueError (jit's C++ fast path converts it, jax-ml/jax#34083)
        rather than jax.errors.JaxRuntimeError, with the same message; eager
        calls raise JaxRuntimeError either way.

    Example::

        previous = mpicoll.set_dispatch("tokens")   # for the programs traced from here
        step = jax.jit(train_step)
        mpicoll.set_dispatch(previous)
    """
    device_order.refuse_unavailable(mode, "mpicoll.set_dispatch")
    previous = device_order.current_mode()
    device_order.use_mode(mode)
    return previous


def dispatch_mode():
    """The current dispatch mode, for programs traced from now on (see set_dispatch).

    Returns:
        "device-order" (the default on CPU where JAX allows it) or "tokens".

    Example::

        print(mpicoll.dispatch_mode())   # "device-order"; python -m mpicoll info says it too
    """
    return device_order.current_mode()

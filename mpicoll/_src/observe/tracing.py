"""The timeline's recording, from import to exit (MPICOLL_TRACE=DIR) or between
two lines of a program (start_trace / stop_trace, or `with mpicoll.trace(DIR):`).

While a trace runs, every collective of every local device is kept
(csrc/watch/flight.h), except each call site's first `skip` calls on a device
(its warm-up: compilation and first touches), which go to the flight recorder's
ring as when no trace runs.  Stopping writes this rank's records to
DIR/rank<r>.json; `python -m mpicoll trace DIR` merges the ranks' files.  A
trace that is still running when the job times out or aborts is written then.
"""

import contextlib
import os
import sys

from ..runtime import settings
from ..runtime.native import extension

_directory = None   # the running trace's, else None
_from = None        # how it was started: "MPICOLL_TRACE=..." or "start_trace"


def start_trace(directory, skip=0):
    """Record every collective of this rank from now on, for `python -m mpicoll trace`.

    Call it at the same point on every rank (it makes no MPI call: the ranks'
    traces cover the same collectives only where they start alike).

    Args:
        directory: where stop_trace() writes rank<r>.json (made now if
            missing; it must be writable); one directory for every rank.
        skip: leave out each call site's first `skip` calls on each local
            device (default 0): the calls that compile and warm up.
    Returns:
        None.
    Raises:
        RuntimeError: if a trace runs already (MPICOLL_TRACE's, or one started
            here and not stopped).
        ValueError: for a directory mpicoll cannot write to, or a negative skip.

    Example::

        for step in range(steps):
            if step == 10:
                mpicoll.start_trace("timeline", skip=0)   # after warm-up
            state = train_step(state)
        mpicoll.stop_trace()
    """
    if _directory is not None:
        raise RuntimeError(f"mpicoll.start_trace: a trace to {_directory} runs already "
                           f"({_from}); stop it first with mpicoll.stop_trace()")
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise ValueError(f"mpicoll.start_trace: skip must be a whole number >= 0, got {skip!r}")
    path = settings.writable_directory("mpicoll.start_trace: directory", os.fspath(directory),
                                       create=True)
    _begin(path, skip, "start_trace")


def _begin(path, skip, started_by):
    global _directory, _from
    extension.set_trace(path, skip)
    _directory, _from = path, started_by


def stop_trace():
    """Stop the trace and write this rank's timeline.

    Its collectives still queued in XLA are waited for first, so the file holds
    every collective called while the trace ran.

    Returns:
        The file written, DIRECTORY/rank<r>.json.
    Raises:
        RuntimeError: if no trace runs, or the file cannot be written.

    Example::

        mpicoll.start_trace("timeline")
        run_steps(state, 20)
        mpicoll.stop_trace()      # then: python -m mpicoll trace timeline
    """
    return _stop("stop_trace")


def _stop(reason):
    global _directory, _from
    import jax
    from mpi4py import MPI

    if _directory is None:
        raise RuntimeError("mpicoll.stop_trace: no trace runs (start one with "
                           "mpicoll.start_trace(directory) or MPICOLL_TRACE=directory)")
    jax.effects_barrier()  # collectives still queued in XLA belong to the trace
    directory, _directory, _from = _directory, None, None
    path = os.path.join(directory, f"rank{MPI.COMM_WORLD.Get_rank()}.json")
    if not extension.stop_trace(reason):
        raise RuntimeError(f"mpicoll.stop_trace: could not write {path}")
    return path


@contextlib.contextmanager
def trace(directory, skip=0):
    """Record every collective of this rank inside the block (start_trace, then
    stop_trace at its end, an exception too); run it on every rank alike.

    Args:
        directory: where rank<r>.json is written at the block's end.
        skip: leave out each call site's first `skip` calls (default 0).
    Returns:
        A context manager; `as` gives the directory, as an absolute path.

    Example::

        train_step(state)                       # compiles
        with mpicoll.trace("timeline"):
            for _ in range(20):
                state = train_step(state)
        # python -m mpicoll trace timeline
    """
    start_trace(directory, skip)
    try:
        yield _directory
    finally:
        stop_trace()


def tracing_to():
    """(the running trace's directory, how it was started), or (None, None)."""
    return _directory, _from


def start_at_import(current):
    """MPICOLL_TRACE: a trace from import to exit (written then by an exit handler)."""
    if current.trace:
        _begin(current.trace, current.trace_skip,
               settings.sources()["trace"])


def stop_at_exit():
    """The exit handler: write a trace still running (MPICOLL_TRACE's, or one never stopped)."""
    if _directory is not None:
        try:
            _stop("exit")
        except RuntimeError as error:  # the process is exiting: say so, raise nothing
            print(f"mpicoll: at exit: {error}", file=sys.stderr, flush=True)

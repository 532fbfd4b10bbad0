"""A rank of the job was lost: what mpicoll raises, and which ranks are gone (ULFM).

In a job launched fault-tolerant (MPICOLL_FT=1 launch/mpirun.sh on Open MPI 5,
docs/surviving.md), a process that dies makes the collectives of its
communicators return MPI_ERR_PROC_FAILED (or MPI_ERR_REVOKED: the handler that
saw the failure revoked the communicator, csrc/engine/call.h) on the survivors
instead of ending the job.  Such an error carries a marker, and mpicoll raises
it as RankLost.  So does an MPI error of a communicator's set-up (its Dup, the
layout's allgather, its registration, the first-run check: lost_in_setup), so
that a rank lost at any moment is a RankLost on every survivor.
"""

import os
import signal
import time

from mpi4py import MPI

from . import settings
from .native import extension

_MARKER = "a rank of the job was lost"  # csrc/engine/call.h, kRankLostMarker


class RankLost(RuntimeError):
    """A process of the job died while this rank was in (or about to enter) a collective,
    or while mpicoll set a communicator up for one (its first use).

    Raised on every survivor by the collective it waits in or the next one it
    calls, in a job launched fault-tolerant (MPICOLL_FT=1 launch/mpirun.sh on
    Open MPI 5); elsewhere a lost rank ends the job as before.  Eager calls
    raise it themselves; wrap your own jitted step with mpicoll.fault_tolerant
    (JAX raises a handler's error as its own type, JaxRuntimeError, whose text
    names RankLost; only a loss while the step is traced raises RankLost itself).  mpicoll.shrink() then
    rebuilds the default communicator from the survivors.

    Args:
        message: what happened.
        lost: the lost ranks of MPI.COMM_WORLD (its attribute `lost`).
    Returns:
        The exception (raised by mpicoll, not by you).
    Example::

        try:
            params = step(params, batch)
        except mpicoll.RankLost as lost:
            print("lost ranks", lost.lost)
            mpicoll.shrink()
    """

    def __init__(self, message, lost=()):
        super().__init__(message)
        self.lost = tuple(lost)


def is_rank_lost(error):
    """Whether an exception (JAX's, from a handler) says a rank of the job was lost."""
    return _MARKER in str(error)


def lost_ranks(comm=None):
    """The ranks of MPI.COMM_WORLD whose processes this process knows to have failed.

    Args:
        comm: the communicator to ask about (default MPI.COMM_WORLD).
    Returns:
        A sorted tuple of COMM_WORLD ranks; () where the MPI has no ULFM, or no
        call has seen a rank die.
    Example::

        except mpicoll.RankLost:
            gone = mpicoll.lost_ranks()        # e.g. (3,)
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    get_failed = getattr(comm, "Get_failed", None)
    if get_failed is None or not extension.fault_tolerance()["rank_lost"]:
        return ()
    try:
        failed = get_failed()
    except (MPI.Exception, NotImplementedError):
        return ()
    try:
        world = MPI.COMM_WORLD.Get_group()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), world)
        world.Free()
    finally:
        failed.Free()
    return tuple(sorted(r for r in ranks if r != MPI.UNDEFINED))


def as_rank_lost(error, during="a collective"):
    """RankLost for an error that says a rank was lost (its cause kept), else None."""
    if not is_rank_lost(error):
        return None
    lost = lost_ranks()
    who = (f"rank{'s' if len(lost) != 1 else ''} {', '.join(map(str, lost))} of "
           "MPI.COMM_WORLD" if lost else "a rank")
    return RankLost(f"mpicoll: {who} died during {during} ({error}); call "
                    "mpicoll.shrink() to go on with the survivors", lost)


SETUP_FAILURE_WAIT_S = 1.0


def launched_fault_tolerant():
    """Whether this job was launched to survive a lost rank (MPICOLL_FT=1, or Open
    MPI's mpiexec --with-ft ulfm given by hand: its MCA variable is in the ranks'
    environment)."""
    return settings.current().ft or \
        os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() in ("1", "true")


def lost_in_setup(error, comms, during):
    """RankLost where mpi4py's MPI.Exception from a communicator's set-up (Dup, the
    layout's allgather) says a process failed, else None (re-raise the error).

    The communicators `comms` (the one being set up, the duplicates made so far)
    are revoked, with every one mpicoll talks on, so that every survivor, in the
    set-up or in a collective, wakes to the same RankLost.
    """
    handles = [comm.handle for comm in comms if comm != MPI.COMM_NULL]
    # Open MPI's Dup may fail as MPI_ERR_OTHER when a member dies during it, and
    # then the failure may reach this process's view a moment later: in a
    # fault-tolerant launch an error waits that long for it (once, on an error).
    deadline = time.monotonic() + (SETUP_FAILURE_WAIT_S if launched_fault_tolerant() else 0)
    while not extension.rank_lost_failure(error.Get_error_code(), handles):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)
    text = f"{MPI.Get_error_string(error.Get_error_code())} ({_MARKER})"
    return as_rank_lost(text, during=during)


# Test-only kill points (csrc/engine/test_kill.h says the variable's form): off
# unless a test program sets MPICOLL_TEST_KILL before importing mpicoll.
_TEST_KILLS = frozenset(filter(None, os.environ.get("MPICOLL_TEST_KILL", "").split(",")))


def _test_kill_at(moment):
    """SIGKILL this process where MPICOLL_TEST_KILL names `moment` for this rank now."""
    if not _TEST_KILLS:
        return
    recoveries = extension.fault_tolerance()["recoveries"]
    if f"{moment}@{MPI.COMM_WORLD.Get_rank()}/{recoveries}" not in _TEST_KILLS:
        return
    log = os.environ.get("MPICOLL_TEST_KILL_LOG")
    if log:
        with open(log, "a") as file:
            file.write(f"{moment} {MPI.COMM_WORLD.Get_rank()} {time.time_ns()}\n")
    os.kill(os.getpid(), signal.SIGKILL)

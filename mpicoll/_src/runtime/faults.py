"""A rank of the job was lost: what mpicoll raises, and which ranks are gone (ULFM).

In a job launched fault-tolerant (MPICOLL_FT=1 launch/mpirun.sh on Open MPI 5,
docs/surviving.md), a process that dies makes the collectives of its
communicators return MPI_ERR_PROC_FAILED (or MPI_ERR_REVOKED: the handler that
saw the failure revoked the communicator, csrc/engine/call.h) on the survivors
instead of ending the job.  Such an error carries a marker, and mpicoll raises
it as RankLost.
"""

from mpi4py import MPI

from .native import extension

_MARKER = "a rank of the job was lost"  # csrc/engine/call.h, kRankLostMarker


class RankLost(RuntimeError):
    """A process of the job died while this rank was in (or about to enter) a collective.

    Raised on every survivor by the collective it waits in or the next one it
    calls, in a job launched fault-tolerant (MPICOLL_FT=1 launch/mpirun.sh on
    Open MPI 5); elsewhere a lost rank ends the job as before.  Eager calls
    raise it themselves; wrap your own jitted step with mpicoll.fault_tolerant
    (JAX raises a handler's error as its own type).  mpicoll.shrink() then
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


def as_rank_lost(error):
    """RankLost for an error that says a rank was lost (its cause kept), else None."""
    if not is_rank_lost(error):
        return None
    lost = lost_ranks()
    who = (f"rank{'s' if len(lost) != 1 else ''} {', '.join(map(str, lost))} of "
           "MPI.COMM_WORLD" if lost else "a rank")
    return RankLost(f"mpicoll: {who} died during a collective ({error}); call "
                    "mpicoll.shrink() to go on with the survivors", lost)

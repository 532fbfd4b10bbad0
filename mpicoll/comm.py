"""Communicator layer: mpi4py communicators -> slots in the extension's table.

A compiled program names its communicator by a small slot number; the
extension's table maps the slot to the MPI_Comm handle.  The slot is cached on
the communicator itself as an MPI attribute, so it is found in O(1) and dropped
when the communicator is freed (MPI calls the attribute's delete callback).
"""

import dataclasses

from mpi4py import MPI

from ._native import extension

_MAX_COMMS = extension.build_info()["max_comms"]


@dataclasses.dataclass(frozen=True)
class CommInfo:
    """What a collective needs to know about a communicator at trace time."""
    slot: int
    size: int
    rank: int
    name: str


_free_slots = list(range(_MAX_COMMS - 1, -1, -1))
_slot_infos = {}  # slot -> CommInfo, for rules that need the rank (e.g. transposes)
_default_comm = None


def _release_slot(comm, keyval, info):
    # MPI calls this when the communicator is freed: its slot may be reused.
    _slot_infos.pop(info.slot, None)
    _free_slots.append(info.slot)


_SLOT_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_release_slot)


def default_comm():
    """mpicoll's own duplicate of COMM_WORLD (made at first use, collectively on all ranks).

    Keeping mpicoll's traffic on its own communicator means it never matches
    messages of the user's own mpi4py calls on COMM_WORLD.
    """
    global _default_comm
    if _default_comm is None:
        comm = MPI.COMM_WORLD.Dup()
        comm.Set_name("mpicoll_world")
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        _default_comm = comm
    return _default_comm


def resolve(comm, caller):
    """Validate comm (None = default) and return its CommInfo; raises before any MPI traffic."""
    if comm is None:
        comm = default_comm()
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"mpicoll.{caller}: comm must be an mpi4py MPI.Intracomm, "
                        f"got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"mpicoll.{caller}: comm is MPI.COMM_NULL (freed or never created)")
    if isinstance(comm, MPI.Intercomm) or comm.Is_inter():
        raise TypeError(f"mpicoll.{caller}: comm is an inter-communicator; "
                        "mpicoll collectives need an intracommunicator")
    info = comm.Get_attr(_SLOT_KEYVAL)
    if info is None:
        info = _register(comm, caller)
    return info


def _register(comm, caller):
    if not _free_slots:
        raise RuntimeError(f"mpicoll.{caller}: more than {_MAX_COMMS} communicators in use; "
                           "free some with comm.Free()")
    slot = _free_slots.pop()
    info = CommInfo(slot=slot, size=comm.Get_size(), rank=comm.Get_rank(),
                    name=comm.Get_name() or f"comm#{slot}")
    extension.register_comm(slot, 0, comm.handle)
    comm.Set_attr(_SLOT_KEYVAL, info)
    _slot_infos[slot] = info
    return info


def info_for_slot(slot):
    """The CommInfo of a registered slot (used by rules that run after binding)."""
    return _slot_infos[slot]

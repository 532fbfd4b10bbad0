"""Communicator layer: mpi4py communicators -> per-device duplicates -> table slots.

A compiled program names its communicator by a small slot number; the
extension's table maps (slot, local device) to an MPI_Comm.  Each communicator
a user passes gets one private duplicate per local device, so that

* mpicoll's messages never match the user's own mpi4py calls on that communicator;
* under pmap/shard_map, where every local device runs its program on its own
  thread at the same time, device k of every rank talks on its own communicator
  (collectives of different devices on one communicator would mix).

The duplicates are made collectively, in the same order on every rank, when a
communicator is first used (first use is in program order, identical on every
rank).  The slot is cached on the user's communicator as an MPI attribute, so it
is found in O(1), and MPI's delete callback releases everything when the user
frees the communicator.
"""

import dataclasses
import os
import time

import jax
from mpi4py import MPI

from .. import PACKAGE_DIR
from .. import _compat
from . import faults, native, settings
from .native import extension

_BUILD = extension.build_info()


@dataclasses.dataclass(frozen=True)
class CommInfo:
    """What a collective needs to know about a communicator at trace time."""
    slot: int
    size: int
    rank: int
    name: str
    per_device: tuple = dataclasses.field(compare=False)  # private duplicates, one per device
    mesh_axes: tuple = ()  # the global mesh axes it was made for (over_ranks/lax.py)


_free_slots = list(range(_BUILD["max_comms"] - 1, -1, -1))
_generations = [0] * _BUILD["max_comms"]  # key = generation * max_comms + slot
_slot_infos = {}  # slot -> CommInfo, for rules that need the rank (e.g. transposes)


def _release(comm, keyval, info):
    # MPI calls this when the user's communicator is freed.  Programs compiled
    # for it now fail (their key is stale) rather than run on another communicator.
    extension.unregister_comm(info.slot)
    for dup in info.per_device:
        if dup != MPI.COMM_NULL:
            dup.Free()
    _slot_infos.pop(info.slot, None)
    _free_slots.append(info.slot % _BUILD["max_comms"])


_SLOT_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_release)


def default_comm():
    """The communicator a collective uses when comm=None.

    Returns:
        MPI.COMM_WORLD, or after mpicoll.shrink() the survivors' communicator
        it returned.  mpicoll never talks on it (or on any comm= given);
        at first use it makes private duplicates, one per local device, so its
        messages never match your own mpi4py calls.

    Example::

        size = mpicoll.default_comm().Get_size()
    """
    return _default[0]


_default = [MPI.COMM_WORLD]  # the survivors' communicator after mpicoll.shrink()


def set_default(comm):
    """Make comm the default communicator (mpicoll.shrink)."""
    _default[0] = comm


def resolve(comm, caller):
    """Validate comm (None = default) and return its CommInfo; raises before any MPI traffic."""
    if comm is None:
        comm = _default[0]
    if isinstance(comm, CommInfo):  # already resolved (e.g. by the pytree path)
        return comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"mpicoll.{caller}: comm must be an mpi4py MPI.Intracomm, "
                        f"got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"mpicoll.{caller}: comm is MPI.COMM_NULL (freed or never created)")
    try:
        inter = isinstance(comm, MPI.Intercomm) or comm.Is_inter()
    except MPI.Exception as error:
        # A handle MPI no longer knows: typically a second Python object for a
        # communicator freed through another one (only that one became COMM_NULL).
        raise ValueError(f"mpicoll.{caller}: comm is not a valid communicator (freed through "
                         f"another handle?): {MPI.Get_error_string(error.Get_error_class())}") \
            from None
    if inter:
        raise TypeError(f"mpicoll.{caller}: comm is an inter-communicator; "
                        "mpicoll collectives need an intracommunicator")
    info = comm.Get_attr(_SLOT_KEYVAL)
    if info is None:
        info = _register(comm, caller)
    return info


def _register(comm, caller):
    local_devices = jax.local_device_count()
    if local_devices > _BUILD["max_local_devices"]:
        raise RuntimeError(f"mpicoll.{caller}: {local_devices} local devices; this build "
                           f"supports {_BUILD['max_local_devices']}")
    if native.SERIALIZED and local_devices > 1:
        raise RuntimeError(
            f"mpicoll.{caller}: MPI runs at MPI_THREAD_SERIALIZED, where mpicoll allows one "
            f"local device per process, but JAX has {local_devices} here: their threads would "
            "call MPI at once. Use one device per process, or MPI_THREAD_MULTIPLE "
            "(MPI4PY_RC_THREAD_LEVEL=multiple, mpi4py's default)")
    if not _free_slots:
        raise RuntimeError(f"mpicoll.{caller}: more than {_BUILD['max_comms']} communicators "
                           "in use; free some with comm.Free()")
    _map_device_ordinals()
    # A reused slot gets a new key, so programs compiled for its previous
    # communicator fail instead of running on this one.
    index = _free_slots[-1]
    slot = (_generations[index] + 1) * _BUILD["max_comms"] + index
    name = comm.Get_name() or f"comm{slot}"
    members = _world_ranks(comm)
    per_device = []
    # Collective, in the same order on every rank; watched like a collective
    # (the watchdog names the call that uses it first), since a rank that never
    # gets here would hang the others.
    extension.begin_setup(_first_call(caller), name, members)
    during = f"the set-up of communicator {name} (its first use, by mpicoll.{caller})"
    try:
        for device in range(local_devices):
            faults._test_kill_at(f"dup{device}")
            dup = comm.Dup()
            dup.Set_name(f"mpicoll:{name}:device{device}")
            dup.Set_errhandler(MPI.ERRORS_RETURN)
            per_device.append(dup)
            if device == 0:
                # Every member makes the first duplicate; whether they make the
                # same number of others is settled on it, before they do.
                faults._test_kill_at("layout")
                here = _agree_on_layout(dup, comm, caller, local_devices, members, per_device)
            faults._test_kill_at("register")
            extension.register_comm(slot, device, dup.handle)
        extension.set_meetings_start_here(slot, here)
        _open_side_channel(comm)
    except (MPI.Exception, RuntimeError) as error:
        # A rank lost now is a lost rank like one lost in a collective: RankLost on
        # every survivor (each wakes: the communicators are revoked).  The key is
        # burnt, so that what was registered under it is never found again.
        if isinstance(error, faults.RankLost):
            raise
        lost = (faults.lost_in_setup(error, [comm, *per_device], during)
                if isinstance(error, MPI.Exception) else faults.as_rank_lost(error, during))
        if lost is None:
            raise
        _generations[index] += 1
        raise lost from None
    finally:
        extension.end_setup()
    _free_slots.pop()
    _generations[index] += 1
    info = CommInfo(slot=slot, size=comm.Get_size(), rank=comm.Get_rank(), name=name,
                    per_device=tuple(per_device))
    comm.Set_attr(_SLOT_KEYVAL, info)
    _slot_infos[slot] = info
    return info


_world_hosts = ()  # COMM_WORLD's ranks' hosts, once it has been set up


def _meetings_may_start_here(local_devices):
    """Whether this process's local meetings may start each device's turn on XLA's
    thread (csrc/meeting/meeting.cc): where it has two cores per local device
    (its affinity mask).  With fewer, a turn on XLA's thread costs more than the
    hop to the progress thread it saves (2 cores, 2 ranks x 2 devices: a jitted
    loop of 4 KiB psums over (RANKS, "dev") 47-79 us per psum with every turn on
    XLA's thread, 36-41 us on the progress threads), and the leaders' arrival
    barrier that the fast way needs is not paid.  MPICOLL_TEST_MEETING_HERE=1
    allows it whatever the cores (the soak tests of that way)."""
    if os.environ.get("MPICOLL_TEST_MEETING_HERE") == "1":
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return local_devices > 1 and cores >= 2 * local_devices


def _agree_on_layout(first, comm, caller, local_devices, members, made):
    """Raise on every member alike where their local device counts differ: each
    device talks on its own duplicate, so unequal counts could never match (one
    small allgather, once per communicator).  Else whether the communicator's
    local meetings start their turns on XLA's thread: where every member may
    (_meetings_may_start_here), so that the members agree."""
    global _world_hosts
    layouts = first.allgather((local_devices, MPI.Get_processor_name(),
                               _meetings_may_start_here(local_devices)))
    if MPI.Comm.Compare(comm, MPI.COMM_WORLD) == MPI.IDENT:
        _world_hosts = tuple(host for _, host, _ in layouts)
    counts = [count for count, _, _ in layouts]
    if len(set(counts)) == 1:
        return all(may for _, _, may in layouts)
    for dup in made:
        dup.Free()
    raise RuntimeError(f"mpicoll.{caller}: the ranks' layouts cannot match: "
                       f"{_device_counts(counts, members.split(','))}. Every rank of a "
                       "communicator needs the same number of local devices (each talks on "
                       "its own duplicate); give JAX the same devices on every rank "
                       "(XLA_FLAGS=--xla_force_host_platform_device_count=N, "
                       "CUDA_VISIBLE_DEVICES, topology.py's one GPU per rank)")


def _device_counts(counts, ranks):
    """[2, 1, 1], ["0", "1", "2"] -> 'rank 0 has 2 local devices, ranks 1,2 have 1'."""
    groups = {}
    for count, rank in zip(counts, ranks):
        groups.setdefault(count, []).append(rank)
    parts = []
    for index, (count, who) in enumerate(groups.items()):
        noun = "" if index else (" local device" if count == 1 else " local devices")
        parts.append(f"rank {who[0]} has {count}{noun}" if len(who) == 1
                     else f"ranks {','.join(who)} have {count}{noun}")
    return ", ".join(parts)


def _first_call(caller):
    """What a communicator's first use is for the watchdog: the collective and the
    user's line that calls it."""
    where = _compat.current_user_source_line(PACKAGE_DIR)  # mpicoll's own frames are skipped
    return f"{caller} (called at {where})" if where else caller



def _world_ranks(comm):
    """comm's members as COMM_WORLD ranks, "0,1,2" (what the flight records name)."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    return ",".join(str(r) for r in ranks)


_side_channel = None


def _open_side_channel(comm):
    """At COMM_WORLD's first use: the private duplicate on which the ranks'
    watchdogs ask each other what they are doing (csrc/watch/rank_state.h).
    With MPI_THREAD_MULTIPLE it was opened at import without blocking, and is
    open by now (every rank has passed COMM_WORLD's duplicates); in the
    serialized mode it is made here, collectively, like the duplicates."""
    global _side_channel
    if _side_channel is not None or MPI.Comm.Compare(comm, MPI.COMM_WORLD) != MPI.IDENT \
            or MPI.COMM_WORLD.Get_size() == 1:  # nobody to ask
        return
    if native.SERIALIZED:
        _side_channel = MPI.COMM_WORLD.Dup()
        _side_channel.Set_name("mpicoll:watchdog")
        _side_channel.Set_errhandler(MPI.ERRORS_RETURN)
        # Every rank's host, so that a report names the host of a rank that
        # cannot answer (its host is gone), and rank 0's pid (the job's folder).
        extension.set_world_processes(
            _side_channel.allgather((MPI.Get_processor_name(), os.getpid())))
        extension.set_side_channel(_side_channel.handle)
    else:
        for _ in range(60000):  # the watchdog completes it within a few of its ticks
            handle = extension.side_channel_handle()  # RuntimeError: a rank was lost first
            if handle is not None:
                break
            time.sleep(0.001)
        else:
            raise RuntimeError("mpicoll: the watchdogs' side channel did not open in 60 s")
        _side_channel = MPI.Comm.fromhandle(handle)
    # The timeline's clocks: measured where a trace may need them (a trace from
    # import, or one started in code on ranks of several hosts; one host's ranks
    # share its steady clock).
    if settings.current().trace or len(set(_world_hosts)) > 1:
        extension.set_clock_offset(_clock_offset(_side_channel))


_OFFSET_ROUNDS = 16


def _clock_offset(comm):
    """Rank 0's clock minus this rank's, in ns, for the timeline (ranks on different
    hosts have unrelated steady clocks).  Rank 0 pings each rank in turn; the
    round trip with the shortest time bounds the error to half of it (Cristian's
    method): a few microseconds on one host, tens over a network."""
    rank, size = comm.Get_rank(), comm.Get_size()
    offsets = [0] * size
    for peer in range(1, size):
        if rank == 0:
            best = None
            for _ in range(_OFFSET_ROUNDS):
                sent = extension.now_ns()
                comm.send(None, dest=peer, tag=7401)
                theirs = comm.recv(source=peer, tag=7402)
                back = extension.now_ns()
                if best is None or back - sent < best[0]:
                    best = (back - sent, (sent + back) // 2 - theirs)
            offsets[peer] = best[1]
        elif rank == peer:
            for _ in range(_OFFSET_ROUNDS):
                comm.recv(source=0, tag=7401)
                comm.send(extension.now_ns(), dest=0, tag=7402)
    return comm.scatter(offsets if rank == 0 else None, root=0)


def for_mesh_axes(comm, axes, caller):
    """comm's CommInfo, standing for the global mesh axes `axes` (check_vma types
    values over them); comm is mpicoll's own, made for those axes, and named after
    them: reports and flight records say "on mesh axes hosts,local"."""
    comm.Set_name("mesh axes " + ",".join(map(str, axes)))
    info = dataclasses.replace(resolve(comm, caller), mesh_axes=tuple(axes))
    _slot_infos[info.slot] = info
    return info


def _map_device_ordinals():
    """Tell the extension which local device index each of XLA's device ordinals is.

    A handler learns its device as XLA's ordinal; mpicoll's per-device
    duplicates are registered by position in jax.local_devices().  They agree
    in one process; after jax.distributed.initialize a CPU device's ordinal is
    its global id, so the map is set (once, before the first collective).
    """
    devices = jax.local_devices()
    pairs = [(d.local_hardware_id, index) for index, d in enumerate(devices)
             if getattr(d, "local_hardware_id", None) is not None]
    known = {ordinal for ordinal, _ in pairs}
    pairs += [(d.id, index) for index, d in enumerate(devices) if d.id not in known]
    if any(ordinal != index for ordinal, index in pairs):
        extension.set_device_ordinals(pairs)


def info_for_slot(slot):
    """The CommInfo of a registered slot (used by rules that run after binding)."""
    return _slot_infos[slot]

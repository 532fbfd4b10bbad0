"""jax.distributed brought up from MPI: no address, port or cluster variable given by hand.

    import mpicoll.distributed
    mpicoll.distributed.initialize()   # on every rank, before any JAX computation

Rank 0 of COMM_WORLD chooses the coordinator's address and a free port and
broadcasts them over MPI; the process id is the rank and the number of
processes the size of COMM_WORLD.  JAX's coordination service (no
authentication) listens on that address alone, not on every interface; on one
node gloo, JAX's CPU collectives, listens on loopback too (docs/security.md).  It works under any launcher MPI runs under
(mpiexec of MPICH or Open MPI, launch/mpirun.sh, srun, the simulated hosts),
since it asks MPI, not the launcher's variables.  Afterwards JAX's
multi-process API works (jax.devices() lists every process's devices,
multihost_utils.process_allgather, global arrays), and mpicoll's collectives
work beside it as before.  multihost_utils' process_allgather,
broadcast_one_to_all, sync_global_devices and assert_equal then run on MPI
through mpicoll (over_ranks/multihost.py), not on JAX's gloo.

Shutdown: `jax.distributed.shutdown()` runs at exit, before MPI is finalized,
after mpicoll's pending collectives; JAX bounds it by shutdown_timeout_seconds.
A job stuck there, or anywhere, still ends: an uncaught exception aborts every
rank (MPI_Abort, mpicoll's default with several ranks) and MPICOLL_TIMEOUT
bounds a collective.  SIGTERM does not end a process whose JAX runtime is
distributed: JAX catches it (preemption notice), so a launcher's or a test's
timeout must send SIGKILL (`timeout -s KILL`).
"""

import atexit
import os
import socket
import warnings

import jax
from mpi4py import MPI

from . import topology
from ._src import _compat
from ._src.primitive import device_order

_initialized = False


def is_initialized():
    """Whether mpicoll.distributed.initialize() has run in this process.

    Returns:
        True after initialize() returned, else False (also when JAX's runtime
        was brought up by jax.distributed.initialize directly).

    Example::

        if not mpicoll.distributed.is_initialized():
            mpicoll.distributed.initialize()
    """
    return _initialized


def initialize(*, coordinator_host=None, port=None, local_device_ids=None, **jax_arguments):
    """jax.distributed.initialize for every rank of MPI.COMM_WORLD, wired up over MPI.

    Call it on every rank, right after the imports and before any JAX
    computation, in place of jax.distributed.initialize().  Rank 0 picks the
    coordinator's address and a free port and broadcasts them over MPI; the
    process id is the rank and the number of processes COMM_WORLD's size, so
    it works under any launcher MPI runs under.  At exit
    jax.distributed.shutdown() runs after the pending work and before MPI is
    finalized.

    Args:
        coordinator_host: an address of rank 0's host that every rank reaches;
            default 127.0.0.1 when every rank is on one node, else the address
            rank 0's host name resolves to.  JAX's coordination service listens
            on it alone (coordinator_bind_address= in jax_arguments, or
            JAX_COORDINATOR_BIND_ADDRESS, chooses otherwise); with every rank
            on one node, gloo's listeners are on 127.0.0.1 too.
        port: the coordinator's port; default a free port rank 0 picks.
        local_device_ids: passed to JAX; "node-local-rank" gives each process
            the one device numbered by its rank on its node (one GPU per rank
            on a node whose every GPU is visible to every rank).
        jax_arguments: passed to jax.distributed.initialize (for example
            initialization_timeout, shutdown_timeout_seconds).
    Returns:
        None.  Afterwards JAX's multi-process API works on every rank
        (jax.devices() lists every process's devices, global arrays,
        multihost_utils), jax.lax collectives in shard_map bodies over axes
        that span processes run on mpicoll (docs/jax-vocabulary.md), and
        mpicoll's own collectives work beside it as before.
    Raises:
        RuntimeError: the same on every rank and before any MPI call, if it
            ran before, if jax.distributed was initialized otherwise, or if
            JAX has already started its backends (a computation ran: call it
            first); and on every rank if rank 0 finds no address the other
            nodes reach (pass coordinator_host=).
    Note:
        SIGTERM does not end a process whose JAX runtime is distributed (JAX
        takes it as a preemption notice): bound jobs with `timeout -s KILL`.
        Where the CPU devices asked for (XLA_FLAGS' host device count or
        jax_num_cpu_devices) are more than half the cores, and PJRT_NPROC is
        not set, it sets PJRT_NPROC to two per device: XLA's CPU pool then
        lets shard_map/pmap programs with a collective take JAX's C++ fast
        path (docs/settings.md).

    Example (any number of ranks)::

        import jax
        import mpicoll.distributed

        mpicoll.distributed.initialize()         # every rank, before any JAX computation
        print(jax.process_index(), jax.device_count())   # the rank; every process's devices
        mesh = jax.make_mesh((jax.device_count(),), ("i",))    # a global mesh
    """
    global _initialized
    if _initialized:
        raise RuntimeError("mpicoll.distributed.initialize: already called in this process")
    if jax.distributed.is_initialized():
        raise RuntimeError("mpicoll.distributed.initialize: jax.distributed is already "
                           "initialized (jax.distributed.initialize was called); call one "
                           "of them, once")
    if _compat.backends_initialized():
        raise RuntimeError("mpicoll.distributed.initialize: JAX has already started its "
                           "backends (a JAX computation or jax.devices() ran, or an mpicoll "
                           "collective); call initialize() first, right after the imports")
    device_order.size_xla_cpu_pool()  # before the backends start (checked above)
    where = topology.world()  # collective (the first time): on every rank
    if local_device_ids == "node-local-rank":
        local_device_ids = [where.local_rank]
    world = MPI.COMM_WORLD
    found = (_coordinator(coordinator_host, port, where.node_count) if world.Get_rank() == 0
             else None)
    address, bind_address, problem = world.bcast(found, root=0)
    if problem:
        raise RuntimeError(f"mpicoll.distributed.initialize: {problem}")
    # JAX's own CPU collectives (XLA's partitioner's) on mpicoll's MPI where every
    # rank can, else on gloo (over_ranks/jax_transport.py); before the backends start.
    from ._src.over_ranks import jax_transport
    transport, why = jax_transport.choose()
    # JAX's coordination service (no authentication) listens where its ranks
    # connect, not on every interface ([::], JAX's default); the user's own
    # choice (coordinator_bind_address=, JAX_COORDINATOR_BIND_ADDRESS) wins.
    if "coordinator_bind_address" not in jax_arguments and \
            not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        jax_arguments["coordinator_bind_address"] = bind_address
    jax.distributed.initialize(coordinator_address=address, num_processes=world.Get_size(),
                               process_id=world.Get_rank(), local_device_ids=local_device_ids,
                               **jax_arguments)
    _initialized = True
    from ._src import install
    install.on_first_use_of_ranks()  # jax.lax over global meshes on mpicoll's collectives
    if transport == "mpi":
        install.later("jax-collectives-on-mpi", "jax_cpu_collectives_implementation: \"mpi\", "
                      "through mpicoll's MPI ABI library (jaxlib's MPItrampoline)",
                      lambda: why)
    elif where.node_count == 1:
        install.later("gloo-on-loopback", "JAX's CPU backend factory: gloo's listeners on "
                      "127.0.0.1 (every rank on one node)", _bind_gloo_to_loopback)
    from ._src.over_ranks import (
        multihost)  # noqa: PLC0415 -- imports mpicoll's collectives
    install.later("multihost-on-mpi", "jax.experimental.multihost_utils: its collectives on "
                  "MPI through mpicoll, not JAX's gloo", multihost.install)
    # Registered after mpi4py's and mpicoll's exit handlers, so it runs before
    # them: pending work completes, JAX shuts down, then MPI is finalized.
    atexit.register(_shutdown)


def _bind_gloo_to_loopback():
    """A one-node job's gloo (JAX's CPU collectives) listens on loopback, not on the address
    the host's name resolves to (a warning where this JAX cannot be told)."""
    try:
        return _compat.bind_gloo_listeners("127.0.0.1")
    except RuntimeError as error:
        warnings.warn(f"mpicoll.distributed.initialize: gloo's listeners stay where JAX puts "
                      f"them (the address of this host's name), not on loopback: {error}",
                      RuntimeWarning, stacklevel=4)
        return f"not bound: {error}"


def _coordinator(host, port, node_count):
    """On rank 0: ("host:port" for the ranks, "address:port" to bind, None), or (None,
    None, what went wrong)."""
    try:
        if host is None:
            host = ("127.0.0.1" if node_count == 1
                    else socket.gethostbyname(socket.gethostname()))
            # 127.0.0.x and Debian's 127.0.1.1 (the machine's own name) are this
            # machine only; other loopback addresses can be hosts' own (hosts
            # simulated in namespaces on one loopback: launch/simcluster.py).
            if host.startswith(("127.0.0.", "127.0.1.")) and node_count > 1:
                return None, None, (f"rank 0's host name resolves to {host}, which the other "
                              "nodes cannot reach; pass coordinator_host=")
        # The numeric address the ranks reach it at: the one to listen on.
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port or 0, type=socket.SOCK_STREAM)[0]
        if port is None:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind(sockaddr[:2] if family == socket.AF_INET else sockaddr)
                port = probe.getsockname()[1]
    except OSError as error:
        return None, None, f"no coordinator address on rank 0 ({error}); pass coordinator_host="
    numeric = sockaddr[0] if family == socket.AF_INET else f"[{sockaddr[0]}]"
    return f"{host}:{port}", f"{numeric}:{port}", None


def _shutdown():
    jax.effects_barrier()  # mpicoll's and JAX's pending work first
    # JAX's shutdown waits for every process at a barrier: a rank still waiting
    # in a collective for this one would wait there too (and this rank in the
    # barrier) until MPICOLL_TIMEOUT.  Told first that this script has finished,
    # it ends the job at once with the report naming both.
    from ._src.observe import failures
    failures.announce_finished()
    jax.distributed.shutdown()

"""jax.experimental.multihost_utils after mpicoll.distributed.initialize(): on MPI
through mpicoll, with JAX's results and errors.

    mpiexec -n RANKS python tests/programs/multihost_utils.py LOCAL_DEVICES

Every call is made twice on the same inputs: as multihost_utils now has it
(mpicoll's, mpicoll/_src/over_ranks/multihost.py) and as JAX's own (gloo), whose result or
exception type and message is the reference; numpy says what the data is.
Prints "ALL OK (R ranks x L devices, multihost_utils)".
"""

import sys

from _common import fake_cpu_devices, report_and_exit

LOCAL = int(sys.argv[1])
fake_cpu_devices(LOCAL)

from mpi4py import MPI  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import mpicoll.distributed  # noqa: E402
from mpicoll._src.over_ranks import multihost  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
failures = []
mpicoll.distributed.initialize(initialization_timeout=60)
JAX_OWN = multihost._JAX_OWN


def outcome(call):
    """(leaves of the result, None) or (None, "Type: message")."""
    try:
        return [np.asarray(leaf) for leaf in jax.tree.leaves(call())], None
    except Exception as error:  # noqa: BLE001 -- compared with JAX's own
        return None, f"{type(error).__name__}: {error}"


def same(name, ours, theirs, expected=None):
    (got, error), (want, want_error) = outcome(ours), outcome(theirs)
    if error != want_error:
        failures.append(f"{name}: raised {error!r}, JAX's {want_error!r}")
        return
    if got is None:
        return
    for g, w in zip(got, want):
        if g.dtype != w.dtype or g.shape != w.shape or not np.array_equal(g, w):
            failures.append(f"{name}: {g.dtype}{g.shape} {g.tolist()} against JAX's "
                            f"{w.dtype}{w.shape} {w.tolist()}")
    if expected is not None and not np.array_equal(got[0], expected):
        failures.append(f"{name}: {got[0].tolist()} against numpy's {expected.tolist()}")


def check_installed():
    if multihost_utils.process_allgather is not multihost.process_allgather or \
            multihost_utils.broadcast_one_to_all is not multihost.broadcast_one_to_all:
        failures.append("multihost_utils is not mpicoll's after initialize()")


check_installed()
mine = np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * RANK
everyone = np.stack([np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r
                     for r in range(SIZE)])
gather = multihost_utils.process_allgather
for tiled in (False, True):
    same(f"process_allgather tiled={tiled}", lambda: gather(mine, tiled=tiled),
         lambda: JAX_OWN["process_allgather"](mine, tiled=tiled),
         everyone.reshape(-1, 3) if tiled else everyone)
    same(f"process_allgather of a scalar tiled={tiled}",
         lambda: gather(np.int32(RANK), tiled=tiled),
         lambda: JAX_OWN["process_allgather"](np.int32(RANK), tiled=tiled))
    same(f"process_allgather of a pytree tiled={tiled}",
         lambda: gather({"a": mine, "b": [np.array([RANK % 2 == 0])]}, tiled=tiled),
         lambda: JAX_OWN["process_allgather"]({"a": mine, "b": [np.array([RANK % 2 == 0])]},
                                              tiled=tiled))
same("process_allgather of float64 (JAX's dtype: float32)",
     lambda: gather(np.full(3, 0.5 + RANK)), lambda: JAX_OWN["process_allgather"](
         np.full(3, 0.5 + RANK)))

# Global arrays: every element on every process, from any sharding.
for shape, names, spec in [((SIZE * LOCAL,), ("x",), P("x")),
                           ((SIZE, LOCAL), ("p", "d"), P("p")),
                           ((SIZE, LOCAL), ("p", "d"), P("d", "p")),
                           ((SIZE * LOCAL,), ("x",), P())]:
    mesh = jax.make_mesh(shape, names)
    n = SIZE * LOCAL
    full = np.arange(n * 2 * n * 3, dtype=np.float32).reshape(n * 2, n * 3)
    sharding = NamedSharding(mesh, spec)
    array = jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])
    same(f"process_allgather of a global array {spec}", lambda: gather(array, tiled=True),
         lambda: JAX_OWN["process_allgather"](array, tiled=True), full)
    same(f"process_allgather of a global array {spec}, untiled (refused)",
         lambda: gather(array), lambda: JAX_OWN["process_allgather"](array))

spread = multihost_utils.broadcast_one_to_all
for source, name in ((None, "default source"), (RANK == SIZE - 1, "the last rank"),
                     (True, "every rank a source")):
    for value in (mine, np.int16(RANK + 3), np.array([RANK == 0, True])):
        same(f"broadcast_one_to_all from {name} of {np.asarray(value).dtype}",
             lambda: spread({"v": value}, is_source=source),
             lambda: JAX_OWN["broadcast_one_to_all"]({"v": value}, is_source=source))

# Built on the two above: a barrier, and a check that raises on every rank.


def with_jax_own(call):
    """call() with JAX's own process_allgather and broadcast_one_to_all in place."""
    for name, function in JAX_OWN.items():
        setattr(multihost_utils, name, function)
    try:
        return call()
    finally:
        multihost.install()


for name, call in [
        ("sync_global_devices", lambda: multihost_utils.sync_global_devices("step 1")),
        ("sync_global_devices, another name on rank 0 (raises on every rank)",
         lambda: multihost_utils.sync_global_devices(f"step {RANK == 0}")),
        ("assert_equal of the same data", lambda: multihost_utils.assert_equal(mine * 0)),
        ("assert_equal of different data (raises on every rank)",
         lambda: multihost_utils.assert_equal(mine, "differs"))]:
    same(name, lambda: [call()], lambda: [with_jax_own(call)])
# Under a mesh context (jax.set_mesh, as JAX's own multiprocess tests call them):
# mpicoll's host-data programs name their own device, whatever mesh is in context.
context = jax.make_mesh((SIZE, LOCAL), ("p", "d"))
with jax.set_mesh(context):
    same("process_allgather under jax.set_mesh", lambda: gather(mine),
         lambda: JAX_OWN["process_allgather"](mine), everyone)
    same("broadcast_one_to_all under jax.set_mesh", lambda: spread({"v": mine}),
         lambda: JAX_OWN["broadcast_one_to_all"]({"v": mine}))
    same("sync_global_devices under jax.set_mesh",
         lambda: [multihost_utils.sync_global_devices("in context")],
         lambda: [with_jax_own(lambda: multihost_utils.sync_global_devices("in context"))])
# axis_index_groups over a pmap of every process's devices: groups within
# each process, the same device of every process, and one group in reverse order;
# participant p holds p + 1.  numpy is the reference.
if LOCAL > 1:
    from jax import lax  # noqa: E402
    N = SIZE * LOCAL
    held = np.arange(RANK * LOCAL, (RANK + 1) * LOCAL, dtype=np.float32) + 1
    for groups in ([[r * LOCAL + k for k in range(LOCAL)] for r in range(SIZE)],
                   [[r * LOCAL + k for r in range(SIZE)] for k in range(LOCAL)],
                   [list(range(N))[::-1]]):
        group_of = {p: group for group in groups for p in group}
        summed = jax.pmap(lambda v: lax.psum(v, "i", axis_index_groups=groups),
                          axis_name="i")(held)
        rows = jax.pmap(lambda v: lax.all_gather(v, "i", axis_index_groups=groups),
                        axis_name="i")(held)
        for k in range(LOCAL):
            group = group_of[RANK * LOCAL + k]
            if float(summed[k]) != sum(p + 1 for p in group):
                failures.append(f"pmap psum in groups {groups}, device {k}: {summed[k]}")
            if np.asarray(rows[k]).tolist() != [float(p + 1) for p in group]:
                failures.append(f"pmap all_gather in groups {groups}, device {k}: "
                                f"{np.asarray(rows[k]).tolist()}")
check_installed()
report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices, multihost_utils)")

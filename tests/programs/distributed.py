"""mpicoll.distributed.initialize() under mpiexec: JAX's multi-process runtime brought up
from MPI, JAX's multi-process API and mpicoll's collectives beside it.

    mpiexec -n RANKS python tests/programs/distributed.py LOCAL_DEVICES

Checked against numpy: the process ids and device counts, process_allgather,
mpicoll's allreduce eagerly, under jit and over ranks x local devices (pmap),
psum on a global mesh over each process's devices and over all (100 calls in
flight), a global array refused by mpicoll's collectives eagerly and under jit, a second
initialize() refused.  And what the job listens on: every TCP
listener opened after MPI's own (those of MPI_Init, and the launcher's) is on
loopback where every rank is on one node (JAX's coordination service, gloo's),
and none on every interface otherwise.  Prints "ALL OK (R ranks x L devices)".
"""

import sys

from _common import fake_cpu_devices, listener_problems, listeners, report_and_exit

LOCAL = int(sys.argv[1])
fake_cpu_devices(LOCAL)

from mpi4py import MPI  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.distributed  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
failures = []
MPIS_OWN = set(listeners())  # MPI_Init's (its netmod) and the launcher's, inherited


def expect(name, ok, detail=""):
    """A failure unless ok; detail says what was seen instead."""
    if not ok:
        failures.append(f"{name}: {detail}")


mpicoll.distributed.initialize(initialization_timeout=60)
expect("initialized", mpicoll.distributed.is_initialized() and jax.distributed.is_initialized())
expect("process index", jax.process_index() == RANK, jax.process_index())
expect("process count", jax.process_count() == SIZE, jax.process_count())
expect("local devices", jax.local_device_count() == LOCAL, jax.local_device_count())
expect("global devices", len(jax.devices()) == SIZE * LOCAL, jax.devices())

# JAX's own multi-process API (its CPU collectives).
from jax.experimental import multihost_utils  # noqa: E402

mine = np.arange(3, dtype=np.float32) + 10 * RANK
gathered = np.asarray(multihost_utils.process_allgather(mine))
want = np.stack([np.arange(3, dtype=np.float32) + 10 * r for r in range(SIZE)])
expect("process_allgather", np.array_equal(gathered, want), gathered)

# mpicoll's collectives beside it: eager, jitted, and over ranks x local devices.
x = np.arange(4, dtype=np.float32) * (RANK + 1)
total = sum(np.arange(4, dtype=np.float32) * (r + 1) for r in range(SIZE))
expect("allreduce eager", np.array_equal(np.asarray(mpicoll.allreduce(x)), total))
expect("allreduce jit", np.array_equal(np.asarray(jax.jit(mpicoll.allreduce)(x)), total))
per_device = np.stack([x + k for k in range(LOCAL)])
out = jax.pmap(lambda v: mpicoll.allreduce(v, axis_name="d"), axis_name="d",
               devices=jax.local_devices())(per_device)
everyone = sum(np.arange(4, dtype=np.float32) * (r + 1) + k
               for r in range(SIZE) for k in range(LOCAL))
expect("allreduce ranks x devices", np.allclose(np.asarray(out), everyone), out)
gathered = np.asarray(mpicoll.allgather(jnp.asarray([RANK], jnp.int32)))
expect("allgather", np.array_equal(gathered, np.arange(SIZE)[:, None]), gathered)

# A global mesh: psum over the devices of each process and over all of them, 100
# calls dispatched without waiting.  Over the devices of one process XLA's own
# collective would be gloo's, which hangs here under such a loop, at any
# process count (one included); mpicoll's meeting runs it.
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((SIZE, LOCAL), ("proc", "dev"))
spec = P(("proc", "dev"))
rows = np.arange(LOCAL * 2, dtype=np.float32).reshape(LOCAL, 2) + 100 * RANK
array = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), rows)
loops = {axes: jax.jit(jax.shard_map(lambda v, axes=axes: jax.lax.psum(v, axes), mesh=mesh,
                                     in_specs=spec, out_specs=spec))
         for axes in (("dev",), ("proc", "dev"))}
everyone_rows = np.stack([np.arange(LOCAL * 2, dtype=np.float32).reshape(LOCAL, 2) + 100 * r
                          for r in range(SIZE)])
expected = {("dev",): np.broadcast_to(rows.sum(0), rows.shape),
            ("proc", "dev"): np.broadcast_to(everyone_rows.sum((0, 1)), rows.shape)}
for axes, program in loops.items():
    outs = [program(array) for _ in range(100)]
    for i, out in enumerate(outs):
        mine_out = np.concatenate([np.asarray(s.data) for s in sorted(
            out.addressable_shards, key=lambda s: s.device.id)])
        if not np.array_equal(mine_out, expected[axes]):
            expect(f"global mesh psum over {axes}, call {i}", False, mine_out)
            break

# A global array is refused by mpicoll's own collectives, eagerly and under jit alike,
# on every rank before any MPI call (under jit its mesh is abstract: a silent
# per-process result before), replicated or sharded over the processes.
# (At one rank every device is the process's own: that array is a local one.)
for spec_name, global_spec in (("replicated", P()), ("sharded", spec)) if SIZE > 1 else ():
    layout = NamedSharding(mesh, global_spec)
    local = rows if global_spec == spec else np.zeros((SIZE * LOCAL, 2), np.float32)
    global_array = jax.make_array_from_process_local_data(layout, local)
    for how, collective in (("eager", mpicoll.allreduce), ("jit", jax.jit(mpicoll.allreduce)),
                            ("jit allgather", jax.jit(mpicoll.allgather))):
        try:
            collective(global_array)
            expect(f"{spec_name} global array, {how}", False, "no error")
        except NotImplementedError as error:
            expect(f"{spec_name} global array, {how}",
                   "spans devices of other processes" in str(error), error)

# Every listener since MPI's own: JAX's coordination service (rank 0) and gloo's.
expect("a listener opened", RANK != 0 or set(listeners()) - MPIS_OWN, "rank 0 listens nowhere new")
failures.extend(listener_problems(MPIS_OWN))

try:
    mpicoll.distributed.initialize()
    expect("second initialize", False, "no error")
except RuntimeError as error:
    expect("second initialize", "already called" in str(error), error)

report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices)")

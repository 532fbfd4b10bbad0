"""One local device of one rank arrives late at the meeting, every step.

    mpiexec -n 2 python slow_device.py DEVICES SECONDS

In shard_map over mpicoll.mesh("dev"), the last device of the last rank
sleeps SECONDS (in a host callback) before each step's collectives: a small
allreduce (one MPI call by the leader), a large one (split: every device's
own MPI call on its own communicator) and an all_gather.  Meanwhile the
other devices wait inside the meeting or in MPI on different per-device
communicators, so the watchdog probes (from 0.5 s) see the ranks in one
collective on different local devices: no divergence or deadlock verdict may
end the job.  Results are checked against numpy; prints "SLOW DEVICE OK".
"""

import sys
import time

from _common import fake_cpu_devices

DEVICES, SECONDS = int(sys.argv[1]), float(sys.argv[2])
fake_cpu_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
N = SIZE * DEVICES
LATE = N - 1  # the participant that arrives late
BIG = 1 << 20  # float32 elements per device: 4 MiB, above local_combine_bytes(L): split


def nap(p):
    if int(p) == LATE:
        time.sleep(SECONDS)
    return p


def body(p, small, big):
    p = jax.pure_callback(nap, jax.ShapeDtypeStruct((), jnp.int32), p[0])
    small = small + p.astype(small.dtype) * 0  # after the nap
    return (jax.lax.psum(small, (mpicoll.RANKS, "dev"))[None],
            jax.lax.psum(big, (mpicoll.RANKS, "dev")),
            jax.lax.all_gather(small[0], (mpicoll.RANKS, "dev"))[None])


each = P((mpicoll.RANKS, "dev"))
step = jax.jit(jax.shard_map(body, mesh=mpicoll.mesh("dev"), in_specs=(each, each, each),
                             out_specs=(each, each, each)))
mine = np.arange(RANK * DEVICES, (RANK + 1) * DEVICES, dtype=np.int32)
small = (mine[:, None] + 1).astype(np.float32) * np.ones((DEVICES, 3), np.float32)
big = np.repeat((mine + 1).astype(np.float32), BIG)
failures = []
for round_ in range(3):
    summed, big_summed, gathered = (np.asarray(a) for a in step(mine, small, big))
    total = N * (N + 1) / 2
    if not np.all(summed == total):
        failures.append(f"round {round_}: small psum {summed.ravel()[:4]}, expected {total}")
    if not np.all(big_summed == total):
        failures.append(f"round {round_}: large psum, expected {total}")
    want = np.arange(1, N + 1, dtype=np.float32)
    if not all(np.array_equal(gathered[k, :, 0], want) for k in range(DEVICES)):
        failures.append(f"round {round_}: all_gather {gathered[0, :, 0]}")
failures = MPI.COMM_WORLD.allgather(failures)
if RANK == 0:
    bad = [f"rank {r}: {f}" for r, fs in enumerate(failures) for f in fs]
    print("\n".join(bad) if bad else f"SLOW DEVICE OK ({SIZE} ranks x {DEVICES} devices)",
          flush=True)
sys.exit(1 if any(failures) else 0)

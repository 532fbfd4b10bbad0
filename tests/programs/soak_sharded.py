"""Soak: data-parallel steps on arrays laid out over each process's devices.

    mpiexec -n RANKS python soak_sharded.py DEVICES STEPS [LARGEST_BYTES]

Each process's batch is split over its DEVICES devices (P("d")) and the
parameters are replicated (P()), in one jax.jit: XLA's partitioner inserts its
own all-reduces over the devices for the gradient (the mean over the sharded
batch, the MLP's partial sums), and mpicoll then sums the gradient pytree over
the ranks (leaves from 4 B to LARGEST_BYTES, default 4 MiB, each replicated
leaf split over the devices), allgathers the sharded batch scales and passes a
sharded array around the ranks' ring (sendrecv): XLA's collectives and
mpicoll's per-device calls in one program, the interleaving that could hang
with synchronous per-device calls (docs/design.md).  Each step is checked
against numpy on every rank's regenerated data.  Prints "SOAK SHARDED OK".
"""

import sys

from _common import fake_cpu_devices, report_and_exit, training_model

DEVICES, STEPS = int(sys.argv[1]), int(sys.argv[2])
LARGEST = int(sys.argv[3]) if len(sys.argv) > 3 else 4 << 20
fake_cpu_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
MESH = jax.make_mesh((DEVICES,), ("d",))
BATCH = 4 * DEVICES  # a power of two: means of integers stay exact

shapes, BASE, PARAMS = training_model(LARGEST)


def batch(rank, step):
    """Rank's batch at step: integer scales (exact sums) and MLP inputs."""
    scales = ((np.arange(BATCH) + rank + step) % 5).astype(np.float32)
    inputs = np.random.default_rng(1000 * step + rank).normal(size=(BATCH, 16))
    return scales, inputs.astype(np.float32)


def loss(params, scales, inputs):
    linear = sum(jnp.sum(params[name] * BASE[name]) for name in shapes) * jnp.mean(scales)
    hidden = jnp.tanh(inputs @ params["w1"] + params["b1"])
    return linear + jnp.mean((hidden @ params["w2"]) ** 2)


@jax.jit
def step_fn(params, scales, inputs):
    grads = jax.grad(loss)(params, scales, inputs)   # XLA sums over the devices
    grads = mpicoll.allreduce(grads)                  # mpicoll over the ranks
    everyone = mpicoll.allgather(scales)              # (SIZE, BATCH), P(None, "d")
    passed = mpicoll.sendrecv(inputs, source=(RANK - 1) % SIZE, dest=(RANK + 1) % SIZE)
    return grads, everyone, passed


alone = jax.jit(jax.grad(loss))  # one process's own gradient, on one device
failures = []
params = jax.device_put(PARAMS, NamedSharding(MESH, P()))
split = NamedSharding(MESH, P("d"))
for step in range(STEPS):
    scales, inputs = batch(RANK, step)
    grads, everyone, passed = step_fn(params, jax.device_put(scales, split),
                                      jax.device_put(inputs, split))
    every = [batch(r, step) for r in range(SIZE)]
    for name in shapes:
        want = BASE[name] * sum(float(np.mean(s)) for s, _ in every)
        if not np.array_equal(np.asarray(grads[name]), want):
            failures.append(f"step {step} grad {name}")
    if not np.array_equal(np.asarray(everyone), np.stack([s for s, _ in every])):
        failures.append(f"step {step} allgather")
    if not np.array_equal(np.asarray(passed), every[(RANK - 1) % SIZE][1]):
        failures.append(f"step {step} sendrecv")
    if step % 10 == 0 or step == STEPS - 1:
        own = [alone(PARAMS, s, x) for s, x in every]
        for name in ("w1", "b1", "w2"):  # the MLP
            want = np.sum([np.asarray(g[name]) for g in own], axis=0)
            if not np.allclose(np.asarray(grads[name]), want, rtol=2e-4, atol=2e-5):
                failures.append(f"step {step} grad {name}")
    if failures:
        break

report_and_exit(failures, f"({SIZE} ranks x {DEVICES} devices, {STEPS} steps, "
                f"leaves up to {LARGEST} B)", verdict="SOAK SHARDED OK")

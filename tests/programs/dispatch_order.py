"""Device-order dispatch across kinds of programs, run as `mpiexec -n R python dispatch_order.py`.

Each rank has 2 fake CPU devices and dispatches, in a Python loop, without
waiting, with rank-dependent local work so that the ranks' programs do not
finish in step:

1. before any jitted single-device program with a collective exists (so, in
   device-order mode, multi-device programs go without fences, or carry their
   token in the module where XLA's pool has two threads per device; with
   --single-first one runs before this phase, and they are fenced): pmap and
   shard_map programs over both devices, alternating with eager calls on
   device 0's communicator;
2. single-device programs on device 0 (several communicators, no data
   dependence between their collectives), the same multi-device programs (now
   fenced) and eager calls;

and at the end of each, 100 multi-device programs back to back (run ahead).
If a multi-device program overtook a pending single-device one on device 0 (or
the reverse), device 0's calls would pair up differently on different ranks:
wrong data or a hang (the watchdog and the launcher's timeout end it).  Every
result is checked against numpy.  Prints "ALL OK" when every check passes.
"""

import sys

from _common import fake_cpu_devices

fake_cpu_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
DEVICES = jax.local_devices()[:2]
MESH = Mesh(np.array(DEVICES), ("i",))
COMMS = [WORLD.Dup() for _ in range(3)]
STEPS = 15
mode = sys.argv[1] if len(sys.argv) > 1 else "device-order"
# --single-first: a jitted single-device program runs before anything else, so
# that in device order single-device programs carry their token in the module
# and multi-device ones are fenced from the start, whatever XLA's pool size.
SINGLE_FIRST = "--single-first" in sys.argv
mpicoll.set_dispatch(mode)
failures = []


def busy(x, step):
    """Local work on some ranks only (never changes x): the ranks drift apart."""
    if (step + RANK) % 2:
        return x
    big = jnp.sin(jnp.arange(2_000_000.0) * (step + 1))  # milliseconds
    return x + (jnp.sum(big * big) > 1e30).astype(x.dtype)


def single_device(x, step):
    a = mpicoll.allreduce(busy(x, step), comm=COMMS[0])
    b = mpicoll.bcast(x * 2, step % SIZE, comm=COMMS[1])
    c = mpicoll.allgather(x + 1, comm=COMMS[2])
    return a, b, c


single = {step: jax.jit(lambda x, s=step: single_device(x, s)) for step in range(2)}
# Device 0 of every multi-device program talks on COMMS[0] too: overtaking a
# pending single-device program would pair up the wrong calls.
pmapped = jax.pmap(lambda v: mpicoll.allreduce(v * 3, comm=COMMS[0]), axis_name="i",
                   devices=DEVICES)
sharded = jax.jit(jax.shard_map(lambda v: mpicoll.allgather(v, comm=COMMS[0])[None, :, 0],
                                mesh=MESH,
                                in_specs=P("i"), out_specs=P("i")))

base = np.arange(4.0)
others = [base + r for r in range(SIZE)]
results = []
# Run ahead: 100 multi-device programs dispatched back to back, none waited for,
# once without fences (phase 1) and once with them (the end).  XLA's CPU client
# makes a pool thread wait when a device holds 32 executions, and its pool is as
# small as the device count on 2 cores: without mpicoll's bound on programs in
# flight, the waiting threads starve the executions that would free them (a
# hang, seen at 2 x 2).  Every third call is over the devices in the other
# order: the last token's shards are regrouped for it (no copy, no wait).
RUN_AHEAD = 100
swapped = jax.pmap(lambda v: mpicoll.allreduce(v * 3, comm=COMMS[0]), axis_name="i",
                   devices=DEVICES[::-1])


def run_ahead(phase):
    pair = np.stack([base + RANK, base + RANK + 10])
    ahead = [(swapped if i % 3 == 2 else pmapped)(pair + i) for i in range(RUN_AHEAD)]
    for i, out in enumerate(ahead):
        stack = np.stack([o + i for o in others])
        expected = np.stack([stack.sum(0), (stack + 10).sum(0)]) * 3
        if not np.array_equal(np.asarray(out), expected):
            failures.append(f"run-ahead call {i} ({phase}): {np.asarray(out)} != {expected}")


if SINGLE_FIRST:
    first = single[0](jax.device_put(base + RANK, DEVICES[0]))
    results.append(("single", 0, first))

# Phase 1, before any jitted single-device program with a collective exists here:
# multi-device programs go without fences (device order), and eager calls on
# device 0's communicator must wait for them; on some ranks the pmap is slow,
# so an eager call that overtook it would pair with the wrong call.
slow_pmapped = jax.pmap(lambda v: mpicoll.allreduce(busy(v, RANK) * 3, comm=COMMS[0]),
                        axis_name="i", devices=DEVICES)
for step in range(STEPS // 3):
    x = jax.device_put(base + RANK + step, DEVICES[0])
    pair = np.stack([base + RANK + step, base + RANK + step + 10])
    results.append(("pmap", step, (slow_pmapped if (step + RANK) % 2 else pmapped)(pair)))
    results.append(("eager", step, mpicoll.allreduce(x, comm=COMMS[0])))
    results.append(("shard_map", step, sharded(pair)))
run_ahead("unfenced")
# Phase 2: the first single-device program below is lowered while those may still
# run (it waits for them), and from then on multi-device programs are fenced.
for step in range(STEPS):
    x = jax.device_put(base + RANK + step, DEVICES[0])
    results.append(("single", step, single[step % 2](x)))
    pair = np.stack([base + RANK + step, base + RANK + step + 10])
    results.append(("pmap", step, pmapped(pair)))
    if step % 5 == 4:  # eager calls wait for their result: not every step
        results.append(("eager", step, mpicoll.allreduce(x, comm=COMMS[0])))
    results.append(("shard_map", step, sharded(pair)))

run_ahead("fenced")

for kind, step, out in results:
    stack = np.stack([o + step for o in others])
    try:
        if kind == "single":
            a, b, c = (np.asarray(v) for v in out)
            np.testing.assert_array_equal(a, stack.sum(0))
            np.testing.assert_array_equal(b, stack[step % SIZE] * 2)
            np.testing.assert_array_equal(c, stack + 1)
        elif kind == "pmap":
            np.testing.assert_array_equal(np.asarray(out),
                                          np.stack([stack.sum(0), (stack + 10).sum(0)]) * 3)
        elif kind == "eager":
            np.testing.assert_array_equal(np.asarray(out), stack.sum(0))
        else:
            np.testing.assert_array_equal(np.asarray(out), np.stack([stack, stack + 10]))
    except AssertionError as error:
        failures.append(f"{kind} step {step}: {error}")

if failures:
    print("\n".join(failures))
    sys.exit(1)
# Which kind of program carried its token in the module (device order): the
# multi-device ones where XLA's pool has two threads per device (PJRT_NPROC=4).
chain = mpicoll._src.primitive.device_order._policy.in_module_multi_device()
print(f"ALL OK ({SIZE} ranks, {mode}{', multi-device in module' if chain else ''}"
      f"{', single-device first' if SINGLE_FIRST else ''})")

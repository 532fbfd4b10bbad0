"""Soak: realistic data-parallel steps over ranks x local devices, each checked.

    mpiexec -n RANKS python soak_devices.py DEVICES MODE STEPS [LARGEST_BYTES]

MODE: shard_map (over mpicoll.mesh("dev"), the lax vocabulary), pmap
(mpicoll's collectives with axis_name) or global (a global mesh after
mpicoll.distributed.initialize()).  Every step computes the gradients of a
model whose leaves run from 4 B to LARGEST_BYTES per device (default 4 MiB:
a scalar, vectors, matrices, a small tanh MLP), reduced over every device of
every rank, and runs an all_gather, a psum_scatter and a ppermute (pmap: an
alltoall) and a pmean of the loss beside it (pmap: XLA's own pmean over the
devices, then mpicoll's per-device allreduce over the ranks): every collective kind and size
in one program, the mix that hung before the meeting was asynchronous.  Each step's results are
compared with numpy on every participant's regenerated data (the linear
leaves exactly; the MLP's gradient against each participant's own gradient
computed alone, summed by numpy).  Prints "SOAK OK" on success, then the
meeting turns of the job ("turns: H on XLA's thread, O handed off, Q queued").

SOAK_JITTER=1 (shard_map, global): a participant that changes with the step
naps 0-3 ms (a host callback every collective of its step waits for) before
the collectives in one step of three, so its rank's meetings alternate between
turns that end on XLA's thread and turns handed to the progress thread past
the bound (csrc/meeting/meeting.cc), within one step and across steps.
"""

import os
import sys
import time

from _common import fake_cpu_devices, report_and_exit, training_model

DEVICES, MODE, STEPS = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
LARGEST = int(sys.argv[4]) if len(sys.argv) > 4 else 4 << 20
fake_cpu_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
import mpicoll.distributed  # noqa: E402
import mpicoll._src.runtime.native  # noqa: E402  (the meeting turns)

if MODE == "global":
    mpicoll.distributed.initialize()
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
L = DEVICES
N = SIZE * L  # participants, rank-major: p = rank * L + k

# Linear leaves, 4 B up to LARGEST per device: their gradient is exactly the data.
shapes, BASE, PARAMS = training_model(LARGEST)


def data(p, step):
    """Participant p's batch at `step`: integer-valued floats (sums are exact)."""
    scale = np.float32(p + 1 + step % 3)
    linear = {name: base * scale for name, base in BASE.items()}
    inputs = np.random.default_rng(1000 * step + p).normal(size=(4, 16)).astype(np.float32)
    return linear, inputs


def loss(params, linear, inputs):
    total = sum(jnp.sum(params[name] * linear[name]) for name in shapes)
    hidden = jnp.tanh(inputs @ params["w1"] + params["b1"])
    return total + jnp.mean((hidden @ params["w2"]) ** 2)


alone = jax.jit(jax.value_and_grad(loss))  # one participant's own, no collective


def extras(p, step):
    """The per-participant inputs of the other collectives."""
    return (np.array([p, step], np.float32),                       # all_gather
            (np.arange(3 * N, dtype=np.float32) + p * step),       # psum_scatter
            np.array([p * 10 + step], np.float32))                 # ppermute / alltoall row


def stacked(step):
    """This rank's L participants' inputs, stacked on a leading device axis."""
    rows = [data(RANK * L + k, step) for k in range(L)]
    linear = {name: np.stack([r[0][name] for r in rows]) for name in shapes}
    inputs = np.stack([r[1] for r in rows])
    more = [np.stack(parts) for parts in zip(*(extras(RANK * L + k, step) for k in range(L)))]
    return linear, inputs, more


JITTER = os.environ.get("SOAK_JITTER") == "1"


def nap(row):
    """SOAK_JITTER: participant p naps before the collectives of some steps."""
    p, step = int(row[0]), int(row[1])
    if step % 3 == 0 and p == step % N:
        time.sleep(0.001 * (step // 3 % 4))  # 0, 1, 2, 3 ms: around the bound (1 ms)
    return row


def body_lax(axes, params, linear, inputs, gathered, scattered, shifted):
    """One step in jax.lax's vocabulary over `axes` (every participant)."""
    linear = jax.tree.map(lambda a: a[0], linear)
    if JITTER:  # every collective below waits for the nap (x + 0 * nap)
        late = jax.pure_callback(nap, jax.ShapeDtypeStruct((2,), jnp.float32), gathered[0])
        linear = jax.tree.map(lambda a: a + 0 * late[0], linear)
        gathered, scattered, shifted = (a + 0 * late[0] for a in (gathered, scattered, shifted))
    value, grads = jax.value_and_grad(loss)(params, linear, inputs[0])
    mean = jax.lax.pmean(value, axes)
    everyone = jax.lax.all_gather(gathered[0], axes)
    mine = jax.lax.psum_scatter(scattered[0], axes, tiled=True)
    moved = jax.lax.ppermute(shifted[0], axes, [(p, (p + 1) % N) for p in range(N)])
    return mean, grads, everyone[None], mine[None], moved[None]


def body_pmap(params, linear, inputs, gathered, scattered, shifted):
    value, grads = jax.value_and_grad(loss)(params, linear, inputs)
    grads = jax.tree.map(lambda g: mpicoll.allreduce(g, axis_name="d"), grads)
    # As users write it: XLA's own pmean over the devices, then mpicoll's
    # per-device allreduce over the ranks, beside the meetings above.
    mean = mpicoll.allreduce(jax.lax.pmean(value, "d")) / SIZE
    everyone = mpicoll.allgather(gathered, axis_name="d")
    mine = mpicoll.reduce_scatter(scattered.reshape(N, 3), axis_name="d")
    # Each participant's row goes to every participant (alltoall of N copies).
    moved = mpicoll.alltoall(jnp.broadcast_to(shifted, (N, 1)), axis_name="d")
    return mean, grads, everyone, mine, moved


if MODE == "shard_map":
    mesh = mpicoll.mesh("dev")
    each = P((mpicoll.RANKS, "dev"))
    step_fn = jax.jit(jax.shard_map(
        lambda *a: body_lax((mpicoll.RANKS, "dev"), *a), mesh=mesh,
        in_specs=(P(), each, each, each, each, each), out_specs=(P(), P(), each, each, each)))
    place = lambda a: a  # noqa: E731
elif MODE == "global":
    mesh = jax.make_mesh((SIZE, L), ("proc", "dev"))
    each = P(("proc", "dev"))
    step_fn = jax.jit(jax.shard_map(
        lambda *a: body_lax(("proc", "dev"), *a), mesh=mesh,
        in_specs=(P(), each, each, each, each, each), out_specs=(P(), P(), each, each, each)))

    def place(a):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, each), a)
elif MODE == "pmap":
    step_fn = jax.pmap(body_pmap, axis_name="d", in_axes=(None, 0, 0, 0, 0, 0))
    place = lambda a: a  # noqa: E731
else:
    raise SystemExit(f"unknown mode {MODE!r}")


def local_rows(a):
    """This rank's L rows of a per-participant output."""
    if MODE == "global":
        return np.stack([np.asarray(s.data)[0] for s in
                         sorted(a.addressable_shards, key=lambda s: s.device.id)])
    return np.asarray(a)


failures = []
params = jax.tree.map(lambda a: a, PARAMS)
if MODE == "global":
    params = jax.device_put(params, NamedSharding(mesh, P()))
for step in range(STEPS):
    linear, inputs, more = stacked(step)
    args = [jax.tree.map(place, linear), place(inputs), *[place(m) for m in more]]
    mean, grads, everyone, mine, moved = step_fn(params, *args)
    grads = jax.tree.map(lambda g: np.asarray(g)[0] if MODE == "pmap" else
                         np.asarray(g.addressable_shards[0].data), grads)
    # numpy on every participant's regenerated data
    everyone_data = [data(p, step) for p in range(N)]
    for name in shapes:
        want = sum(d[0][name] for d in everyone_data)
        if not np.array_equal(grads[name], want):
            failures.append(f"step {step} grad {name}: max error "
                            f"{np.abs(grads[name] - want).max()}")
    if step % 10 == 0 or step == STEPS - 1:  # the MLP and the loss, each participant alone
        own = [alone(PARAMS, *d) for d in everyone_data]
        for name in ("w1", "b1", "w2"):  # the MLP
            want = np.sum([np.asarray(g[name]) for _, g in own], axis=0)
            if not np.allclose(grads[name], want, rtol=2e-4, atol=2e-5):
                failures.append(f"step {step} grad {name}")
        mean_here = np.asarray(mean).ravel()[0] if MODE != "global" else np.asarray(
            mean.addressable_shards[0].data).ravel()[0]
        if not np.allclose(mean_here, np.mean([float(v) for v, _ in own]), rtol=1e-5):
            failures.append(f"step {step} mean loss {mean_here}")
    rows = local_rows(everyone) if MODE != "pmap" else np.asarray(everyone)
    want_rows = np.array([extras(p, step)[0] for p in range(N)])
    if not all(np.array_equal(rows[k], want_rows) for k in range(L)):
        failures.append(f"step {step} all_gather")
    scattered_all = np.sum([extras(p, step)[1] for p in range(N)], axis=0).reshape(N, 3)
    mine_rows = local_rows(mine) if MODE != "pmap" else np.asarray(mine)
    if not np.array_equal(mine_rows.reshape(L, 3), scattered_all[RANK * L:(RANK + 1) * L]):
        failures.append(f"step {step} psum_scatter")
    moved_rows = local_rows(moved) if MODE != "pmap" else np.asarray(moved)
    if MODE == "pmap":  # alltoall: row q came from participant q
        want_moved = np.array([[q * 10 + step] for q in range(N)], np.float32)
        ok = all(np.array_equal(moved_rows[k], want_moved) for k in range(L))
    else:  # ppermute by +1: participant p has p - 1's row
        ok = all(moved_rows[k].ravel()[0] == ((RANK * L + k - 1) % N) * 10 + step
                 for k in range(L))
    if not ok:
        failures.append(f"step {step} ppermute/alltoall")
    if failures:
        break

turns = np.sum(MPI.COMM_WORLD.allgather(mpicoll._src.runtime.native.extension.meeting_turns()),
               axis=0)
if RANK == 0:
    print(f"turns: {turns[0]} on XLA's thread, {turns[1]} handed off, {turns[2]} queued",
          flush=True)
report_and_exit(failures, f"({SIZE} ranks x {L} devices, {MODE}, {STEPS} steps, "
                f"leaves up to {LARGEST} B)", verdict="SOAK OK")

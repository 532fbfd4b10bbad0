"""mpicoll across simulated hosts, for tests/test_multihost.py:

    launch/simcluster.py run --ranks-per-host 2,1,2 -- python multihost.py SECTION...

Sections (run in the order given):
  topology     every rank's mpicoll.topology() and cross_check, gathered to rank 0
  collectives  bcast, scatter, reduce, allreduce, gather, allgather, alltoall on
               several dtypes, sizes (one above MPI's eager limit, so TCP's
               rendezvous protocol runs between hosts), roots on other hosts,
               reduction ops, eager and jit; and barrier
  global       allreduce (its three paths: combine, small, split; max), allgather,
               alltoall and bcast with axis_name, in pmap and in shard_map, over
               LOCAL_DEVICES fake CPU devices per rank (set before jax starts)
  loop         prints `ready RANK PID HOST`, then jitted allreduces forever (the
               killed-host test ends it)

Every check runs the collective on every rank, then gathers each rank's input
and output to rank 0 with mpi4py, which compares them with numpy and prints
`check SECTION NAME ok` or `check SECTION NAME FAIL: why`; topology is printed as
`topology JSON`.  Rank 0 ends with `checks: N run, M failed`; the exit status is
1 if any failed.  Lines are single writes, so ranks' output never interleaves.
"""

import json
import os
import sys
import time

from _common import fake_cpu_devices, say

LOCAL_DEVICES = 2
if "global" in sys.argv[1:]:
    fake_cpu_devices(LOCAL_DEVICES)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
from mpicoll._src.ops import ranks_devices  # noqa: E402
from mpicoll._src.runtime import settings  # noqa: E402
from mpicoll import topology  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
checks, failures = [], []



def verdict(section, name, ok, why=""):
    """Rank 0 records and prints the verdict of one check."""
    checks.append(name)
    if ok:
        say(f"check {section} {name} ok")
    else:
        failures.append(name)
        say(f"check {section} {name} FAIL: {why}"[:2000])


def compare(section, name, inputs, outputs, expected_of):
    """Gather every rank's input and output; rank 0 checks output r == expected_of(inputs, r)."""
    all_in = WORLD.gather(np.asarray(inputs), root=0)
    all_out = WORLD.gather(np.asarray(outputs), root=0)
    if RANK != 0:
        return
    try:
        for r in range(SIZE):
            want = np.asarray(expected_of(np.stack(all_in), r))
            got = all_out[r]
            assert got.dtype == want.dtype, f"rank {r}: dtype {got.dtype}, expected {want.dtype}"
            assert got.shape == want.shape, f"rank {r}: shape {got.shape}, expected {want.shape}"
            if got.dtype == ml_dtypes.bfloat16:
                got, want = got.astype(np.float32), want.astype(np.float32)
            np.testing.assert_array_equal(got, want, err_msg=f"rank {r}")
        verdict(section, name, True)
    except AssertionError as error:
        verdict(section, name, False, " ".join(str(error).split()))


# ---------------------------------------------------------------------------

def section_topology():
    t = topology.topology()
    problems = topology.cross_check(t).problems
    reports = WORLD.gather(dict(t.__dict__, problems=list(problems),
                                gethostname=os.uname().nodename), root=0)
    if RANK == 0:
        say("topology " + json.dumps(reports))


def rank_input(shape, dtype, rank, op):
    """Rank `rank`'s data: exact under `op` in every dtype here (small integers, halves)."""
    rng = np.random.default_rng([rank, len(shape), int(np.prod(shape)), hash(op) % 1000])
    if op == "prod":
        values = rng.choice(np.array([-1.0, 1.0, 2.0]), shape)
    elif op == "bxor":
        values = rng.integers(0, 1 << 20, shape)
    else:  # sums of up to 6 ranks stay below 64: exact in bfloat16 (8 significant bits)
        values = rng.integers(-4, 5, shape) + rank + rng.integers(0, 2, shape) / 2
    if np.dtype(dtype).kind in "iu":
        values = np.floor(values)
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.integers(-3, 4, shape)
    return values.astype(dtype)


REDUCE = {"sum": np.sum, "prod": np.prod, "max": np.max,
          "bxor": lambda stack, axis: np.bitwise_xor.reduce(stack, axis=axis)}


def reduced(stack, op):
    """op over ranks, computed wide (float64/int64/complex128) and cast back."""
    kind = "f" if stack.dtype == ml_dtypes.bfloat16 else stack.dtype.kind
    wide = {"f": np.float64, "c": np.complex128, "i": np.int64, "u": np.uint64}[kind]
    return np.asarray(REDUCE[op](stack.astype(wide), axis=0)).astype(stack.dtype)


def run_collective(name, x, root, op, mode):
    calls = {
        "bcast": lambda v: mpicoll.bcast(v, root),
        "scatter": lambda v: mpicoll.scatter(v, root),
        "reduce": lambda v: mpicoll.reduce(v, op, root),
        "allreduce": lambda v: mpicoll.allreduce(v, op),
        "gather": lambda v: mpicoll.gather(v, root),
        "allgather": mpicoll.allgather,
        "alltoall": mpicoll.alltoall,
    }
    fn = jax.jit(calls[name]) if mode == "jit" else calls[name]
    return np.asarray(fn(jnp.asarray(x)))


def expectation(name, root, op):
    def of(stack, r):
        if name == "bcast":
            return stack[root]
        if name == "scatter":
            return stack[root][r]
        if name == "allreduce":
            return reduced(stack, op)
        if name == "reduce":
            return reduced(stack, op) if r == root else np.zeros_like(stack[0])
        if name == "gather":
            return stack if r == root else np.zeros_like(stack)
        if name == "allgather":
            return stack
        if name == "alltoall":
            return np.stack([stack[j][r] for j in range(SIZE)])
        raise ValueError(name)
    return of


LARGE = 1 << 18  # float32 elements: 1 MiB per rank, above every eager limit


def collective_cases():
    """(collective, dtype, elements, root, op, mode): every collective, every dtype family."""
    last = SIZE - 1  # on the last host
    cases = []
    for name in ("bcast", "scatter", "reduce", "allreduce", "gather", "allgather", "alltoall"):
        for dtype in (np.float32, np.int32, ml_dtypes.bfloat16, np.complex64, np.float64):
            cases.append((name, dtype, 5, last, "sum", "eager"))
        cases.append((name, np.float32, 5, 0, "sum", "jit"))
        cases.append((name, np.float32, LARGE, last, "sum", "jit"))
    for name in ("reduce", "allreduce"):
        cases += [(name, np.int32, 7, last, "max", "jit"), (name, np.float64, 7, 0, "prod", "jit"),
                  (name, np.int64, LARGE // 2, last, "bxor", "eager")]
    return cases


def section_collectives():
    for name, dtype, count, root, op, mode in collective_cases():
        shape = (SIZE, count) if name in ("scatter", "alltoall") else (count,)
        x = rank_input(shape, dtype, RANK, op)
        out = run_collective(name, x, root, op, mode)
        label = (f"{name}-{np.dtype(dtype).name}-{count}-root{root}-{op}-{mode}")
        compare("collectives", label, x, out, expectation(name, root, op))
    # barrier: nobody leaves before everybody has arrived (one machine, one clock).
    time.sleep(0.05 * (SIZE - 1 - RANK))  # arrive at different times, rank 0 last
    arrived = time.time()
    mpicoll.barrier()
    left = time.time()
    times = WORLD.gather((arrived, left), root=0)
    if RANK == 0:
        last_arrival = max(a for a, _ in times)
        early = [r for r, (_, l) in enumerate(times) if l < last_arrival]
        verdict("collectives", "barrier", not early,
                f"ranks {early} left the barrier before the last rank arrived")


# ---------------------------------------------------------------------------

def section_global():
    local = jax.local_device_count()
    assert local == LOCAL_DEVICES, (local, os.environ.get("XLA_FLAGS"))
    participants = SIZE * local
    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), ("d",))
    # float32 elements just above the split threshold (odd: the split pads)
    split = int(ranks_devices.split_allreduce_bytes(local)) // 4 + 3
    cases = {
        # the allreduce's three paths; "small" and "split" as with the combine off
        # (GPUs, mpicoll.overlap()), which tracing with LOCAL_COMBINE_BYTES = 0 gives
        "allreduce-sum-combine": (lambda v: mpicoll.allreduce(v, axis_name="d"), 6, np.float32,
                                  lambda s, p: s.sum(0)),
        "allreduce-sum-small": (lambda v: mpicoll.allreduce(v, axis_name="d"), 6, np.float32,
                                lambda s, p: s.sum(0)),
        "allreduce-sum-split": (lambda v: mpicoll.allreduce(v, axis_name="d"), split, np.float32,
                                lambda s, p: s.sum(0)),
        "allreduce-max": (lambda v: mpicoll.allreduce(v, "max", axis_name="d"), 6, np.int32,
                          lambda s, p: s.max(0)),
        "allgather": (lambda v: mpicoll.allgather(v, axis_name="d"), 4, np.float64,
                      lambda s, p: s),
        "alltoall": (lambda v: mpicoll.alltoall(v, axis_name="d"), (participants, 3), np.int64,
                     lambda s, p: s[:, p]),
        "bcast": (lambda v: mpicoll.bcast(v, participants - 1, axis_name="d"), 5, np.float32,
                  lambda s, p: s[-1]),
    }
    for name, (fn, shape, dtype, want) in cases.items():
        shape = shape if isinstance(shape, tuple) else (shape,)
        mine = np.stack([rank_input(shape, dtype, RANK * local + k, "sum") for k in range(local)])
        combine_off = name in ("allreduce-sum-small", "allreduce-sum-split")
        for how in ("pmap", "shard_map"):
            with settings.override(local_combine_bytes=0 if combine_off else None):
                if how == "pmap":
                    out = jax.pmap(fn, axis_name="d", devices=devices)(mine)
                else:
                    mapped = jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("d"),
                                           out_specs=P("d"), check_vma=False)
                    out = jax.jit(mapped)(jax.device_put(mine, jax.sharding.NamedSharding(
                        mesh, P("d"))))
            out = np.asarray(out)

            def expected_of(stack, r, want=want):
                every = stack.reshape((participants, *stack.shape[2:]))  # by participant
                return np.stack([np.asarray(want(every, r * local + k)).astype(every.dtype)
                                 for k in range(local)])
            compare("global", f"{how}-{name}", mine, out, expected_of)


def section_loop():
    say(f"ready {RANK} {os.getpid()} {os.uname().nodename}")
    step = jax.jit(lambda v: mpicoll.allreduce(v) / SIZE)
    x = jnp.ones(1024, jnp.float32)
    while True:
        x = step(x)
        x.block_until_ready()


SECTIONS = {"topology": section_topology, "collectives": section_collectives,
            "global": section_global, "loop": section_loop}

if __name__ == "__main__":
    for section in sys.argv[1:]:
        SECTIONS[section]()
    if RANK == 0:
        say(f"checks: {len(checks)} run, {len(failures)} failed")
    raise SystemExit(1 if WORLD.bcast(bool(failures), root=0) else 0)

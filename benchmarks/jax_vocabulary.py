"""JAX's own vocabulary across processes: a global-mesh psum on mpicoll vs JAX's gloo.

Run (2 ranks; --local 2 for two devices per process):

    mpiexec -n 2 python benchmarks/jax_vocabulary.py [--floor-lib PATH] [--local L]

The program, written once: a mesh over every process's devices
(jax.make_mesh((P * L,), ("x",))), a global array from
make_array_from_process_local_data, and inside jax.jit(jax.shard_map(...)) a
loop of --inner dependent `x = lax.psum(x, "x") * scale` (so a psum's time
excludes Python dispatch; one psum per call at 4 MiB).  Rows, per psum:

  mpicoll     after mpicoll.distributed.initialize(): the psum runs on MPI
  jax+gloo    after jax.distributed.initialize() with gloo (JAX's CPU default),
              in fresh child processes (benchmarks/jax_gloo.py)
  jit, XLA's psum  plain jit of `v * 0 + jnp.mean(v)` on the global array, after
              mpicoll.distributed.initialize(): the all-reduce (of the scalar
              mean, so 16 B only) that XLA's partitioner inserts, on JAX's own
              CPU collectives (gloo), not mpicoll's
  local psum  the same program over a mesh of this process's devices alone: the
              program's own cost without communication
  mpicoll.allreduce  mpicoll's own call in the same loop, on a plain local array
  MPI floor   C MPI_Allreduce of the same bytes (benchmarks/mpi_floor.c)

Targets: 16 B: mpicoll <= 1.5 x (local psum + MPI floor) and >= 50x
faster than gloo; 4 MiB: mpicoll <= 1.3 x mpicoll.allreduce.  Medians over
repeats, each repeat started together (barrier), the slowest rank's time,
block_until_ready() always; results checked against numpy.  Prints a table and
writes benchmarks/results/jax_vocabulary_<L>dev.json (docs/jax_vocabulary-<L>dev.json
is a copy, which the site's table is generated from).
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

import jax_gloo  # benchmarks/, next to this script
import timing

RESULTS = Path(__file__).resolve().parent / "results" / "jax_vocabulary.json"
SIZES = {"16 B": 4, "4 MiB": 1024 * 1024}  # float32 elements per device


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local", type=int, default=1, help="devices per process (default 1)")
    parser.add_argument("--inner", type=int, default=100,
                        help="dependent psums per call at 16 B (default 100)")
    parser.add_argument("--repeats", type=int, default=21, help="repeats (default 21)")
    parser.add_argument("--floor-lib", type=Path, default=None)
    parser.add_argument("--gloo-timeout", type=int, default=120,
                        help="seconds before the gloo phase is declared hung (default 120)")
    parser.add_argument("--output", type=Path, default=None)
    jax_gloo.add_worker_arguments(parser)
    return parser.parse_args()


def inner_for(label, args):
    return args.inner if label == "16 B" else 1


def psum_program(jax, mesh, inner, scale):
    """The one program: a loop of dependent psums over the mesh's axis "x"."""
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def body(x):
        return lax.fori_loop(0, inner, lambda i, v: lax.psum(v, "x") * scale, x)

    # check_vma=False: the carry stays one type (psum would make it invariant).
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                                 check_vma=False))


def global_programs(jax, args):
    """{size: (program, its input, psums per call)}: the global-mesh program; checked."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    participants = jax.device_count()
    mesh = jax.make_mesh((participants,), ("x",))
    out = {}
    for label, count in SIZES.items():
        inner = inner_for(label, args)
        local = np.ones((args.local * count,), np.float32)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
        program = psum_program(jax, mesh, inner, 1.0 / participants)
        for shard in program(x).addressable_shards:  # a mean of ones stays ones
            np.testing.assert_allclose(np.asarray(shard.data), 1.0, rtol=1e-5)
        out[label] = (program, x, inner)
    return out


def interleaved(calls, repeats, timer):
    """{name: seconds per psum, per repeat}: every call once per repeat, in turn
    (the order rotating from repeat to repeat), so that the machine's drift over
    the run and the effect of the call before fall on all of them alike; timed by
    timer (timing.Timer)."""
    times = {name: [] for name in calls}
    for fn, _ in calls.values():
        fn()  # warm-up
    names = list(calls)
    for repeat in range(repeats):
        turn = repeat % len(names)
        for name in names[turn:] + names[:turn]:
            fn, per_call = calls[name]
            times[name].append(timer.time_call(fn)[1] / per_call)
    return times


def gloo_worker(args):
    jax = jax_gloo.initialize(args)
    times = {}
    for label, (program, x, inner) in global_programs(jax, args).items():
        # No barrier; each worker's own times (the driver takes the slowest of them).
        times[label] = interleaved({"psum": (lambda: program(x).block_until_ready(), inner)},
                                   args.repeats, timing.Timer(lambda: None, lambda t: t))["psum"]
    jax_gloo.emit(dict(times=times, jax=jax.__version__))
    jax_gloo.shutdown()


def median_us(times):
    return float(np.median(times)) * 1e6


def main():
    args = parse_args()
    if args.gloo_worker:
        return gloo_worker(args)
    load_start = os.getloadavg()[0]
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    # 1. gloo, in child processes (before this process's JAX starts).
    reports, gloo_error = jax_gloo.run_workers(comm, __file__, [
        "--inner", args.inner, "--repeats", args.repeats], args.local,
        timeout=args.gloo_timeout, set_device_count=True, quiet=True)
    # 2. mpicoll: this process joins its own JAX job.
    if args.local > 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.local}")
    import jax
    from jax.sharding import Mesh, PartitionSpec as P

    import mpicoll
    import mpicoll.distributed
    from mpi_floor import load_floor
    mpicoll.distributed.initialize()

    timer = timing.mpi_timer(comm)
    local_mesh = Mesh(np.array(jax.local_devices()), ("x",))
    floor, floor_note = load_floor(args.floor_lib, comm)
    rows = {}
    for label, (program, x, inner) in global_programs(jax, args).items():
        count = SIZES[label]
        local_x = jax.device_put(np.ones((args.local * count,), np.float32),
                                 jax.sharding.NamedSharding(local_mesh, P("x")))
        local_program = psum_program(jax, local_mesh, inner, 1.0)
        # The partitioner's own all-reduce (plain jit on the global array): JAX's.
        partitioned = jax.jit(lambda v, inner=inner: jax.lax.fori_loop(
            0, inner, lambda i, v: v * 0 + jax.numpy.mean(v), v))
        y = jax.numpy.ones((count,), np.float32)
        loop = jax.jit(lambda v: jax.lax.fori_loop(
            0, inner, lambda i, v: mpicoll.allreduce(v) * (1.0 / comm.Get_size()), v))
        np.testing.assert_allclose(np.asarray(loop(y)), 1.0, rtol=1e-5)
        calls = {
            "mpicoll": (lambda: program(x).block_until_ready(), inner),

            "local psum": (lambda: local_program(local_x).block_until_ready(), inner),
            "mpicoll.allreduce": (lambda: loop(y).block_until_ready(), inner)}
        if floor is not None:
            a, b = np.ones(count, np.float32), np.empty(count, np.float32)
            calls["MPI floor"] = (lambda: floor.call("allreduce", a, b, count, inner), inner)
        for name, times in interleaved(calls, args.repeats, timer).items():
            rows.setdefault(name, {})[label] = times
        if label == "16 B":  # the scalar mean's all-reduce, whatever the size
            xla_psum = (partitioned, x, inner)
    # Last and alone: once XLA's CPU collectives (gloo) have run in this process,
    # their threads slowed every MPI row here 3-4x when interleaved with them.
    partitioned, x, inner = xla_psum
    rows["jit, XLA's psum"] = {"16 B": interleaved(
        {"psum": (lambda: partitioned(x).block_until_ready(), inner)}, args.repeats,
        timer)["psum"]}
    if rank != 0:
        return
    if reports is not None:
        rows["jax+gloo"] = {label: jax_gloo.slowest_times([r["times"][label] for r in reports])
                            for label in SIZES}
    medians = {row: {label: median_us(t) for label, t in sizes.items()}
               for row, sizes in rows.items() if sizes}
    print(f"global-mesh psum, {comm.Get_size()} processes x {args.local} device(s), "
          f"jax {jax.__version__}, {platform.node()}: us per psum (median of {args.repeats})")
    order = ["mpicoll", "jax+gloo", "jit, XLA's psum", "local psum", "mpicoll.allreduce",
             "MPI floor"]
    print(f"{'':20}" + "".join(f"{label:>14}" for label in SIZES))
    for row in order:
        if row in medians:
            print(f"{row:20}" + "".join(f"{medians[row][label]:14.2f}" if label in medians[row]
                                        else f"{'':14}" for label in SIZES))
    if "jax+gloo" not in medians:
        print(f"jax+gloo: no result ({(gloo_error or '').splitlines()[0] if gloo_error else ''})")
    checks = {}
    m = medians["mpicoll"]
    if "MPI floor" in medians:
        bound = medians["local psum"]["16 B"] + medians["MPI floor"]["16 B"]
        checks["16 B: mpicoll / (local psum + MPI floor)"] = (m["16 B"] / bound, 1.5)
    if "jax+gloo" in medians:
        checks["16 B: jax+gloo / mpicoll"] = (medians["jax+gloo"]["16 B"] / m["16 B"], 50)
    checks["4 MiB: mpicoll / mpicoll.allreduce"] = (
        m["4 MiB"] / medians["mpicoll.allreduce"]["4 MiB"], 1.3)
    if args.local > 1:
        print("(the targets are set for one device per process; with several, every psum "
              "meets the local devices in mpicoll's handler)")
        checks = {}
    for name, (value, target) in checks.items():
        met = value >= target if "gloo" in name else value <= target
        print(f"{name}: {value:.2f} (target {'>=' if 'gloo' in name else '<='} {target}: "
              f"{'met' if met else 'NOT met'})")
    output = args.output or RESULTS.with_name(f"jax_vocabulary_{args.local}dev.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(dict(
        processes=comm.Get_size(), local_devices=args.local, jax=jax.__version__,
        mpi=MPI.Get_library_version().splitlines()[0], host=platform.node(),
        when=time.strftime("%Y-%m-%d %H:%M"), cores=os.cpu_count(), repeats=args.repeats,
        inner=args.inner, load_average=[load_start, os.getloadavg()[0]],
        floor=floor_note if floor is None else "",
        gloo_error=gloo_error, medians_us=medians,
        checks={k: dict(value=v, target=t) for k, (v, t) in checks.items()}), indent=1))
    print(f"wrote {output}")


if __name__ == "__main__":
    sys.exit(main())

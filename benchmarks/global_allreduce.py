"""Global allreduce over ranks x local devices: mpicoll vs the naive composition vs JAX+gloo.

Run (one command, 2 ranks with 2 fake CPU devices each = 4 participants):

    mpiexec -n 2 python benchmarks/global_allreduce.py

Ways to sum an array over all size * L participants, each inside one
jax.jit(jax.shard_map(...)) (check_vma=False), from 4 B to 64 MiB per device:

  mpicoll global  mpicoll.allreduce(x, axis_name='d') over the local mesh: up to
                  LOCAL_COMBINE_BYTES the device threads combine their data in
                  mpicoll's handler and one of them calls MPI; above it, psum
                  over the local devices, then MPI across ranks (above 256 KiB
                  split: psum_scatter, MPI allreduce of 1/L per device, all_gather)
  global via lax  the same call traced with LOCAL_COMBINE_BYTES = 0: the lax
                  composition at every size (the threshold's reference)
  per-device MPI  mpicoll.allreduce(x) without axis_name: each device's MPI
                  allreduce across ranks alone, the MPI half of the global op
                  (the target: global <= 1.3x this at 4 KiB)
  naive           lax.psum(x, 'd') then mpicoll.allreduce(...) without axis_name:
                  every device allreduces the whole array across ranks
  jax+gloo        JAX's own multi-process runtime: jax.distributed.initialize +
                  jax_cpu_collectives_implementation='gloo', lax.psum over a global
                  4-device mesh.  jax.distributed changes the process, so this phase
                  runs in fresh child processes (one per rank, spawned by each rank
                  of this run, rank 0 broadcasting a free coordinator port over MPI).

Timing: warm-up first, then the median over repeats (>= 20 at 4 KiB, >= 5 at
64 MiB), each repeat started together on every rank (barrier) and taken as the
slowest rank's time, always with block_until_ready().  At 4 KiB one timed call
runs a loop of --inner dependent allreduces inside jit (x <- allreduce(x) / P),
so the time per allreduce excludes Python dispatch; a one-allreduce-per-call
row is measured too.  Every method's result is checked against numpy.

Prints a table and writes benchmarks/results/global_allreduce.json.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import numpy as np  # noqa: E402

import jax_gloo  # noqa: E402  (benchmarks/, next to this script)
import timing  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "global_allreduce.json"
KIB, MIB = 1024, 1024 * 1024


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[4, 4 * KIB, 64 * KIB, 256 * KIB, 64 * MIB],
                        help="bytes per device (float32), default 4 B, 4, 64, 256 KiB, 64 MiB")
    parser.add_argument("--small-repeats", type=int, default=30,
                        help="repeats for sizes <= 1 MiB (default 30)")
    parser.add_argument("--large-repeats", type=int, default=10,
                        help="repeats for sizes > 1 MiB (default 10)")
    parser.add_argument("--inner", type=int, default=100,
                        help="dependent allreduces per jit call for sizes <= 1 MiB (default 100)")
    parser.add_argument("--combine-bytes", type=int, default=None,
                        help="LOCAL_COMBINE_BYTES for 'mpicoll global' (default: mpicoll's), "
                             "to measure the threshold")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--skip-gloo", action="store_true", help="leave out the jax+gloo phase")
    jax_gloo.add_worker_arguments(parser)  # the gloo phase's child processes (internal)
    return parser.parse_args()


def plan(args):
    """(bytes per device, inner loop length, repeats) for every size."""
    return [(nbytes, args.inner if nbytes <= MIB else 1,
             args.small_repeats if nbytes <= MIB else args.large_repeats)
            for nbytes in args.sizes]


def participant_data(p, count):
    """Participant p's input: (p + 1) + j % 7 for element j (sums are exact in float32)."""
    return (np.float32(p + 1) + (np.arange(count) % 7).astype(np.float32))


def expected(participants, count):
    """After any number >= 1 of x <- sum(x) / participants steps."""
    total = sum(range(1, participants + 1)) + participants * (np.arange(count) % 7)
    return (total / participants).astype(np.float32)


def looped(step, inner, participants):
    """jit-able body: `inner` dependent steps x <- step(x) / participants."""
    import jax
    scale = np.float32(1.0 / participants)
    if inner == 1:
        return lambda x: step(x) * scale
    return lambda x: jax.lax.fori_loop(0, inner, lambda i, v: step(v) * scale, x)


# ---------------------------------------------------------------------------
# Phase 2: JAX's multi-process runtime with gloo (child processes).

def gloo_worker(args):
    jax = jax_gloo.initialize(args)
    from jax import lax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    local = jax.local_device_count()
    participants = jax.device_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    results = []
    for nbytes, inner, repeats in plan(args):
        count = nbytes // 4
        first = args.process_id * local
        data = np.concatenate([participant_data(p, count) for p in range(first, first + local)])
        x = jax.make_array_from_process_local_data(sharding, data)
        for inner_now in sorted({inner, 1}, reverse=True):
            fn = jax.jit(jax.shard_map(looped(lambda v: lax.psum(v, "d"), inner_now, participants),
                                       mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                       check_vma=False))
            out = fn(x).block_until_ready()
            want = expected(participants, count)
            ok = all(np.array_equal(np.asarray(s.data), want) for s in out.addressable_shards)
            del out
            # Each worker's own times (the driver takes the slowest, jax_gloo.slowest_times).
            timer = timing.Timer(lambda: multihost_utils.sync_global_devices("t"), lambda t: t)
            times = timer.repeated(lambda: fn(x).block_until_ready(), repeats)
            results.append(dict(bytes=nbytes, inner=inner_now, times=times, ok=ok))
    multihost_utils.sync_global_devices("done")
    jax_gloo.emit(dict(local_devices=local, participants=participants, jax=jax.__version__,
                       results=results))
    jax_gloo.shutdown()


def run_gloo_phase(args, comm, local_devices):
    """Each rank starts one gloo worker; returns rank 0's view: {(bytes, inner): times}."""
    worker_args = ["--sizes", *args.sizes, "--small-repeats", args.small_repeats,
                   "--large-repeats", args.large_repeats, "--inner", args.inner]
    reports, _ = jax_gloo.run_workers(comm, __file__, worker_args, local_devices)
    if reports is None:
        return None
    merged = {}
    for entries in zip(*(r["results"] for r in reports)):
        key = (entries[0]["bytes"], entries[0]["inner"])
        merged[key] = dict(times=jax_gloo.slowest_times([e["times"] for e in entries]),
                           ok=all(e["ok"] for e in entries))
    return dict(merged=merged, jax=reports[0]["jax"], participants=reports[0]["participants"])


# ---------------------------------------------------------------------------
# Phase 1: mpicoll under this mpiexec.

def run_mpicoll_phase(args, comm):
    import jax
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import mpicoll
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    local = jax.local_device_count()
    participants = size * local
    mesh = jax.make_mesh((local,), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    # name -> (step, LOCAL_COMBINE_BYTES while tracing (None: the default), scale, want)
    mean_over_ranks = np.mean([[participant_data(r * local + k, 1) for k in range(local)]
                               for r in range(size)], axis=0)  # shape (local, 1): per device
    methods = {
        "mpicoll global": (lambda v: mpicoll.allreduce(v, axis_name="d"), args.combine_bytes),
        # Today's composition forced at every size: lax psum over the local
        # devices, then MPI (the reference for the handler's local combine).
        "global via lax": (lambda v: mpicoll.allreduce(v, axis_name="d"), 0),
        "naive psum+MPI": (lambda v: mpicoll.allreduce(lax.psum(v, "d")), None),
        # The MPI half alone: each device allreduces its own x across ranks.
        "per-device MPI": (lambda v: mpicoll.allreduce(v), None),
    }
    results = {}
    for nbytes, inner, repeats in plan(args):
        count = max(1, nbytes // 4)
        data = np.concatenate([participant_data(p, count)
                               for p in range(rank * local, (rank + 1) * local)])
        x = jax.device_put(data, sharding)
        for inner_now in sorted({inner, 1}, reverse=True):
            for name, (step, combine_bytes) in methods.items():
                per_device = name == "per-device MPI"
                # x <- allreduce(x) / (number summed): the same value after every step.
                summed = size if per_device else participants
                want = (np.broadcast_to(np.float32(mean_over_ranks) +
                                        (np.arange(count) % 7).astype(np.float32), (local, count))
                        if per_device else np.broadcast_to(expected(participants, count),
                                                           (local, count)))
                fn = jax.jit(jax.shard_map(looped(step, inner_now, summed), mesh=mesh,
                                           in_specs=P("d"), out_specs=P("d"), check_vma=False))
                with mpicoll._src.runtime.settings.override(local_combine_bytes=combine_bytes):
                    out = fn(x).block_until_ready()  # traces with the setting above
                got = np.asarray(out).reshape(local, count)
                ok = bool(np.allclose(got, want, rtol=1e-6))
                del out
                times = timing.mpi_timer(comm).repeated(lambda: fn(x).block_until_ready(),
                                                        repeats)
                results[(nbytes, inner_now, name)] = dict(
                    times=times, ok=comm.allreduce(ok, op=MPI.LAND))
        del x
    info = dict(ranks=size, local_devices=local, participants=participants,
                jax=jax.__version__, mpi=MPI.Get_library_version().splitlines()[0].strip(),
                split_allreduce_bytes=mpicoll._src.runtime.settings.current().split_allreduce_bytes,
                local_combine_bytes=(mpicoll._src.runtime.settings.current().local_combine_bytes
                                     if args.combine_bytes is None else args.combine_bytes))
    return results, info


def human(nbytes):
    if nbytes >= MIB:
        return f"{nbytes // MIB} MiB"
    return f"{nbytes // KIB} KiB" if nbytes >= KIB else f"{nbytes} B"


def fmt_time(seconds):
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} us"
    return f"{seconds * 1e3:8.2f} ms"


def main():
    args = parse_args()
    if args.gloo_worker:
        return gloo_worker(args)

    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    started, load_before = time.time(), os.getloadavg()
    mpicoll_results, info = run_mpicoll_phase(args, comm)
    gloo = None if args.skip_gloo else run_gloo_phase(args, comm, info["local_devices"])
    if comm.Get_rank() != 0:
        return 0

    rows, all_ok = [], True
    if gloo is None and not args.skip_gloo:
        all_ok = False  # the worker's output is on stderr; the table leaves gloo out
    names = ("mpicoll global", "global via lax", "naive psum+MPI", "per-device MPI")
    header = (f"{'bytes/device':>12} {'per call':>8} | "
              + " ".join(f"{n:>14}" for n in names) + f" {'jax+gloo':>11} | "
              f"{'global/per-device':>17} {'via lax/global':>14} {'gloo/global':>11}")
    lines = [f"global allreduce (sum, float32) over {info['ranks']} ranks x "
             f"{info['local_devices']} devices = {info['participants']} participants; "
             f"time per allreduce, median over repeats (slowest rank); the handler combines "
             f"the local devices up to {info['local_combine_bytes']} B per device",
             header, "-" * len(header)]
    for nbytes, inner, repeats in plan(args):
        for inner_now in sorted({inner, 1}, reverse=True):
            entry = dict(bytes_per_device=nbytes, elements_per_device=max(1, nbytes // 4),
                         allreduces_per_call=inner_now, repeats=repeats, methods={})
            medians = {}
            for name in names:
                r = mpicoll_results[(nbytes, inner_now, name)]
                medians[name] = float(np.median(r["times"])) / inner_now
                entry["methods"][name] = dict(median_s_per_allreduce=medians[name],
                                              call_times_s=r["times"], correct=r["ok"])
                all_ok &= r["ok"]
            if gloo is not None:
                r = gloo["merged"][(nbytes, inner_now)]
                medians["jax+gloo"] = float(np.median(r["times"])) / inner_now
                entry["methods"]["jax+gloo"] = dict(median_s_per_allreduce=medians["jax+gloo"],
                                                    call_times_s=r["times"], correct=r["ok"])
                all_ok &= r["ok"]
            g = medians["mpicoll global"]
            entry["global_over_per_device"] = g / medians["per-device MPI"]
            entry["via_lax_over_global"] = medians["global via lax"] / g
            entry["naive_over_global"] = medians["naive psum+MPI"] / g
            entry["gloo_over_global"] = medians["jax+gloo"] / g if gloo else None
            rows.append(entry)
            gloo_cell = fmt_time(medians["jax+gloo"]) if gloo else f"{'-':>11}"
            gloo_ratio = f"{entry['gloo_over_global']:10.2f}x" if gloo else f"{'-':>11}"
            lines.append(f"{human(nbytes):>12} {inner_now:>8} | "
                         + " ".join(f"{fmt_time(medians[n]):>14}" for n in names)
                         + f" {gloo_cell:>11} | {entry['global_over_per_device']:16.2f}x "
                         f"{entry['via_lax_over_global']:13.2f}x {gloo_ratio}")
    lines.append("global/per-device: the global op over the MPI half alone (target: <= 1.3 "
                 "at 4 KiB).  via lax/global, gloo/global > 1: mpicoll global is faster.  "
                 "all results correct: " + ("yes" if all_ok else "NO")
                 + ".  load average before/after: "
                 f"{load_before[0]:.2f}/{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("\n".join(lines), flush=True)

    report = dict(benchmark="global allreduce", dtype="float32", op="sum",
                  command=" ".join(["mpiexec", "-n", str(info["ranks"]), "python"] + sys.argv),
                  xla_flags=os.environ.get("XLA_FLAGS", ""), cores=os.cpu_count(),
                  machine=platform.machine(), python=platform.python_version(), **info,
                  gloo_jax=gloo["jax"] if gloo else None, all_correct=all_ok,
                  wall_time_s=time.time() - started,
                  load_average_1_5_15min=dict(before=load_before, after=os.getloadavg()),
                  results=rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

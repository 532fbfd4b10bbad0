"""Collectives over a global mesh's process and device axes at once: L devices per
process against one, against JAX's gloo, and against the C MPI floor.

    mpiexec -n P python benchmarks/global_mesh_collectives.py --local L
        [--mib 4] [--small 16] [--floor-lib PATH] [--no-gloo]

A mesh ("hosts", "local") of P x L devices, the same bytes per process at every
L (--small bytes, rounded up to the least the collectives allow: one element
per participant and device, and --mib MiB), and inside
jax.jit(jax.shard_map(...)) a fori_loop of --inner dependent calls of each
jax.lax collective over ("hosts", "local"): all_gather (tiled, its first block
kept), psum_scatter (tiled, its block repeated), all_to_all, ppermute (a ring
over the P*L participants), pbroadcast and psum.  Three implementations:

  mpicoll    after mpicoll.distributed.initialize(): the devices of a process
             meet in mpicoll's handler and one MPI collective moves their data
  gloo       after jax.distributed.initialize() with JAX's CPU collectives
             (gloo), in fresh child processes (benchmarks/jax_gloo.py)
  MPI floor  the direct C MPI collective over the P processes moving the same
             bytes per process (benchmarks/mpi_floor.c): MPI_Allgather,
             MPI_Reduce_scatter_block, MPI_Alltoall, MPI_Sendrecv (a ring),
             MPI_Bcast, MPI_Allreduce

and the cost of one call (200 dispatches of a 16 B psum over "hosts" alone, of
a body with no collective, and at L > 1 of a psum over "local" alone).  Medians
over repeats, each started together (a barrier), the slowest rank,
block_until_ready() always; every result checked against numpy once.  Prints
a table and merges the run into benchmarks/results/global_mesh_collectives_<P>proc.json
(one entry per L; the docs' tables read a copy, docs/global_mesh-<P>proc.json).
`make bench` runs L = 1, 2 and 4.  On simulated hosts (one rank per host, TCP
between them):

    launch/simcluster.py run --hosts 3 -- python benchmarks/global_mesh_collectives.py \
        --local 2 --no-gloo --tag=-simhosts
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

RESULTS = Path(__file__).resolve().parent / "results"
AXES = ("hosts", "local")
NAMES = ("all_gather", "psum_scatter", "all_to_all", "ppermute", "pbroadcast", "psum")
# The direct MPI collective moving what each lax collective moves per process
# (benchmarks/mpi_floor.c), and its count argument from a process's elements.
FLOOR = {
    "all_gather": ("allgather", lambda n, p: n),
    "psum_scatter": ("reduce_scatter", lambda n, p: n // p),
    "all_to_all": ("alltoall", lambda n, p: n // p),
    "ppermute": ("sendrecv", lambda n, p: n),
    "pbroadcast": ("bcast", lambda n, p: n),
    "psum": ("allreduce", lambda n, p: n),
}
PER_CALL_DISPATCHES = 200
PER_CALL_SIZE = "16 B per device"  # the per-call rows' size label


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local", type=int, default=1, help="devices per process")
    parser.add_argument("--mib", type=float, default=4.0, help="MiB per process (large size)")
    parser.add_argument("--small", type=int, default=16, help="bytes per process (small size)")
    parser.add_argument("--inner", type=int, default=10, help="calls per jitted loop")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--floor-lib", type=Path, default=None)
    parser.add_argument("--no-gloo", action="store_true", help="skip JAX's gloo")
    parser.add_argument("--tag", default="",
                        help="results go to global_mesh_collectives_<P>proc<TAG>.json "
                             "(e.g. -simhosts under launch/simcluster.py)")
    parser.add_argument("--gloo-inner", type=int, default=3,
                        help="gloo's calls per loop (its large collectives take seconds)")
    parser.add_argument("--gloo-repeats", type=int, default=5)
    parser.add_argument("--gloo-timeout", type=int, default=1200,
                        help="seconds before the gloo phase is declared hung")
    jax_gloo.add_worker_arguments(parser)
    return parser.parse_args(argv)


def sizes(args):
    """{label: bytes per process asked for}: the small and the large size."""
    large = int(args.mib * 2**20)
    return {f"{args.small} B": args.small,
            f"{args.mib:g} MiB" if args.mib >= 1 else f"{large} B": large}


def per_device(nbytes, processes, local):
    """float32 elements per device: nbytes per process split over its devices, a
    multiple of the participants (psum_scatter and all_to_all cut a device's block
    into one piece per participant), at least one per participant."""
    count = processes * local
    return max(count, int(nbytes / 4 / local) // count * count)


def reference(name, everyone, count, n):
    """numpy's answer for one call on every participant's block (rows: participants)."""
    if name == "all_gather":
        return np.broadcast_to(everyone.reshape(-1)[:n], everyone.shape) * 0.5
    if name == "psum_scatter":
        pieces = everyone.sum(0).reshape(count, -1)
        return np.stack([np.tile(pieces[p], count) for p in range(count)]) * 0.5
    if name == "all_to_all":
        pieces = everyone.reshape(count, count, -1)  # [source, destination, ...]
        return pieces.transpose(1, 0, 2).reshape(count, -1) * 0.5
    if name == "ppermute":
        return np.roll(everyone, 1, axis=0) * 0.5
    if name == "pbroadcast":
        return np.broadcast_to(everyone[-1], everyone.shape) * 0.5
    return np.broadcast_to(everyone.sum(0), everyone.shape) * 0.5


def measure(jax, args, timer, gloo=False):
    """Every collective at both sizes, and the per-call rows, over the global mesh of
    the JAX job this process is in (mpicoll's, or with gloo=True JAX's own), timed by
    timer (timing.Timer): {(name, label): [s per call]}."""
    from jax import lax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    processes, rank, local = jax.process_count(), jax.process_index(), jax.local_device_count()
    count = processes * local
    mesh = jax.make_mesh((processes, local), AXES)
    spec = P(AXES)
    ring = [(i, (i + 1) % count) for i in range(count)]
    bodies = {
        "all_gather": lambda x: lax.all_gather(x, AXES, tiled=True)[:x.shape[0]] * 0.5,
        "psum_scatter": lambda x: jnp.tile(lax.psum_scatter(x, AXES, tiled=True), count) * 0.5,
        "all_to_all": lambda x: lax.all_to_all(x, AXES, 0, 0, tiled=True) * 0.5,
        "ppermute": lambda x: lax.ppermute(x, AXES, ring) * 0.5,
        "pbroadcast": lambda x: lax.pbroadcast(x, AXES, count - 1) * 0.5,
        "psum": lambda x: lax.psum(x, AXES) * 0.5,
    }

    def program(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                     check_vma=False))  # psum's loop carry

    results = {}
    for label, nbytes in sizes(args).items():
        n = per_device(nbytes, processes, local)
        everyone = np.random.default_rng(0).normal(size=(count, n)).astype(np.float32)
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, spec), everyone[rank * local:(rank + 1) * local].reshape(-1))
        for name in NAMES:
            try:
                once = jax.block_until_ready(program(bodies[name])(x))
            except NotImplementedError:
                if gloo and name == "pbroadcast":  # JAX has no CPU lowering of it
                    continue
                raise
            got = np.asarray(once.addressable_data(0))
            np.testing.assert_allclose(got, reference(name, everyone, count, n)[rank * local],
                                       rtol=1e-4, atol=1e-3 * count)
            loop = program(lambda v, body=bodies[name]: lax.fori_loop(
                0, args.inner, lambda i, v: body(v), v))
            results[name, label] = timer.repeated(lambda: jax.block_until_ready(loop(x)),
                                                  args.repeats, args.inner)
    if gloo:  # 200 asynchronous dispatches over several devices deadlock XLA's in-process
        return results  # rendezvous on a small machine (2 cores): no per-call rows
    # Per call: 200 dispatches of a jitted shard_map, 16 B per
    # device: a psum over the process axis alone, a body with no collective (JAX's
    # own cost of a call at L devices), and a psum over the device axis alone.
    small = jax.make_array_from_process_local_data(NamedSharding(mesh, spec),
                                                   np.ones(4 * local, np.float32))
    per_call = {"psum over hosts, per call": lambda v: lax.psum(v, "hosts"),
                "empty body, per call": lambda v: v * 2}
    if local > 1:
        per_call["psum over local, per call"] = lambda v: lax.psum(v, "local")

    def dispatches(call):
        for _ in range(PER_CALL_DISPATCHES):
            out = call(small)
        jax.block_until_ready(out)

    for name, body in per_call.items():
        call = program(body)
        results[name, PER_CALL_SIZE] = timer.repeated(lambda: dispatches(call), args.repeats,
                                                      PER_CALL_DISPATCHES)
    return results


def gloo_worker(args):
    """In a child process of each rank: the same measurements on JAX's gloo."""
    jax = jax_gloo.initialize(args)
    # No barrier; each worker's own times (the driver takes the slowest of them).
    results = measure(jax, args, timing.Timer(lambda: None, lambda t: t), gloo=True)
    jax_gloo.emit(dict(times=[[name, label, times] for (name, label), times in results.items()]))
    jax_gloo.shutdown()


def floor_rows(args, comm, processes):
    """The C MPI floor of every collective at both sizes: {(name, label): [s per call]}."""
    from mpi_floor import load_floor
    floor, note = load_floor(args.floor_lib, comm)
    if floor is None:
        print(f"MPI floor: not measured ({note})", file=sys.stderr)
        return {}
    results = {}
    for label, nbytes in sizes(args).items():
        elements = per_device(nbytes, processes, args.local) * args.local  # per process
        for name, (op, count_of) in FLOOR.items():
            count = count_of(elements, processes)
            source = np.ones(elements, np.float32)
            out = np.ones(max(elements, count * processes), np.float32)
            floor.call(op, source, out, count, args.inner)  # warm up
            times = floor.call(op, source, out, count, args.inner, args.repeats)
            results[name, label] = [t / args.inner for t in times]
    return results


def record(args, processes, mpi_version, jax_version, rows):
    """Merge this run into results/global_mesh_collectives_<P>proc.json, one entry per L
    (the docs' bench-table reads a copy: docs/global_mesh-<P>proc.json)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"global_mesh_collectives_{processes}proc{args.tag}.json"
    machine = dict(benchmark="global_mesh", processes=processes, jax=jax_version,
                   mpi=mpi_version, host=platform.node(), cores=os.cpu_count(),
                   tag=args.tag)
    data = json.loads(path.read_text()) if path.exists() else {}
    if {k: data.get(k) for k in machine} != machine:
        data = dict(machine, runs={})  # another machine or setup: start anew
    # Each size as asked (the docs' rows) and as moved per process at this L.
    size_table = {label: dict(asked=n, per_process=per_device(n, processes, args.local)
                              * 4 * args.local) for label, n in sizes(args).items()}
    size_table[PER_CALL_SIZE] = dict(asked=16, per_process=16 * args.local)
    data["runs"][str(args.local)] = dict(
        when=time.strftime("%Y-%m-%d %H:%M"), repeats=args.repeats, inner=args.inner,
        gloo_repeats=args.gloo_repeats, gloo_inner=args.gloo_inner,
        sizes=size_table, load_average=list(os.getloadavg()[:1]),
        rows=[dict(op=name, size=label, impl=impl, us=us) for (name, label, impl), us in rows])
    path.write_text(json.dumps(data, indent=1))
    return path


def main():
    args = parse_args()
    if args.gloo_worker:
        return gloo_worker(args)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, processes = comm.Get_rank(), comm.Get_size()
    # 1. gloo, in child processes (before this process's JAX starts).
    reports, gloo_error = (None, "skipped (--no-gloo)") if args.no_gloo else jax_gloo.run_workers(
        comm, __file__, ["--mib", args.mib, "--small", args.small, "--inner", args.gloo_inner,
                         "--repeats", args.gloo_repeats], args.local,
        timeout=args.gloo_timeout, set_device_count=True, quiet=True)
    # 2. mpicoll: this process joins its own JAX job.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.local}")
    import jax
    import mpicoll.distributed
    mpicoll.distributed.initialize(initialization_timeout=60)
    times = {(name, label, "mpicoll"): t
             for (name, label), t in measure(jax, args, timing.mpi_timer(comm)).items()}
    # 3. The C MPI floor, in this process.
    times.update({(name, label, "MPI floor"): t
                  for (name, label), t in floor_rows(args, comm, processes).items()})
    if rank != 0:
        return
    if reports is not None:
        for name, label, _ in reports[0]["times"]:
            per_worker = [dict(((n, s), t) for n, s, t in r["times"])[name, label]
                          for r in reports]
            times[name, label, "gloo"] = jax_gloo.slowest_times(per_worker)
    rows = [(key, float(np.median(t)) * 1e6) for key, t in times.items()]
    print(f"{processes} processes x {args.local} devices, jax {jax.__version__}, "
          f"{platform.node()}: us per call, median of {args.repeats}")
    medians = dict(rows)
    impls = ["mpicoll", "gloo", "MPI floor"]
    print(f"  {'':38}" + "".join(f"{impl:>12}" for impl in impls))
    for name, label in dict.fromkeys((n, s) for n, s, _ in medians):
        print(f"  {name + ', ' + label:38}" + "".join(
            f"{medians[name, label, impl]:12.1f}" if (name, label, impl) in medians
            else f"{'–':>12}" for impl in impls))
    if reports is None:
        print(f"gloo: no result ({gloo_error})")
    path = record(args, processes, MPI.Get_library_version().splitlines()[0], jax.__version__,
                  rows)
    print(f"merged into {path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""An allreduce of an array laid out over a process's devices, against the
same work written with shard_map over mpicoll.mesh() and against one device's array.

    mpiexec -n 2 python benchmarks/sharded_arrays.py [--mib 4] [--repeats 21]

Each process holds --mib MiB of float32 (its logical array) and allreduces it
across the ranks, four ways, inside jax.jit (one call per dispatch):

  P("d") array      mpicoll.allreduce(x) on x = device_put(..., NamedSharding(mesh,
                    P("d"))): each device allreduces its half on its communicator
  replicated        the same on x replicated on both devices (P()): each device
                    allreduces half of it, the halves gathered within the process
  shard_map         jax.shard_map(mpicoll.allreduce, mpicoll.mesh("dev"),
                    P("dev")) on the same P("d") data: what users wrote before
  one device        mpicoll.allreduce(x) on a single-device array of the same bytes

Then a gradient pytree: --leaves float32 leaves of --leaf-kib KiB each, laid out
as P("d") and replicated, allreduced inside jax.jit as one tree (its leaves travel
fused: each device's shards in one MPI message) and as one call per leaf (what
a tree cost before its leaves fused); each row prints the per-leaf / tree ratio.

Timing: warm-up, then the median over --repeats runs of --inner calls, each
started together (a barrier) and taken as the slowest rank's time, always with
block_until_ready(); every result checked against numpy.  The four ways take
turns, --rounds times (so a slow spell of the machine touches each alike), and
each row prints its median over the rounds and its ratio to the P("d") row
(the median, and the lowest and highest of the rounds' ratios).
"""

import argparse
import os
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
import timing  # noqa: E402

COMM = MPI.COMM_WORLD
TIMER = timing.mpi_timer(COMM)


def timed(fn, x, repeats, inner):
    """(the median seconds per call over repeats of `inner` calls, the last output)."""
    def calls():
        for _ in range(inner):
            out = fn(x)
        return jax.block_until_ready(out)

    out = jax.block_until_ready(fn(x))  # warm-up
    times = []
    for _ in range(repeats):
        out, seconds = TIMER.time_call(calls)
        times.append(seconds / inner)
    return statistics.median(times), out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--leaf-kib", type=float, default=4.0)
    args = parser.parse_args()
    one_array(args)
    pytree(args)


def one_array(args):
    devices = jax.local_device_count()
    count = int(args.mib * 2**20 / 4) // devices * devices
    rank, size = COMM.Get_rank(), COMM.Get_size()
    data = np.arange(count, dtype=np.float32) % 1000 + rank
    want = sum(np.arange(count, dtype=np.float32) % 1000 + r for r in range(size))

    mesh = jax.make_mesh((devices,), ("d",))
    sharded = jax.device_put(data, NamedSharding(mesh, P("d")))
    replicated = jax.device_put(data, NamedSharding(mesh, P()))
    single = jax.device_put(data, jax.local_devices()[0])
    local = mpicoll.mesh("dev")
    shard_mapped = jax.jit(jax.shard_map(mpicoll.allreduce, mesh=local,
                                         in_specs=P("dev"), out_specs=P("dev")))
    allreduce = jax.jit(mpicoll.allreduce)
    rows = [("P(\"d\") array", allreduce, sharded),
            ("replicated", allreduce, replicated),
            ("shard_map over mpicoll.mesh", shard_mapped,
             jax.device_put(data, NamedSharding(local, P("dev")))),
            ("one device", allreduce, single)]
    for name, fn, x in rows:  # compile and check each before timing any
        if not np.allclose(np.asarray(fn(x)), want):
            raise SystemExit(f"{name}: wrong result")
    rounds = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):
        for name, fn, x in rows:
            seconds, out = timed(fn, x, args.repeats, args.inner)
            if not np.allclose(np.asarray(out), want):
                raise SystemExit(f"{name}: wrong result")
            rounds[name].append(seconds)
    if rank == 0:
        base = rounds[rows[0][0]]
        print(f"allreduce of {args.mib:g} MiB per process, {size} ranks x {devices} devices, "
              f"jax {jax.__version__}: us per call, median of {args.repeats} (slowest rank), "
              f"median of {args.rounds} rounds; ratio to P(\"d\"): median (lowest-highest)")
        for name, times in rounds.items():
            ratios = [t / b for t, b in zip(times, base)]
            print(f"  {name:<30} {statistics.median(times) * 1e6:10.1f}   "
                  f"{statistics.median(ratios):5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


def pytree(args):
    devices = jax.local_device_count()
    count = int(args.leaf_kib * 1024 / 4) // devices * devices
    rank, size = COMM.Get_rank(), COMM.Get_size()
    mesh = jax.make_mesh((devices,), ("d",))
    leaves = [np.arange(count, dtype=np.float32) % 100 + i + rank for i in range(args.leaves)]
    wants = [sum(np.arange(count, dtype=np.float32) % 100 + i + r for r in range(size))
             for i in range(args.leaves)]
    as_tree = jax.jit(mpicoll.allreduce)
    per_leaf = jax.jit(lambda tree: [mpicoll.allreduce(leaf) for leaf in tree])
    rows = []
    for layout, spec in (('P("d")', P("d")), ("replicated", P())):
        tree = [jax.device_put(leaf, NamedSharding(mesh, spec)) for leaf in leaves]
        rows += [(f"{layout}, the tree", as_tree, tree),
                 (f"{layout}, a call per leaf", per_leaf, tree)]
    rounds = {name: [] for name, _, _ in rows}
    for _ in range(args.rounds):
        for name, fn, tree in rows:
            seconds, out = timed(fn, tree, args.repeats, args.inner)
            if not all(np.allclose(np.asarray(o), w) for o, w in zip(out, wants)):
                raise SystemExit(f"{name}: wrong result")
            rounds[name].append(seconds)
    if rank == 0:
        print(f"allreduce of a pytree of {args.leaves} x {args.leaf_kib:g} KiB float32 leaves: "
              f"us per call (as above); ratio a call per leaf / the tree")
        for (name, _, _), (other, _, _) in zip(rows[::2], rows[1::2]):
            ratios = [b / a for a, b in zip(rounds[name], rounds[other])]
            for row in (name, other):
                print(f"  {row:<30} {statistics.median(rounds[row]) * 1e6:10.1f}")
            print(f"  {'':<30} {'':>10}   {statistics.median(ratios):5.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()

"""Measurements for the allreduce cost model (benchmarks/allreduce_model.py), on a simulated cluster.

    launch/simcluster.py run --hosts 3 --ranks-per-host 2 -- python benchmarks/multihost_allreduce.py flat
    launch/simcluster.py run --hosts 3 --ranks-per-host 1 -- python benchmarks/multihost_allreduce.py devices
    make bench-multihost        # both, at 2 to 4 hosts (benchmarks/multihost_allreduce.sh)

flat      one device per rank, 2 ranks per host.  Ping-pong (mpi4py, numpy buffers)
          between ranks 0 and 1 (one host: shared memory) and ranks 0 and 2 (two hosts:
          TCP), and mpicoll.allreduce over all ranks inside jit.
devices   one rank per host with L fake CPU devices (--local, default 2; XLA_FLAGS,
          set here).  The global allreduce (axis_name) forced down each of its three
          paths: "combine" (the device threads meet in mpicoll's handler, one thread
          reduces the L arrays and makes one MPI allreduce), "small" (psum over the
          devices, then every device allreduces the whole array across ranks) and
          "split" (psum_scatter, every device allreduces its 1/L, all_gather); and the
          device-only parts alone, no MPI across hosts: psum; psum_scatter + all_gather;
          the combine over MPI.COMM_SELF.

Timing: a warm-up call (compiles), then REPEATS timed calls, each started after a
barrier and taken as the slowest rank's time; a call is a jitted fori_loop of `inner`
dependent allreduces (x <- allreduce(x) * 1/P), donated, blocked on; median / inner.
Every path's result is checked against numpy once.  Rank 0 writes one JSON file.
"""

import argparse
import json
import os
import sys

def _local_devices(argv):
    """--local L, read before jax is imported (it fixes the fake device count)."""
    for i, arg in enumerate(argv):
        if arg == "--local" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--local="):
            return int(arg.split("=", 1)[1])
    return 2


LOCAL = _local_devices(sys.argv)
if len(sys.argv) > 1 and sys.argv[1] == "devices":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={LOCAL}")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
from mpicoll._src.ops import ranks_devices  # noqa: E402
from mpicoll._src.runtime import settings  # noqa: E402
from mpicoll import topology  # noqa: E402
import timing  # noqa: E402

WORLD = MPI.COMM_WORLD
TIMER = timing.mpi_timer(WORLD)
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
KIB, MIB = 1024, 1024 * 1024
SIZES = [KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 8 * MIB]  # bytes per device (float32)
REPEATS = 7


def inner_for(nbytes):
    return 20 if nbytes <= 128 * KIB else 3


def median_time(call, repeats=REPEATS):
    """Warm-up, then the median over repeats of the slowest rank's time of call()."""
    return float(np.median(TIMER.repeated(call, repeats)))


def pingpong(peer, nbytes, iterations):
    """Half round-trip time between rank 0 and `peer` (other ranks only take part in barriers)."""
    buffer = np.zeros(max(nbytes, 1), np.uint8)

    def call():
        for _ in range(iterations):
            if RANK == 0:
                WORLD.Send(buffer, dest=peer)
                WORLD.Recv(buffer, source=peer)
            elif RANK == peer:
                WORLD.Recv(buffer, source=0)
                WORLD.Send(buffer, dest=0)
    return median_time(call) / iterations / 2


def jitted_loop(step, inner, scale):
    body = lambda i, v: step(v) * scale  # noqa: E731
    return jax.jit(lambda x: lax.fori_loop(0, inner, body, x), donate_argnums=0)


def measure_flat(report):
    t = topology.world()
    if t.local_size < 2 or t.node_count < 2 or SIZE < 3:
        raise SystemExit("flat: run with >= 2 hosts x 2 ranks (rank 1 on rank 0's host, "
                         "rank 2 on another)")
    for label, peer in (("pingpong_intra", 1), ("pingpong_inter", t.local_size)):
        report[label] = [[n, pingpong(peer, n, 50 if n <= 128 * KIB else 5)]
                         for n in [8] + SIZES]
    rows = []
    for nbytes in SIZES:
        count, inner = nbytes // 4, inner_for(nbytes)
        loop = jitted_loop(mpicoll.allreduce, inner, np.float32(1 / SIZE))
        x = jax.numpy.full(count, RANK + 1, np.float32)
        check = np.asarray(jax.jit(mpicoll.allreduce)(x))
        assert np.all(check == SIZE * (SIZE + 1) / 2), check[:4]
        state = {"x": x}

        def call():
            state["x"] = loop(state["x"])
            state["x"].block_until_ready()
        rows.append([nbytes, median_time(call) / inner])
    report["flat_allreduce"] = rows


def measure_devices(report):
    local = jax.local_device_count()
    assert local == LOCAL, (local, os.environ.get("XLA_FLAGS"))
    participants = SIZE * local
    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    def mapped(step):
        return jax.shard_map(lambda v: step(v[0])[None], mesh=mesh, in_specs=P("d"),
                             out_specs=P("d"), check_vma=False)

    def global_allreduce(v):
        return mpicoll.allreduce(v, axis_name="d")

    def combined_here(v):  # the combine alone: the MPI allreduce is over this rank only
        return mpicoll.allreduce(v, axis_name="d", comm=MPI.COMM_SELF)

    # name -> (LOCAL_COMBINE_BYTES, SPLIT_ALLREDUCE_BYTES while tracing, step, over
    # every rank?).  Both thresholds are read when a call is traced: 0 and inf force a path.
    inf = float("inf")
    paths = {
        "global_combine": (inf, inf, global_allreduce, True),
        "global_small": (0, inf, global_allreduce, True),
        "global_split": (0, 0, global_allreduce, True),
        "local_psum": (0, inf, lambda v: lax.psum(v, "d"), False),
        "local_split": (0, inf, lambda v: lax.all_gather(lax.psum_scatter(v, "d", tiled=True),
                                                         "d", tiled=True), False),
        "local_combine": (inf, inf, combined_here, False),
    }
    for name, (combine_bytes, split_bytes, step, across) in paths.items():
        rows = []
        with settings.override(local_combine_bytes=combine_bytes,
                               split_allreduce_bytes=split_bytes):
            for nbytes in SIZES:
                count, inner = nbytes // 4, inner_for(nbytes)
                every = participants if across else local
                loop = jitted_loop(mapped(step), inner, np.float32(1 / every))
                first = RANK * local
                data = np.stack([np.full(count, first + k + 1, np.float32) for k in range(local)])
                want = sum(range(1, participants + 1)) if across \
                    else sum(range(first + 1, first + local + 1))
                once = jax.jit(mapped(step))(jax.device_put(data, sharding))
                assert np.all(np.asarray(once) == want), (name, np.asarray(once)[:, :3], want)
                state = {"x": jax.device_put(data, sharding)}

                def call():
                    state["x"] = loop(state["x"])
                    state["x"].block_until_ready()
                rows.append([nbytes, median_time(call) / inner])
        report[name] = rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["flat", "devices"])
    parser.add_argument("--local", type=int, default=2,
                        help="devices: fake CPU devices per rank (default 2)")
    parser.add_argument("--output", help="JSON file (default benchmarks/results/"
                                         "multihost-MODE-HOSTSh[-LOCALd].json)")
    args = parser.parse_args()
    t = topology.world()
    report = dict(mode=args.mode, hosts=t.node_count, ranks=SIZE, ranks_per_host=t.local_size,
                  local_devices=jax.local_device_count(),
                  mpi=MPI.Get_library_version().splitlines()[0].strip(), jax=jax.__version__,
                  cores=os.cpu_count(),
                  split_allreduce_bytes=ranks_devices.split_allreduce_bytes(LOCAL),
                  local_combine_bytes=ranks_devices.local_combine_bytes(LOCAL),
                  load_before=os.getloadavg()[0])
    (measure_flat if args.mode == "flat" else measure_devices)(report)
    report["load_after"] = os.getloadavg()[0]
    if RANK == 0:
        path = args.output or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                           f"multihost-{args.mode}-{t.node_count}h"
                                           f"{'' if args.mode == 'flat' or LOCAL == 2 else f'-{LOCAL}d'}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps({k: v for k, v in report.items() if not isinstance(v, list)}))
        for key, rows in report.items():
            if isinstance(rows, list):
                print(f"{key:16s}", "  ".join(f"{n // KIB if n >= KIB else n}{'K' if n >= KIB else 'B'}:"
                                              f"{t * 1e6:.1f}us" for n, t in rows), flush=True)


if __name__ == "__main__":
    main()

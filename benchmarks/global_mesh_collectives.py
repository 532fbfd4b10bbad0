"""Collectives over a global mesh's process and device axes at once: L devices per
process against one (issue 34).

    mpiexec -n P python benchmarks/global_mesh_collectives.py --local L [--mib 4]

After mpicoll.distributed.initialize(), a mesh ("hosts", "local") of P x L
devices, --mib MiB of float32 per process (split over its L devices), and inside
jax.jit(jax.shard_map(...)) a fori_loop of --inner dependent calls of each
jax.lax collective over ("hosts", "local"): all_gather (tiled, its first block
kept), psum_scatter (tiled, its block repeated), all_to_all, ppermute (a ring
over the P*L participants), pbroadcast and psum; and the cost of one call (200
dispatches of a 16 B psum over "hosts" alone, and of a body with no collective).
The same bytes per process
whatever L, so L = 1 (the direct MPI collective) is the floor an L > 1 run is
compared with: run both and divide (`make bench` does, and prints the ratios).
Medians over repeats, each started together (a barrier), the slowest rank,
block_until_ready() always; every result checked against numpy once.
Prints one line per collective and merges the run into
benchmarks/results/global_mesh_collectives_<P>proc.json (one entry per L; the
docs' tables read a copy, docs/global_mesh-<P>proc.json).
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local", type=int, default=1, help="devices per process")
    parser.add_argument("--mib", type=float, default=4.0, help="MiB per process")
    parser.add_argument("--inner", type=int, default=10, help="calls per jitted loop")
    parser.add_argument("--repeats", type=int, default=15)
    return parser.parse_args()


ARGS = parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={ARGS.local}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll.distributed  # noqa: E402

mpicoll.distributed.initialize(initialization_timeout=60)
WORLD = MPI.COMM_WORLD
RANK, PROCESSES = WORLD.Get_rank(), WORLD.Get_size()
L = ARGS.local
COUNT = PROCESSES * L
AXES = ("hosts", "local")
# Elements per device: the same bytes per process, divisible by the participants twice
# (psum_scatter and all_to_all cut a device's block into COUNT pieces).
PER_DEVICE = int(ARGS.mib * 2**20 / 4 / L) // (COUNT * COUNT) * COUNT * COUNT
RING = [(i, (i + 1) % COUNT) for i in range(COUNT)]

BODIES = {
    "all_gather": lambda x: lax.all_gather(x, AXES, tiled=True)[:x.shape[0]] * 0.5,
    "psum_scatter": lambda x: jnp.tile(lax.psum_scatter(x, AXES, tiled=True), COUNT) * 0.5,
    "all_to_all": lambda x: lax.all_to_all(x, AXES, 0, 0, tiled=True) * 0.5,
    "ppermute": lambda x: lax.ppermute(x, AXES, RING) * 0.5,
    "pbroadcast": lambda x: lax.pbroadcast(x, AXES, COUNT - 1) * 0.5,
    "psum": lambda x: lax.psum(x, AXES) * 0.5,
}


def reference(name, everyone):
    """numpy's answer for one call on every participant's block (rows: participants)."""
    if name == "all_gather":
        return np.broadcast_to(everyone.reshape(-1)[:PER_DEVICE], everyone.shape) * 0.5
    if name == "psum_scatter":
        pieces = everyone.sum(0).reshape(COUNT, -1)
        return np.stack([np.tile(pieces[p], COUNT) for p in range(COUNT)]) * 0.5
    if name == "all_to_all":
        pieces = everyone.reshape(COUNT, COUNT, -1)  # [source, destination, ...]
        return pieces.transpose(1, 0, 2).reshape(COUNT, -1) * 0.5
    if name == "ppermute":
        return np.roll(everyone, 1, axis=0) * 0.5
    if name == "pbroadcast":
        return np.broadcast_to(everyone[-1], everyone.shape) * 0.5
    return np.broadcast_to(everyone.sum(0), everyone.shape) * 0.5


def record(results):
    """Merge this run into results/global_mesh_collectives_<P>proc.json, one entry per L
    (the docs' bench-table reads a copy: docs/global_mesh-<P>proc.json)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"global_mesh_collectives_{PROCESSES}proc.json"
    machine = dict(benchmark="global_mesh", processes=PROCESSES, jax=jax.__version__,
                   mpi=MPI.Get_library_version().splitlines()[0], host=platform.node(),
                   cores=os.cpu_count())
    data = json.loads(path.read_text()) if path.exists() else {}
    if {k: data.get(k) for k in machine} != machine:
        data = dict(machine, runs={})  # another machine or setup: start anew
    data["runs"][str(L)] = dict(when=time.strftime("%Y-%m-%d %H:%M"), repeats=ARGS.repeats,
                                inner=ARGS.inner, bytes_per_process=PER_DEVICE * 4 * L,
                                load_average=list(os.getloadavg()[:1]), us_per_call=results)
    path.write_text(json.dumps(data, indent=1))


def main():
    mesh = jax.make_mesh((PROCESSES, L), AXES)
    spec = P(AXES)
    everyone = np.random.default_rng(0).normal(size=(COUNT, PER_DEVICE)).astype(np.float32)
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, spec), everyone[RANK * L:(RANK + 1) * L].reshape(-1))
    results = {}
    for name, body in BODIES.items():
        once = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                     check_vma=False))
        got = np.asarray(jax.block_until_ready(once(x)).addressable_data(0))
        expected = reference(name, everyone)[RANK * L]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3 * COUNT)
        loop = jax.jit(jax.shard_map(
            lambda v, body=body: lax.fori_loop(0, ARGS.inner, lambda i, v: body(v), v),
            mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))  # psum's carry
        jax.block_until_ready(loop(x))  # compile and warm up
        times = []
        for _ in range(ARGS.repeats):
            WORLD.Barrier()
            start = time.perf_counter()
            jax.block_until_ready(loop(x))
            times.append(WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX))
        results[name] = float(np.median(times)) / ARGS.inner * 1e6
    # Per call (issue 34's item 3): 200 dispatches of a jitted shard_map, 16 B per device:
    # a psum over the process axis alone (one device per process in each group), a
    # body with no collective (JAX's own cost of a call at L devices), and a psum
    # over the device axis alone.
    small = jax.make_array_from_process_local_data(NamedSharding(mesh, spec),
                                                   np.ones(4 * L, np.float32))
    per_call = {"psum over hosts, per call": lambda v: lax.psum(v, "hosts"),
                "empty body, per call": lambda v: v * 2}
    if L > 1:  # inside each process: its devices meet in mpicoll's handler (no MPI peer)
        per_call["psum over local, per call"] = lambda v: lax.psum(v, "local")
    for name, body in per_call.items():
        call = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                     check_vma=False))
        jax.block_until_ready(call(small))
        times = []
        for _ in range(ARGS.repeats):
            WORLD.Barrier()
            start = time.perf_counter()
            for _ in range(200):
                out = call(small)
            jax.block_until_ready(out)
            times.append(WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX))
        results[name] = float(np.median(times)) / 200 * 1e6
    if RANK == 0:
        header = (f"{PROCESSES} processes x {L} devices, {ARGS.mib:g} MiB per process "
                  f"({PER_DEVICE * 4} B per device), median of {ARGS.repeats}, us per call")
        print(header)
        for name, micros in results.items():
            print(f"  {name:26s} {micros:10.1f}")
        record(results)
    sys.stdout.flush()


main()

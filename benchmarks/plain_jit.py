"""A plain `jax.jit` on global arrays: the partitioner's collectives on mpicoll's MPI
against JAX's gloo, and against the same program written with shard_map on mpicoll.

    python benchmarks/plain_jit.py [--ranks 2] [--local 1] [--rounds 3]

It launches the worker (this file, --worker) under the venv's mpiexec, in rounds
that alternate the transport (MPICOLL_JAX_COLLECTIVES unset: mpicoll's MPI; =gloo:
JAX's gloo), --local CPU devices per process.  Each worker, after
mpicoll.distributed.initialize(), times (block_until_ready, 20 calls of warm-up,
the median of --steps calls, the slowest rank's median):

  plain jit 4 B     jnp.sum of a global f32 array, one element per device
  plain jit 4 MiB   jnp.sum(x, axis=0) of a global (P L, 1 Mi / L) f32 array, 4 MiB per process
  MLP step          a data-parallel step: batch sharded, parameters replicated, jit's
                    shardings (value_and_grad of a 2-layer MLP, 64-256-10, and SGD)
  shard_map 4 B / 4 MiB   the same sums written as shard_map + jax.lax.psum (mpicoll)
  no collective 4 B       jit(x + 1) of the same global array: JAX's own dispatch of a
                          program on it, with nothing to collect
  mpi4py 4 B              mpi4py's Allreduce of 4 bytes, in the same processes
The last two are the floor under the plain-jit 4 B sum (what JAX and MPI cost
without mpicoll between them): its ratio to their sum is printed too.

Prints the medians over rounds side by side with the ratios, and writes
benchmarks/results/plain_jit.json (plain_jit-Ldev.json for L > 1).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "plain_jit.json"
ROWS = ("plain jit 4 B", "plain jit 4 MiB", "MLP step", "shard_map 4 B", "shard_map 4 MiB",
        "no collective 4 B", "mpi4py 4 B")


def worker(steps, local):
    import jax

    jax.config.update("jax_num_cpu_devices", local)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mpi4py import MPI

    import mpicoll.distributed
    from mpicoll._src.over_ranks import jax_transport

    mpicoll.distributed.initialize(initialization_timeout=60)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    mesh = jax.make_mesh((size * local,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = NamedSharding(mesh, P("x"))
    replicated = NamedSharding(mesh, P())

    def global_array(local, sharding=rows):
        return jax.make_array_from_process_local_data(sharding, local)

    def timed(function, *arguments, count=steps, complete=jax.block_until_ready):
        for _ in range(20):
            complete(function(*arguments))
        world.Barrier()
        times = []
        for _ in range(count):
            start = time.perf_counter()
            complete(function(*arguments))
            times.append(time.perf_counter() - start)
        return world.allreduce(statistics.median(times), op=MPI.MAX)

    small = global_array(np.full((local,), rank + 1.0, np.float32))
    large = global_array(np.full((local, (1 << 20) // local), rank + 1.0, np.float32))
    total_small = jax.jit(jnp.sum)
    total_large = jax.jit(lambda x: jnp.sum(x, axis=0))
    want = local * size * (size + 1) / 2
    assert float(total_small(small)) == want
    assert float(np.asarray(total_large(large).addressable_shards[0].data)[0]) == want

    def psum(x):
        return jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                             out_specs=P())(x)
    psum_small, psum_large = jax.jit(psum), jax.jit(psum)

    def mlp_loss(params, batch, target):
        hidden = jnp.tanh(batch @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] + params["b2"] - target) ** 2)

    @jax.jit
    def mlp_step(params, batch, target):
        grads = jax.grad(mlp_loss)(params, batch, target)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    four_bytes, summed = np.ones(1, np.float32), np.zeros(1, np.float32)
    rng = np.random.default_rng(0)
    params = {k: jax.device_put(v, replicated) for k, v in {
        "w1": rng.standard_normal((64, 256)).astype(np.float32) * 0.1,
        "b1": np.zeros(256, np.float32),
        "w2": rng.standard_normal((256, 10)).astype(np.float32) * 0.1,
        "b2": np.zeros(10, np.float32)}.items()}
    batch = global_array(rng.standard_normal((32 * local, 64)).astype(np.float32))
    target = global_array(rng.standard_normal((32 * local, 10)).astype(np.float32))

    result = {
        "transport": jax_transport.transport()[0],
        "plain jit 4 B": timed(total_small, small),
        "plain jit 4 MiB": timed(total_large, large, count=max(10, steps // 10)),
        "MLP step": timed(mlp_step, params, batch, target),
        "shard_map 4 B": timed(psum_small, small),
        "shard_map 4 MiB": timed(psum_large, large, count=max(10, steps // 10)),
        "no collective 4 B": timed(jax.jit(lambda x: x + 1), small),
        "mpi4py 4 B": timed(lambda: world.Allreduce(four_bytes, summed), complete=lambda _: None),
    }
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def launch(ranks, local, transport, steps, timeout):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {k: v for k, v in os.environ.items() if k != "MPICOLL_JAX_COLLECTIVES"}
    if transport == "gloo":
        env["MPICOLL_JAX_COLLECTIVES"] = "gloo"
    command = [str(mpiexec), "-n", str(ranks), sys.executable, __file__, "--worker",
               "--steps", str(steps), "--local", str(local)]
    # JAX's runtime catches SIGTERM: a stuck job needs SIGKILL.
    run = subprocess.run(["timeout", "-s", "KILL", str(timeout), *command], env=env,
                         capture_output=True, text=True)
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.exit(f"benchmarks/plain_jit.py: the {transport} job failed (exit {run.returncode}):\n"
             f"{run.stdout[-2000:]}\n{run.stderr[-3000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--local", type=int, default=1, help="CPU devices per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.local)
    if args.output is None:
        args.output = RESULTS if args.local == 1 else RESULTS.with_name(
            f"plain_jit-{args.local}dev.json")
    runs = {"mpi": [], "gloo": []}
    for _ in range(args.rounds):  # interleaved, so drifts of the machine hit both
        for transport in runs:
            result = launch(args.ranks, args.local, transport, args.steps, args.timeout)
            if result["transport"] != transport:
                sys.exit(f"benchmarks/plain_jit.py: asked for {transport}, the job ran on "
                         f"{result['transport']}")
            runs[transport].append(result)
    medians = {t: {row: statistics.median(r[row] for r in results) for row in ROWS}
               for t, results in runs.items()}
    print(f"plain jit at {args.ranks} ranks x {args.local} CPU devices, medians over "
          f"{args.rounds} rounds "
          "(the slowest rank's median per call)")
    print(f"{'':18}{'mpicoll MPI':>14}{'gloo':>14}{'gloo / MPI':>12}{'MPI / shard_map':>17}")
    for row in ROWS[:3]:
        mpi, gloo = medians["mpi"][row], medians["gloo"][row]
        against = {"plain jit 4 B": "shard_map 4 B", "plain jit 4 MiB": "shard_map 4 MiB"}
        shard = (f"{mpi / medians['mpi'][against[row]]:>16.2f}x" if row in against else "")
        print(f"{row:18}{mpi * 1e6:>12.1f}us{gloo * 1e6:>12.1f}us{gloo / mpi:>11.1f}x{shard}")
    for row in ROWS[3:5]:
        print(f"{row:18}{medians['mpi'][row] * 1e6:>12.1f}us   (shard_map + lax.psum on mpicoll)")
    floor = medians["mpi"]["no collective 4 B"] + medians["mpi"]["mpi4py 4 B"]
    print(f"{'no collective 4 B':18}{medians['mpi']['no collective 4 B'] * 1e6:>12.1f}us   "
          "(jit(x + 1) of the same array: JAX's dispatch)")
    print(f"{'mpi4py 4 B':18}{medians['mpi']['mpi4py 4 B'] * 1e6:>12.1f}us   (MPI_Allreduce)")
    print(f"the floor under the 4 B sum (JAX's dispatch + MPI): {floor * 1e6:.1f} us; the "
          f"plain-jit sum on MPI {medians['mpi']['plain jit 4 B'] / floor:.2f}x it, gloo's "
          f"{medians['gloo']['plain jit 4 B'] / floor:.1f}x it")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"ranks": args.ranks, "local": args.local,
                                       "rounds": args.rounds,
                                       "medians_s": medians, "runs": runs}, indent=1))
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

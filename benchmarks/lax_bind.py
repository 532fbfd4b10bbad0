"""What `import mpicoll` costs a program that never uses its mesh vocabulary: a
plain `jax.lax.psum` inside a `shard_map` over a local mesh, traced and run, in
three fresh processes side by side.

  jax      JAX alone (mpicoll not imported)
  import   `import mpicoll`: jax.lax is JAX's own until the vocabulary is used
  routed   `import mpicoll` and `mpicoll.RANKS` named: every jax.lax collective's
           bind goes through mpicoll's router (which hands this one back to JAX)

Rows (the median over --repeats, each process run --rounds times, interleaved):
  trace 200 psums   make_jaxpr of a shard_map body of 200 psums, per psum
  jitted psum 4 B   a compiled step of one psum, per call (compiled programs
                    never bind again: this row should not move)

    python benchmarks/lax_bind.py [--rounds 3] [--repeats 30]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ARMS = ("jax", "import", "routed")
ROWS = ("trace 200 psums", "jitted psum 4 B")
PSUMS = 200


def worker(arm, repeats):
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    if arm != "jax":
        import mpicoll
        if arm == "routed":
            mpicoll.RANKS  # noqa: B018 (the first use installs the router)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("i",))

    def trace_many():  # a new function each time: JAX's trace caches miss, as a new program's
        def many(x):
            for _ in range(PSUMS):
                x = jax.lax.psum(x, "i")
            return x

        jax.make_jaxpr(jax.shard_map(many, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)

    step = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh,
                                 in_specs=P("i"), out_specs=P("i")))
    x = jnp.ones(1, jnp.float32)

    def median_of(run, count):
        for _ in range(3):
            run()
        times = []
        for _ in range(count):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    result = {
        "trace 200 psums": median_of(trace_many, repeats) / PSUMS,
        "jitted psum 4 B": median_of(lambda: [step(x).block_until_ready() for _ in range(100)],
                                     repeats) / 100,
    }
    print("RESULT " + json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--worker", choices=ARMS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.repeats)
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_"))}
    seen = {arm: {row: [] for row in ROWS} for arm in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:  # interleaved: a slow moment of the machine hits every arm alike
            done = subprocess.run([sys.executable, __file__, "--worker", arm, "--repeats",
                                   str(args.repeats)], capture_output=True, text=True,
                                  timeout=600, env=env, check=True)
            line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
            for row, value in json.loads(line[len("RESULT "):]).items():
                seen[arm][row].append(value)
    print(f"{'':18}" + "".join(f"{arm:>12}" for arm in ARMS) + f"{'import/jax':>12}"
          f"{'routed/jax':>12}")
    for row in ROWS:
        medians = [statistics.median(seen[arm][row]) for arm in ARMS]
        print(f"{row:18}" + "".join(f"{m * 1e6:>10.2f}us" for m in medians)
              + f"{medians[1] / medians[0]:>11.2f}x{medians[2] / medians[0]:>11.2f}x")
    print("each round (us):")
    for row in ROWS:
        for arm in ARMS:
            print(f"  {row:18}{arm:>8}: " + " ".join(f"{v * 1e6:.2f}" for v in seen[arm][row]))


if __name__ == "__main__":
    main()

"""What MPI's thread level costs a small allreduce, and what mpicoll's serialized mode gains.

    python benchmarks/thread_level.py --floor-lib PATH --mpiexec "mpiexec -n 2" [--rounds 3]

The driver (no mpiexec around it) launches one job per thread level, the three
levels interleaved round by round so that load drift hits all alike; each job
(`--job LEVEL`, run by the driver) measures a float32[1] (4 B) sum allreduce:

  c-floor        benchmarks/mpi_floor.c: a C loop of MPI_Allreduce(MPI_IN_PLACE)
  mpicoll-jit    jax.jit of a fori_loop of k dependent mpicoll.allreduce calls
  mpicoll-eager  mpicoll.allreduce(x) on a jax array, in a Python loop
  mpi4py         comm.Allreduce on numpy buffers

at these levels:

  single      mpi4py.rc.thread_level = "single": the C floor and mpi4py only
              (mpicoll needs SERIALIZED at least: XLA calls MPI from its threads)
  serialized  mpi4py.rc.thread_level = "serialized": mpicoll's serialized mode
  multiple    the default (MPI_THREAD_MULTIPLE)

Each cell: k calls per run (k for ~20 ms), a barrier first, the slowest rank's
time, median of --repeats runs, divided by k; then the median over rounds.
Results are checked against numpy once per job.  The table gives each cell's
ratio to the THREAD_SINGLE C floor of the same run.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

LEVELS = ("single", "serialized", "multiple")
IMPLS = ("c-floor", "mpicoll-jit", "mpicoll-eager", "mpi4py")


def job(args):
    """One MPI job at args.job's thread level: prints one JSON line (rank 0)."""
    import mpi4py
    mpi4py.rc.thread_level = args.job
    import numpy as np
    from mpi4py import MPI

    from mpi_floor import FloorLibrary  # benchmarks/, next to this script
    from timing import mpi_timer

    world = MPI.COMM_WORLD
    size = world.Get_size()
    timer = mpi_timer(world, args.target_ms / 1e3)
    floor = FloorLibrary(args.floor_lib, world.Dup())
    expected = np.float32(size * (size + 1) / 2)

    def floor_setup():
        out = np.zeros(1, np.float32)

        def run(k):
            floor.call("allreduce", out, out, 1, k)

        def check():
            buf = np.full(1, world.Get_rank() + 1, np.float32)
            floor.call("allreduce", buf, buf, 1, 1)
            return buf[0]

        def timed():
            k = timer.choose_k(run, amortize=False)
            return k, floor.call("allreduce", out, out, 1, k, args.repeats)
        return check, timed

    def mpi4py_setup():
        send, receive = np.ones(1, np.float32), np.empty(1, np.float32)

        def run(k):
            for _ in range(k):
                world.Allreduce(send, receive)

        def check():
            world.Allreduce(np.full(1, world.Get_rank() + 1, np.float32), receive)
            return receive[0]
        return check, lambda: timer.times(run, args.repeats, amortize=False)

    setups = {"c-floor": floor_setup, "mpi4py": mpi4py_setup}
    if args.job != "single":
        import jax
        import jax.numpy as jnp

        import mpicoll
        assert mpicoll.thread_mode() == args.job, (mpicoll.thread_mode(), args.job)
        mine = jnp.full(1, world.Get_rank() + 1, jnp.float32)

        def jit_setup():
            # Feeding each result back (scaled to stay finite) makes the calls dependent.
            loop = jax.jit(lambda x, k: jax.lax.fori_loop(
                0, k, lambda i, v: mpicoll.allreduce(v) * (1.0 / size), x), donate_argnums=0)
            state = [jnp.ones(1, jnp.float32)]

            def run(k):
                state[0] = loop(state[0], k)
                state[0].block_until_ready()
            check = lambda: float(jax.jit(mpicoll.allreduce)(mine)[0])  # noqa: E731
            return check, lambda: timer.times(run, args.repeats)

        def eager_setup():
            x = jnp.ones(1, jnp.float32)

            def run(k):
                out = None
                for _ in range(k):
                    out = mpicoll.allreduce(x)
                out.block_until_ready()
            check = lambda: float(mpicoll.allreduce(mine)[0])  # noqa: E731
            return check, lambda: timer.times(run, args.repeats, amortize=False)
        setups.update({"mpicoll-jit": jit_setup, "mpicoll-eager": eager_setup})

    medians = {}
    for name in IMPLS:
        if name not in setups:
            continue
        check, measure = setups[name]()
        value = check()
        if value != expected:
            raise SystemExit(f"{name} at {args.job}: allreduce gave {value}, expected {expected}")
        k, times = measure()
        medians[name] = statistics.median(times) / k
    if world.Get_rank() == 0:
        print("RESULT " + json.dumps({"level": args.job, "provided": MPI.Query_thread(),
                                      "library": MPI.Get_library_version().splitlines()[0],
                                      "medians": medians}), flush=True)


def drive(args):
    """Run the jobs, rounds x levels interleaved, and print the table."""
    results = {level: {name: [] for name in IMPLS} for level in LEVELS}
    library = ""
    for round_index in range(args.rounds):
        order = LEVELS[round_index % 3:] + LEVELS[:round_index % 3]
        for level in order:
            command = [*shlex.split(args.mpiexec), sys.executable, os.path.abspath(__file__),
                       "--job", level, "--floor-lib", args.floor_lib,
                       "--repeats", str(args.repeats), "--target-ms", str(args.target_ms)]
            env = {k: v for k, v in os.environ.items() if k != "MPI4PY_RC_THREAD_LEVEL"}
            done = subprocess.run(command, capture_output=True, text=True, env=env,
                                  timeout=args.job_timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or len(lines) != 1:
                sys.exit(f"thread_level.py: the {level} job failed (rc {done.returncode})\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            result = json.loads(lines[0][len("RESULT "):])
            library = result["library"]
            for name, seconds in result["medians"].items():
                results[level][name].append(seconds)
    reference = statistics.median(results["single"]["c-floor"])
    print(f"4 B allreduce by MPI thread level, {args.mpiexec}, {library[:60]}; "
          f"median of {args.rounds} jobs per level (each a median of {args.repeats} runs), "
          "us per call (x the THREAD_SINGLE C floor)")
    print(f"{'':12}" + "".join(f"{name:>22}" for name in IMPLS))
    for level in LEVELS:
        cells = []
        for name in IMPLS:
            values = results[level][name]
            if not values:
                cells.append(f"{'-':>22}")
                continue
            median = statistics.median(values)
            cells.append(f"{median * 1e6:>13.2f} ({median / reference:>5.2f}x)")
        print(f"{level:12}" + "".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor-lib", required=True, help="mpi_floor.so (make bench builds it)")
    parser.add_argument("--mpiexec", default="mpiexec -n 2", help="launcher and its flags")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--target-ms", type=float, default=20.0)
    parser.add_argument("--job-timeout", type=float, default=300.0)
    parser.add_argument("--job", choices=LEVELS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()

"""What the checks across ranks (MPICOLL_CHECK / mpicoll.set_check_mode) cost.

    mpiexec -n 2 python benchmarks/check_mode.py [--runs 21] [--sizes 4 4194304]

Per call: for each message size (bytes per rank, float32), a jitted
lax.fori_loop of k dependent allreduces (x <- allreduce(x, "max"): no
arithmetic besides MPI's, input donated so MPI works in place) is timed in
each mode ("off", "first-run": the default, whose site was checked on its
first run, and "every-call"), in the same process and the same compiled
program (the FFI handler reads the mode at every call).  After a warm-up, runs
rotate through the modes so that drift in the machine's load hits all alike;
each run starts after a barrier, ends with block_until_ready, and counts as
the slowest rank's time.  Prints the median time per allreduce of each.

Per new program: N distinct programs with one 4-byte allreduce each are
compiled ahead of time; the first run of each is timed with the checks off
and in first-run mode (alternating), which isolates what a new program pays.
"""

import argparse
import statistics

import jax
import jax.numpy as jnp
from jax import lax
from mpi4py import MPI

import mpicoll
import timing

WORLD = MPI.COMM_WORLD
TIMER = timing.mpi_timer(WORLD)


def calls_per_run(nbytes):
    """About 20-50 ms per run on a 2-core machine, at least 5 calls."""
    return max(5, min(2000, int(2e6 // max(nbytes, 1)) + 5)) if nbytes < 2**20 else 10


MODES = ("off", "first-run", "every-call")


def timed_run(program, x, check):
    """(program(x), the slowest rank's seconds), the ranks started together in the mode."""
    mpicoll.set_check_mode(check)
    return TIMER.time_call(lambda: program(x).block_until_ready())


def measure(nbytes, runs):
    k = calls_per_run(nbytes)
    n = max(1, nbytes // 4)

    @jax.jit
    def program(x):
        return lax.fori_loop(0, k, lambda i, x: mpicoll.allreduce(x, "max"), x)

    program = jax.jit(program, donate_argnums=0)
    x = jnp.full((n,), float(WORLD.Get_rank()), jnp.float32)
    for check in MODES * 2:  # warm-up: compile, first touches, the first-run check
        x, _ = timed_run(program, x, check)
    times = {mode: [] for mode in MODES}
    for i in range(runs):
        for j in range(len(MODES)):
            mode = MODES[(i + j) % len(MODES)]
            x, seconds = timed_run(program, x, mode)
            times[mode].append(seconds / k)
    mpicoll.set_check_mode("first-run")
    expected = WORLD.Get_size() - 1.0  # the max of the ranks' values
    assert float(x[0]) == expected, (float(x[0]), expected)
    return k, [statistics.median(times[mode]) for mode in MODES]


def first_runs(programs):
    """Median seconds of a compiled program's first run (slowest rank), off vs first-run."""
    x = jnp.ones(1, jnp.float32)
    times = {"off": [], "first-run": []}
    for i, program in enumerate(programs):
        mode = ("off", "first-run")[i % 2]
        _, seconds = timed_run(lambda x: program(x), x, mode)
        times[mode].append(seconds)
    mpicoll.set_check_mode("first-run")
    return statistics.median(times["off"]), statistics.median(times["first-run"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="timed runs per mode")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 4 * 2**20],
                        help="bytes per rank")
    parser.add_argument("--programs", type=int, default=60, help="new programs timed")
    args = parser.parse_args()
    rows = [(nbytes, *measure(nbytes, args.runs)) for nbytes in args.sizes]
    x = jnp.ones(1, jnp.float32)
    programs = [jax.jit(lambda x, c=float(i): mpicoll.allreduce(x + c)).lower(x).compile()
                for i in range(args.programs)]
    new_off, new_first = first_runs(programs)
    if WORLD.Get_rank() == 0:
        print(f"checks across ranks: jitted allreduce (max) of float32 on {WORLD.Get_size()} "
              f"ranks, median of {args.runs} runs each, jax {jax.__version__}")
        print(f"{'bytes':>10} {'calls/run':>9} " + " ".join(f"{m + ' us':>14}" for m in MODES))
        for nbytes, k, medians in rows:
            print(f"{nbytes:>10} {k:>9} " + " ".join(f"{t * 1e6:>14.2f}" for t in medians))
        print(f"first run of a new program (one 4 B allreduce), median of {args.programs // 2}: "
              f"off {new_off * 1e6:.1f} us, first-run {new_first * 1e6:.1f} us, "
              f"difference {(new_first - new_off) * 1e6:.1f} us")


if __name__ == "__main__":
    main()

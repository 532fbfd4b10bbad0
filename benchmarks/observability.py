"""What watching the job costs: the flight recorder (on by default) and the timeline.

    mpiexec -n 2 python benchmarks/observability.py [--runs 21] [--sizes 4 67108864]

For each message size (bytes per rank, float32), a jitted lax.fori_loop of k
dependent allreduces (x <- allreduce(x, "max"), input donated) is timed with
the records off (MPICOLL_FLIGHT_RECORDS=0), with the flight recorder (the
default: each device's last 1,000 collectives) and with the timeline on
(MPICOLL_TRACE: every collective kept), in the same process and the same
compiled program: the handler reads the setting at every call.  After a
warm-up, runs rotate through the three so that drift in the machine's load hits
all alike; each run starts after a barrier, ends with block_until_ready, and
counts as the slowest rank's time.  Prints the median time per allreduce of
each and the ratios to "off".  The stall watchdog runs in all three (it is a
thread that wakes every 0.1 s).
"""

import argparse
import os
import statistics
import tempfile

import jax
import jax.numpy as jnp
from jax import lax
from mpi4py import MPI

import mpicoll
from mpicoll._src.runtime import settings
from mpicoll._src.runtime.native import extension
import timing

WORLD = MPI.COMM_WORLD
TIMER = timing.mpi_timer(WORLD)
MODES = ("off", "flight recorder", "timeline")


def calls_per_run(nbytes):
    """About 20-50 ms per run on a 2-core machine, at least 5 calls."""
    return max(5, min(2000, int(2e6 // max(nbytes, 1)) + 5)) if nbytes < 2**20 else 5


def set_mode(mode, trace_dir):
    flight = settings.current().flight_dir
    extension.set_flight(0 if mode == "off" else 1000, flight, tempfile.gettempdir())
    extension.set_trace(trace_dir if mode == "timeline" else "")


def timed_run(program, x, mode, trace_dir):
    """(program(x), the slowest rank's seconds), the ranks started together in the mode."""
    set_mode(mode, trace_dir)
    return TIMER.time_call(lambda: program(x).block_until_ready())


def measure(nbytes, runs, trace_dir):
    k = calls_per_run(nbytes)
    n = max(1, nbytes // 4)
    program = jax.jit(lambda x: lax.fori_loop(0, k, lambda i, x: mpicoll.allreduce(x, "max"), x),
                      donate_argnums=0)
    x = jnp.full((n,), float(WORLD.Get_rank()), jnp.float32)
    for mode in MODES * 2:  # warm-up: compile, first touches, the first-run check
        x, _ = timed_run(program, x, mode, trace_dir)
    times = {mode: [] for mode in MODES}
    for i in range(runs):
        for j in range(len(MODES)):
            mode = MODES[(i + j) % len(MODES)]
            x, seconds = timed_run(program, x, mode, trace_dir)
            times[mode].append(seconds / k)
    set_mode("flight recorder", "")
    assert float(x[0]) == WORLD.Get_size() - 1.0
    return k, [statistics.median(times[mode]) for mode in MODES]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="timed runs per mode")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 64 * 2**20],
                        help="bytes per rank")
    args = parser.parse_args()
    trace_dir = tempfile.mkdtemp(prefix="mpicoll-bench-trace-")
    rows = [(nbytes, *measure(nbytes, args.runs, trace_dir)) for nbytes in args.sizes]
    if WORLD.Get_rank() == 0:
        print(f"observability: jitted allreduce (max) of float32 on {WORLD.Get_size()} ranks, "
              f"median of {args.runs} runs each, jax {jax.__version__}")
        print(f"{'bytes':>10} {'calls/run':>9} " + " ".join(f"{m + ' us':>20}" for m in MODES)
              + "   flight/off  timeline/off")
        for nbytes, k, medians in rows:
            off = medians[0]
            print(f"{nbytes:>10} {k:>9} " + " ".join(f"{t * 1e6:>20.2f}" for t in medians)
                  + f"   {medians[1] / off:>10.3f}  {medians[2] / off:>12.3f}")
    os.environ.pop("MPICOLL_TRACE", None)


if __name__ == "__main__":
    main()

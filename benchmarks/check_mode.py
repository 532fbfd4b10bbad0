"""What check mode (MPICOLL_CHECK=1 / mpicoll.set_check_mode) costs per collective.

    mpiexec -n 2 python benchmarks/check_mode.py [--runs 21] [--sizes 4 4194304]

For each message size (bytes per rank, float32), a jitted lax.fori_loop of k
dependent allreduces (x <- allreduce(x, "max"): no arithmetic besides MPI's,
input donated so MPI works in place) is timed with check mode off and on, in
the same process and the same compiled program (check mode is read by the FFI
handler at every call).  After a warm-up of both, runs alternate off/on so that
drift in the machine's load hits both alike; each run starts after a barrier,
ends with block_until_ready, and counts as the slowest rank's time.  Prints
the median time per allreduce of each and the ratio on / off (rank 0).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from mpi4py import MPI

import mpicoll

WORLD = MPI.COMM_WORLD


def calls_per_run(nbytes):
    """About 20-50 ms per run on a 2-core machine, at least 5 calls."""
    return max(5, min(2000, int(2e6 // max(nbytes, 1)) + 5)) if nbytes < 2**20 else 10


def timed_run(program, x, check):
    mpicoll.set_check_mode(check)
    WORLD.Barrier()  # both ranks switched, and start together
    start = time.perf_counter()
    x = program(x)
    x.block_until_ready()
    elapsed = time.perf_counter() - start
    return x, WORLD.allreduce(elapsed, op=MPI.MAX)


def measure(nbytes, runs):
    k = calls_per_run(nbytes)
    n = max(1, nbytes // 4)

    @jax.jit
    def program(x):
        return lax.fori_loop(0, k, lambda i, x: mpicoll.allreduce(x, "max"), x)

    program = jax.jit(program, donate_argnums=0)
    x = jnp.full((n,), float(WORLD.Get_rank()), jnp.float32)
    for check in (False, True, False, True):  # warm-up: compile, first touches
        x, _ = timed_run(program, x, check)
    times = {False: [], True: []}
    for i in range(runs):
        for check in ((False, True) if i % 2 == 0 else (True, False)):
            x, seconds = timed_run(program, x, check)
            times[check].append(seconds / k)
    mpicoll.set_check_mode(False)
    expected = WORLD.Get_size() - 1.0  # the max of the ranks' values
    assert float(x[0]) == expected, (float(x[0]), expected)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return k, off, on


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="timed runs per mode")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 4 * 2**20],
                        help="bytes per rank")
    args = parser.parse_args()
    rows = [(nbytes, *measure(nbytes, args.runs)) for nbytes in args.sizes]
    if WORLD.Get_rank() == 0:
        print(f"check mode cost: jitted allreduce (max) of float32 on {WORLD.Get_size()} ranks, "
              f"median of {args.runs} runs each, jax {jax.__version__}")
        print(f"{'bytes':>10} {'calls/run':>9} {'off us/call':>12} {'on us/call':>11} "
              f"{'on/off':>7}")
        for nbytes, k, off, on in rows:
            print(f"{nbytes:>10} {k:>9} {off * 1e6:>12.1f} {on * 1e6:>11.1f} {on / off:>7.2f}")


if __name__ == "__main__":
    main()

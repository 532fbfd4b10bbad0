"""Overlapped collectives (mpicoll.overlap()): step times with and without, and the hand-off cost.

    mpiexec -n 2 python benchmarks/overlap.py [--runs 21] [--xla-threads N] [--bandwidth]

Latency case (the issue's): rank 1 reaches an allreduce (4 KiB) late, after a
chain of matmuls its input depends on (~10 ms); rank 0 runs the same chain,
independent of its allreduce.  Rank 0's step time, synchronous and overlapped,
against rank 0's compute alone (both ranks run the chain, nothing else) and
its communication alone (rank 0 only calls the allreduce, so it waits for
rank 1's chain).  Target: overlapped step <= 1.3 x max(compute, communication).

Small messages: a jitted fori_loop of k dependent 4-byte allreduces, sync and
overlapped: what the hand-off to the progress thread costs where there is
nothing to overlap (why overlap is opt-in).

Bandwidth case: an independent matmul chain and a 16 MiB allreduce of about
equal time, target step <= 1.2 x max of the two.  Shared-memory MPI copies with
the CPU, so it is meaningful only where each rank has spare cores: it runs when
there are at least 4 cores per rank (or with --bandwidth), and says so when not.

Every case: one compiled program per mode, warm-up first, then runs rotate
through the modes so that drift in the machine's load hits all alike; each run
starts after a barrier and ends with block_until_ready; medians.
"""

import argparse
import os
import statistics
import sys

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--runs", type=int, default=21, help="timed runs per mode")
parser.add_argument("--compute-ms", type=float, default=10.0,
                    help="target compute time of the latency case")
parser.add_argument("--xla-threads", type=int, default=0,
                    help="XLA:CPU threads per rank (intra-op pool and Eigen); 0: XLA's default")
parser.add_argument("--bandwidth", action="store_true",
                    help="run the bandwidth case whatever the core count")
parser.add_argument("--skip-small", action="store_true", help="skip the small-message loop")
args = parser.parse_args()
if args.xla_threads:  # before jax is imported
    flags = os.environ.get("XLA_FLAGS", "")
    extra = f"--xla_cpu_multi_thread_eigen={str(args.xla_threads > 1).lower()} "
    extra += f"intra_op_parallelism_threads={args.xla_threads}"
    os.environ["XLA_FLAGS"] = f"{flags} {extra}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402
import timing  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
# Each rank's own time: the cases compare what a late rank and the others wait.
RANK_TIMER = timing.Timer(WORLD.Barrier, lambda t: t)


def say(text):
    if RANK == 0:
        print(text, flush=True)


def chain(a, k):
    """k dependent matmuls (with tanh, so XLA cannot fold them)."""
    for _ in range(k):
        a = jnp.tanh(a @ a)
    return a


def timed(fn, *xs):
    """This rank's seconds for fn(*xs), started together after a barrier."""
    return RANK_TIMER.time_call(lambda: jax.block_until_ready(fn(*xs)))[1]


def rotate(programs, inputs, runs, warmup=3):
    """{mode: [seconds of this rank]}, modes rotating run by run."""
    modes = list(programs)
    for _ in range(warmup):
        for mode in modes:
            timed(programs[mode], *inputs[mode])
    times = {mode: [] for mode in modes}
    for i in range(runs):
        for j in range(len(modes)):
            mode = modes[(i + j) % len(modes)]
            times[mode].append(timed(programs[mode], *inputs[mode]))
    return times


def calibrate(seconds, n):
    """Matmuls per chain (same on every rank) for about `seconds` of compute on rank 0."""
    a = jnp.eye(n, dtype=jnp.float32) * 0.5
    one = jax.jit(lambda a: chain(a, 4))
    jax.block_until_ready(one(a))
    per = statistics.median(timed(one, a) for _ in range(9)) / 4
    return WORLD.bcast(max(1, round(seconds / per)) if RANK == 0 else None)


def step_programs(k, late_rank, x_like):
    """Programs of one step per mode: the chain and an allreduce of x.

    On late_rank the allreduce's input depends on the chain; elsewhere it does not.
    """
    late = RANK == late_rank

    def step(x, a, overlapped):
        c = chain(a, k)
        if late:
            # x needs the chain (a data dependence XLA cannot fold away; an
            # optimization_barrier is no thunk, so XLA:CPU does not order by it).
            x = x + jnp.where(jnp.isnan(c[0, 0]), 1.0, 0.0).astype(x.dtype)
        with mpicoll.overlap(overlapped):
            return mpicoll.allreduce(x), c

    programs = {
        "compute": jax.jit(lambda x, a: chain(a, k)),
        # Rank 0 only communicates; the late rank still computes first.
        "communication": jax.jit(lambda x, a: step(x, a, False) if late
                                 else mpicoll.allreduce(x)),
        "sync": jax.jit(lambda x, a: step(x, a, False)),
        "overlapped": jax.jit(lambda x, a: step(x, a, True)),
    }
    return programs


def report_case(title, times, target):
    med = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
    bound = max(med["compute"], med["communication"])
    say(title)
    say(f"  rank 0, median ms: compute alone {med['compute']:.2f}, communication alone "
        f"{med['communication']:.2f}, sum {med['compute'] + med['communication']:.2f}")
    for mode in ("sync", "overlapped"):
        say(f"  step {mode:>10}: {med[mode]:7.2f} ms = {med[mode] / bound:.2f} x max(compute, "
            f"communication)   (target for overlapped: <= {target})")
    return med


def latency_case(runs, compute_ms):
    n = 256
    k = calibrate(compute_ms * 1e-3, n)
    x = jnp.full((1024,), float(RANK + 1), jnp.float32)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32) / np.sqrt(n)
    programs = step_programs(k, late_rank=1, x_like=x)
    for mode in ("sync", "overlapped"):  # results checked against numpy
        total, _ = programs[mode](x, a)
        np.testing.assert_allclose(np.asarray(total), SIZE * (SIZE + 1) / 2)
    times = rotate(programs, {mode: (x, a) for mode in programs}, runs)
    return report_case(f"latency case: rank 1 reaches a 4 KiB allreduce after {k} matmuls "
                       f"{n}x{n} (~{compute_ms:g} ms), rank 0 has the same compute independent "
                       f"of it; {SIZE} ranks, {runs} runs", times, 1.3)


def bandwidth_case(runs):
    nbytes = 16 << 20
    x = jnp.full((nbytes // 4,), float(RANK + 1), jnp.float32)
    alone = jax.jit(mpicoll.allreduce)
    jax.block_until_ready(alone(x))
    comm_s = statistics.median(WORLD.allreduce(timed(alone, x), op=MPI.MAX) for _ in range(7))
    n = 512
    k = calibrate(comm_s, n)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32) / np.sqrt(n)
    programs = step_programs(k, late_rank=-1, x_like=x)
    programs["communication"] = alone
    times = rotate(programs, {mode: (x, a) if mode != "communication" else (x,)
                              for mode in programs}, runs)
    return report_case(f"bandwidth case: a 16 MiB allreduce and {k} independent matmuls "
                       f"{n}x{n} of about equal time; {SIZE} ranks, {runs} runs", times, 1.2)


def small_loop(runs, calls=2000):
    x = jnp.full((1,), float(RANK), jnp.float32)

    def loop(overlapped):
        def body(i, x):
            with mpicoll.overlap(overlapped):
                return mpicoll.allreduce(x, "max")
        return jax.jit(lambda x: lax.fori_loop(0, calls, body, x))

    programs = {"sync": loop(False), "overlapped": loop(True)}
    for program in programs.values():
        assert float(program(x)[0]) == SIZE - 1
    times = rotate(programs, {mode: (x,) for mode in programs}, runs)
    slowest = {mode: [WORLD.allreduce(t, op=MPI.MAX) / calls for t in ts]
               for mode, ts in times.items()}
    med = {mode: statistics.median(t) * 1e6 for mode, t in slowest.items()}
    say(f"small messages: jitted fori_loop of {calls} 4-byte allreduces, slowest rank, "
        f"median of {runs} runs: sync {med['sync']:.2f} us per call, overlapped "
        f"{med['overlapped']:.2f} us per call ({med['overlapped'] / med['sync']:.1f} x)")
    return med


def main():
    cores, bound = os.cpu_count(), len(os.sched_getaffinity(0))
    ranks_here = WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    say(f"overlap benchmark: {SIZE} ranks, {cores} cores for {ranks_here} ranks on this node "
        f"(rank 0 may run on {bound}), "
        f"jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        f"{MPI.Get_library_version().splitlines()[0]}, load average "
        f"{os.getloadavg()[0]:.1f}")
    latency_case(args.runs, args.compute_ms)
    if not args.skip_small:
        small_loop(args.runs)
    if args.bandwidth or min(cores // ranks_here, bound) >= 4:
        bandwidth_case(args.runs)
    else:
        say(f"bandwidth case: not measured ({cores} cores for {ranks_here} ranks; it needs "
            "spare cores per rank, as shared-memory MPI copies with the CPU; run on a "
            "machine with >= 4 cores per rank, with mpiexec --bind-to none (Open MPI binds "
            "each rank to one core), or force it with --bandwidth)")


if __name__ == "__main__":
    sys.exit(main())

"""What passing a token through a jitted kernel costs, as mpi4jax <= 0.7 programs do.

    mpiexec -n 2 python benchmarks/token_cost.py [--runs 9] [--calls 2000]

Programs of the token era pass the last token into and out of every jitted
kernel.  mpicoll.mpi4jax hands out an empty pytree as its token, which adds no
argument and no result to the kernel; this measures that it keeps the kernel
as fast as the same kernel without a token (the target: at most 1.2x), beside
the two alternatives it was chosen over: an empty bool array (an extra result)
and a JAX token (jax.lax.create_token()), which JAX's C++ dispatch does not take.

Rows, each the median over runs of (time of `calls` calls) / calls, the slowest
rank's; the rows are interleaved run by run so that load drift hits all alike;
every run starts after a warm-up call and ends with block_until_ready:

  kernel                  jax.jit(lambda x: x + 1) on a float32[4]  (reference)
  + mpicoll's token       jax.jit(lambda x, t: (x + 1, t)), t = mpicoll's token
  + empty bool array      the same kernel, t = jnp.zeros((0,), bool)
  + JAX token             the same kernel, t = jax.lax.create_token()
  sendrecv kernel         jax.jit: x + 1, then mpi4jax.sendrecv around a ring (0.9's form)
  + mpicoll's token       the same in 0.7's form: (result, token) = sendrecv(..., token=t)
  + JAX token             0.7's form, the token a JAX token

Prints a table with each row's ratio to its reference and the verdict on the
limit, and writes benchmarks/results/token_cost.json (--output).  Measured on
2 cores, 2 ranks, jax 0.10.2: kernel 4.9-5.1 us, with mpicoll's token 1.08-1.14x,
with an empty bool array 1.28-1.43x, with a JAX token 19-20x (~96 us); the
sendrecv kernel 7.6-7.9 us, with mpicoll's token 1.09-1.14x, a JAX token 13-14x.
"""

import argparse
import json
import platform
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll.mpi4jax as mpi4jax
import timing

WORLD = MPI.COMM_WORLD
TIMER = timing.mpi_timer(WORLD)
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
LEFT, RIGHT = (RANK - 1) % SIZE, (RANK + 1) % SIZE
RESULTS = Path(__file__).resolve().parent / "results" / "token_cost.json"
LIMIT = 1.2  # the target: a kernel passing mpicoll's token, against the same kernel without


def cases():
    """{row: (its reference row or None, a function making one call)}, in the table's order."""
    x = jnp.ones(4, jnp.float32)
    ours = mpi4jax.barrier(token=None)  # mpicoll's token, as a first call hands it out
    empty = jnp.zeros((0,), jnp.bool_)
    jax_token = jax.lax.create_token()

    kernel = jax.jit(lambda x: x + 1)
    passing = jax.jit(lambda x, t: (x + 1, t))
    ring = jax.jit(lambda x: mpi4jax.sendrecv(x + 1, x, LEFT, RIGHT))
    ring_tokens = jax.jit(lambda x, t: mpi4jax.sendrecv(x + 1, x, LEFT, RIGHT, token=t))
    return {
        "kernel": (None, lambda: kernel(x)),
        "kernel + mpicoll's token": ("kernel", lambda: passing(x, ours)),
        "kernel + empty bool array": ("kernel", lambda: passing(x, empty)),
        "kernel + JAX token": ("kernel", lambda: passing(x, jax_token)),
        "sendrecv kernel": (None, lambda: ring(x)),
        "sendrecv kernel + mpicoll's token": ("sendrecv kernel", lambda: ring_tokens(x, ours)),
        "sendrecv kernel + JAX token": ("sendrecv kernel", lambda: ring_tokens(x, jax_token)),
    }


def time_calls(call, calls):
    """Seconds per call of `calls` calls, the slowest rank's (the ranks start together)."""
    def run(k):
        for _ in range(k):
            result = call()
        jax.block_until_ready(result)

    jax.block_until_ready(call())  # warm-up: compiled, dispatched once
    return TIMER.measure(run, calls) / calls


def check(rows):
    """Every row's result against numpy once: x + 1 (from the left neighbour: the same)."""
    for name, (reference, call) in rows.items():
        out = jax.block_until_ready(call())
        value = out[0] if reference else out  # the rows with a token return (x + 1, token)
        np.testing.assert_array_equal(np.asarray(value), np.full(4, 2, np.float32), err_msg=name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--output", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args()
    rows = cases()
    check(rows)
    samples = {name: [] for name in rows}
    for _ in range(args.runs):
        for name, (_, call) in rows.items():
            # A JAX token takes the slow path: fewer calls keep the run short.
            calls = args.calls // 10 if "JAX token" in name else args.calls
            samples[name].append(time_calls(call, calls))
    medians = {name: statistics.median(times) * 1e6 for name, times in samples.items()}
    if RANK != 0:
        return
    print(f"token cost: {SIZE} rank(s), jax {jax.__version__}, medians of {args.runs} runs "
          f"of {args.calls} calls (JAX token rows: {args.calls // 10}), slowest rank")
    print(f"{'kernel':<36}{'us/call':>10}{'ratio':>8}")
    report = {}
    for name, (reference, _) in rows.items():
        ratio = medians[name] / medians[reference] if reference else 1.0
        print(f"{name:<36}{medians[name]:>10.2f}{ratio:>8.2f}")
        report[name] = {"us_per_call": medians[name], "reference": reference, "ratio": ratio}
    worst = max(report[name]["ratio"] for name in report if "mpicoll's token" in name)
    verdict = "ok" if worst <= LIMIT else "OVER"
    print(f"mpicoll's token: at most {worst:.2f}x the same kernel without ({verdict}, "
          f"limit {LIMIT}x)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "ranks": SIZE, "jax": jax.__version__, "machine": platform.node(),
        "runs": args.runs, "calls": args.calls, "rows": report, "limit": LIMIT,
        "worst_ratio_mpicoll_token": worst}, indent=1) + "\n")


if __name__ == "__main__":
    main()

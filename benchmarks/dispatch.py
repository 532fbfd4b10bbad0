"""What a collective adds to a jitted step dispatched from a Python loop, and to an eager call.

    mpiexec -n 2 python benchmarks/dispatch.py [--runs 15] [--calls 2000]

Rows, each the median over runs of (time of `calls` calls) / calls, the
slowest rank's time, every row in one run with the rows interleaved run by run
so that load drift hits all alike:

  step, 1 array       jax.jit(lambda x: x + 1) on a float32[1]        (reference)
  + allreduce         jax.jit(lambda x: allreduce(x) + 1), compiled in the
                      default "device-order" dispatch mode (no runtime token)
  + allreduce, tokens the same program compiled with mpicoll.set_dispatch("tokens")
                      (JAX's runtime tokens, mpicoll's token fast path)
  + allreduce, JAX's  tokens mode with JAX's own runtime-token method
                      (mpicoll skips a resharding of the token; see _compat.dispatch_hooks)
  step, 100 arrays    jax.jit over a list of 100 float32[1]: each + 1  (reference)
  + allreduce         the list allreduced (one fused call) then + 1, device order
  + allreduce, tokens the same in tokens mode
  eager allreduce     mpicoll.allreduce(x) on a float32[1] jax array, then mpi4py's
                      comm.Allreduce on numpy float32[1] buffers       (reference)
  JAX eager, no MPI   jax.jit(lambda x: x + 1) on the same array, completed each call
                      (block_until_ready): JAX's cheapest eager dispatch.  The line
                      under the table divides the eager allreduce by it + mpi4py's
                      Allreduce (the MPI floor as Python reaches it)

A Python loop calls the jitted function and keeps the last result; the run
ends with block_until_ready.  Results are checked once against numpy.  Prints a
table and writes benchmarks/results/dispatch.json (docs/dispatch-2.json is a
copy, which the performance page's table is generated from): per row its
(op, bytes, impl) for the table, the median in µs.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as _jax_dispatch
from mpi4py import MPI

import mpicoll
from mpicoll._src import _compat
import timing

WORLD = MPI.COMM_WORLD
TIMER = timing.mpi_timer(WORLD)
RESULTS = Path(__file__).resolve().parent / "results" / "dispatch.json"
# Each row as a cell of the docs' table: (op, bytes per array, implementation).
TABLE_CELLS = {
    "step, 1 array": ("step of 1 array", 4, "step"),
    "  + allreduce": ("step of 1 array", 4, "+ allreduce"),
    "  + allreduce, tokens": ("step of 1 array", 4, "+ allreduce, tokens"),
    "  + allreduce, JAX's tokens": ("step of 1 array", 4, "+ allreduce, JAX's tokens"),
    "step, 100 arrays": ("step of 100 arrays", 4, "step"),
    "  + allreduce (fused)": ("step of 100 arrays", 4, "+ allreduce"),
    "  + allreduce (fused), tokens": ("step of 100 arrays", 4, "+ allreduce, tokens"),
    "mpi4py Allreduce 4 B": ("allreduce", 4, "mpi4py"),
    "eager allreduce 4 B": ("allreduce", 4, "mpicoll eager"),
    "JAX eager, no MPI": ("allreduce", 4, "JAX eager, no MPI"),
}


def python_loop(function, argument, calls):
    result = function(argument)
    for _ in range(calls - 1):
        result = function(argument)
    jax.block_until_ready(result)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    size = WORLD.Get_size()
    one = jnp.ones(1, jnp.float32)
    many = [jnp.ones(1, jnp.float32) for _ in range(100)]
    jax_tokens, mpicolls_tokens = _compat.runtime_token_methods()
    token_set = _jax_dispatch.RuntimeTokenSet

    def with_jax_tokens(function):
        # JAX's own method alone (mpicoll's dispatch hooks around its fast path leave
        # a one-device program's token as it is in tokens mode): what JAX pays
        def run(argument):
            token_set.get_token_input = jax_tokens
            try:
                return function(argument)
            finally:
                token_set.get_token_input = mpicolls_tokens
        return run

    step = jax.jit(lambda x: x + 1)

    def step_completed(x):
        return step(x).block_until_ready()
    tree_step = jax.jit(lambda xs: [x + 1 for x in xs])

    def compiled_in(mode):
        """The two programs with a collective, lowered in dispatch mode `mode`."""
        previous = mpicoll.set_dispatch(mode)
        try:
            one_step = jax.jit(lambda x: mpicoll.allreduce(x) + 1)
            tree = jax.jit(lambda xs: [x + 1 for x in mpicoll.allreduce(xs)])
            one_step(one), tree(many)  # lowered now, in this mode
        finally:
            mpicoll.set_dispatch(previous)
        return one_step, tree

    step_allreduce, tree_allreduce = compiled_in("device-order")
    step_tokens, tree_tokens = compiled_in("tokens")
    send, receive = np.ones(1, np.float32), np.empty(1, np.float32)

    def mpi4py_allreduce(_):
        WORLD.Allreduce(send, receive)
        return receive

    rows = {
        "step, 1 array": (lambda a: python_loop(step, one, a), None),
        "  + allreduce": (lambda a: python_loop(step_allreduce, one, a), "step, 1 array"),
        "  + allreduce, tokens": (lambda a: python_loop(step_tokens, one, a),
                                  "step, 1 array"),
        "  + allreduce, JAX's tokens": (
            lambda a: with_jax_tokens(lambda c: python_loop(step_tokens, one, c))(a),
            "step, 1 array"),
        "step, 100 arrays": (lambda a: python_loop(tree_step, many, a), None),
        "  + allreduce (fused)": (lambda a: python_loop(tree_allreduce, many, a),
                                  "step, 100 arrays"),
        "  + allreduce (fused), tokens": (lambda a: python_loop(tree_tokens, many, a),
                                          "step, 100 arrays"),
        "mpi4py Allreduce 4 B": (lambda a: python_loop(mpi4py_allreduce, None, a), None),
        "eager allreduce 4 B": (lambda a: python_loop(mpicoll.allreduce, one, a),
                                "mpi4py Allreduce 4 B"),
        "JAX eager, no MPI": (lambda a: python_loop(step_completed, one, a), None),
    }
    checks = {"  + allreduce": (step_allreduce(one), size + 1.0),
              "  + allreduce, tokens": (step_tokens(one), size + 1.0),
              "  + allreduce (fused)": (tree_allreduce(many)[-1], size + 1.0),
              "  + allreduce (fused), tokens": (tree_tokens(many)[-1], size + 1.0),
              "eager allreduce 4 B": (mpicoll.allreduce(one), float(size))}
    for name, (value, expected) in checks.items():
        assert float(np.asarray(value)[0]) == expected, (name, value, expected)
    times = {name: [] for name in rows}
    for _ in range(2):  # warm-up
        for name, (run, _) in rows.items():
            run(20)
    names = list(rows)
    for i in range(args.runs):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(TIMER.measure(rows[name][0], args.calls) / args.calls)
    if WORLD.Get_rank() == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"dispatch from a Python loop, {size} rank(s), median of {args.runs} runs x "
              f"{args.calls} calls, jax {jax.__version__}, {MPI.Get_library_version().splitlines()[0][:40]}")
        print(f"{'':32} {'us/call':>9} {'x reference':>12}")
        for name, (_, reference) in rows.items():
            ratio = f"{medians[name] / medians[reference]:>12.1f}" if reference else ""
            print(f"{name:32} {medians[name] * 1e6:>9.1f} {ratio}")
        floor = medians["JAX eager, no MPI"] + medians["mpi4py Allreduce 4 B"]
        eager_ratio = medians["eager allreduce 4 B"] / floor
        print(f"eager allreduce / (JAX eager + mpi4py Allreduce) = {eager_ratio:.2f}")
        cells = [dict(zip(("op", "bytes", "impl"), TABLE_CELLS[name]), name=name.strip(),
                      us=medians[name] * 1e6) for name in rows]
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(dict(
            benchmark="dispatch", processes=size, jax=jax.__version__,
            mpi=MPI.Get_library_version().splitlines()[0], host=platform.node(),
            cores=os.cpu_count(), when=time.strftime("%Y-%m-%d %H:%M"), runs=args.runs,
            calls=args.calls, eager_over_jax_and_mpi=eager_ratio, load_average=[load_start, os.getloadavg()[0]], rows=cells),
            indent=1) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

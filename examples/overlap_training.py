"""Data-parallel training where each layer's gradients are allreduced as soon as they exist.

    mpiexec -n 2 python examples/overlap_training.py [--steps 20]

The backward pass computes the last layer's gradients first.  The step
allreduces the layers' gradients in that order (last layer first), each layer
as its own call, so under `mpicoll.overlap()` a layer's allreduce runs on
mpicoll's progress thread while XLA computes the gradients of the layers
below it (what Horovod and PyTorch DDP do with gradient buckets).  The same
step without `overlap()` runs every allreduce on XLA's thread.

Prints the median step time with and without overlap (and of the step without
any communication, for scale), then checks itself: both variants give the
same parameters, identical on every rank, and equal to one process training on
the whole batch.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll

WORLD = MPI.COMM_WORLD
rank, size = WORLD.Get_rank(), WORLD.Get_size()
WIDTH, LAYERS, GLOBAL_BATCH, LEARNING_RATE = 512, 6, 256, 0.01


def init_params():
    rng = np.random.default_rng(0)
    return [(jnp.asarray(rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH), jnp.float32),
             jnp.zeros(WIDTH, jnp.float32)) for _ in range(LAYERS)]


def loss(params, x, y):
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return jnp.mean((x @ w + b - y) ** 2)


def make_step(communicate, overlapped):
    @jax.jit
    def step(params, x, y):
        grads = jax.grad(loss)(params, x, y)
        if communicate:
            # Last layer first: the order in which backpropagation produces them.
            with mpicoll.overlap(overlapped):
                for layer in reversed(range(LAYERS)):
                    grads[layer] = mpicoll.allreduce(grads[layer])
            grads = jax.tree.map(lambda g: g / size, grads)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return step


def batch(i, n):
    """Batch i of the synthetic data set: (x, y) of n rows."""
    rng = np.random.default_rng(100 + i)
    x = rng.normal(size=(n, WIDTH)).astype(np.float32)
    return x, np.sin(x[:, ::-1]).astype(np.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    args = parser.parse_args()
    local = GLOBAL_BATCH // size
    steps = {"overlapped": make_step(True, True), "synchronous": make_step(True, False),
             "no communication": make_step(False, False)}
    params = {name: init_params() for name in steps}
    times = {name: [] for name in steps}
    for i in range(args.steps + 3):  # 3 warm-up steps (compilation)
        x, y = batch(i, GLOBAL_BATCH)
        shard = (x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
        for j, name in enumerate(steps):  # variants in rotation, against load drift
            name = list(steps)[(i + j) % len(steps)]
            WORLD.Barrier()
            start = time.perf_counter()
            params[name] = jax.block_until_ready(steps[name](params[name], *shard))
            if i >= 3:
                times[name].append(WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX))
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    if rank == 0:
        print(f"overlap_training: {size} rank(s), {LAYERS} layers of {WIDTH}x{WIDTH}, "
              f"batch {local} per rank, median of {args.steps} steps (slowest rank)")
        for name, ms in medians.items():
            print(f"  step {name:>16}: {ms:8.2f} ms")
        print(f"  overlapped / synchronous: {medians['overlapped'] / medians['synchronous']:.2f}")

    # Checks: overlap changes nothing in the result; ranks agree; one process agrees.
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params["overlapped"]),
                                                    jax.tree.leaves(params["synchronous"])))
    mine = np.concatenate([np.ravel(p) for p in jax.tree.leaves(params["overlapped"])])
    identical = all(np.array_equal(mine, other) for other in WORLD.allgather(mine))
    reference = init_params()
    single = jax.jit(lambda p, x, y: jax.tree.map(
        lambda p, g: p - LEARNING_RATE * g, p, jax.grad(loss)(p, x, y)))
    for i in range(args.steps + 3):
        reference = single(reference, *batch(i, GLOBAL_BATCH))
    difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                     zip(jax.tree.leaves(params["overlapped"]), jax.tree.leaves(reference)))
    ok = same and identical and difference < 1e-4
    if rank == 0:
        print(f"  overlapped and synchronous parameters equal: {same}; identical on every "
              f"rank: {identical}; max difference from single-process training: "
              f"{difference:.2e}")
        print("overlap_training: ok" if ok else "overlap_training: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

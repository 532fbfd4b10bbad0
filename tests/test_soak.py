"""Soak: tens of thousands of random collectives, each checked, without memory growth.

A seeded random generator, identical on every rank, draws a sequence of
batches.  Each batch picks a program configuration (dtype and block shape from
a small fixed set, so compiled programs are reused) and a mode:

* jit: one compiled program, a lax.scan over K steps, each step running one
  collective chosen by a random index (lax.switch) from a table of every
  collective with every root, allreduce with every op valid for the dtype,
  and reduce with every op and every root; each step gets fresh data;
* eager: K steps of the same random choice as separate eager calls.

Every step's result is compared with numpy on every rank's regenerated input
(conftest.rank_data); failures are collected and compared across ranks at the
end, so a wrong result on one rank cannot leave the others waiting.  RSS is
measured after a warm-up pass (every program compiled, every eager program
cached) and at the end: it must not grow by more than RSS_GROWTH_LIMIT.

Every step's input has shape (size, *s), so every collective applies to it:
scatter/alltoall as is, gather/allgather to its first block, the others to the
whole; outputs are brought to a common shape (size, *s) for lax.switch (scatter
gives s, broadcast to (size, *s)).
"""

import gc
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

import mpicoll
from conftest import (OPS, RANK, SIZE, VALID_PAIRS, WORLD, all_ranks_data, assert_in_step,
                      expected)

SEED = 20240607
# (dtype, block shape s): one jitted program each; inputs are (size, *s).
CONFIGS = [
    (np.dtype(np.bool_), (3,)),
    (np.dtype(np.int32), ()),
    (np.dtype(np.uint8), (2, 5)),
    (np.dtype(ml_dtypes.bfloat16), (3,)),
    (np.dtype(np.float64), (2, 5)),
    (np.dtype(np.complex64), ()),
    (np.dtype(np.int64), (4,)),
]
EAGER_CONFIGS = (1, 3)  # indices into CONFIGS also run eagerly (each eager call compiles once)
JIT_STEPS = 256  # collectives per jitted batch (the scan length: one compile per config)
EAGER_STEPS = 24  # collectives per eager batch
# 22,272 + ~1,000 collectives at 1 and 2 ranks; with more ranks (oversubscribed
# on a 2-core CI machine, every collective is much slower) a third of that.
JIT_BATCHES = 80 if SIZE <= 2 else 27
EAGER_BATCHES = 40 if SIZE <= 2 else 13
MIN_COLLECTIVES = 20_000 if SIZE <= 2 else 7_000
RSS_GROWTH_LIMIT = 50 * 2**20  # bytes


def branches(dtype):
    """[(name, root, op)] for every collective, root and valid op; op None if not reducing."""
    ops = [op for op in OPS if (op, dtype) in VALID_PAIRS]
    table = [("bcast", root, None) for root in range(SIZE)]
    table += [("scatter", root, None) for root in range(SIZE)]
    table += [("gather", root, None) for root in range(SIZE)]
    table += [("allgather", 0, None), ("alltoall", 0, None)]
    table += [("allreduce", 0, op) for op in ops]
    # reduce: every op and every root, not every pair (fewer branches to compile).
    pairs = {(j % SIZE, op) for j, op in enumerate(ops)}
    pairs |= {(root, ops[root % len(ops)]) for root in range(SIZE)}
    table += [("reduce", root, op) for root, op in sorted(pairs)]
    return table


def run_branch(name, root, op, x):
    """One collective on x of shape (size, *s); output of shape (size, *s)."""
    if name == "bcast":
        return mpicoll.bcast(x, root)
    if name == "scatter":
        return jnp.broadcast_to(mpicoll.scatter(x, root)[None], x.shape)
    if name == "gather":
        return mpicoll.gather(x[0], root)
    if name == "allgather":
        return mpicoll.allgather(x[0])
    if name == "alltoall":
        return mpicoll.alltoall(x)
    if name == "allreduce":
        return mpicoll.allreduce(x, op)
    return mpicoll.reduce(x, op, root)


def reference(name, root, op, stack):
    """What run_branch returns on this rank, from every rank's input stacked by rank."""
    if name == "scatter":
        return np.broadcast_to(expected("scatter", stack, root=root)[None], stack.shape[1:])
    if name in ("gather", "allgather"):
        return expected(name, stack[:, 0], root=root)
    return expected(name, stack, root=root, op=op or "sum")


def jitted_program(table):
    """scan over (index, x) pairs: step k runs table[index[k]] on x[k]."""
    functions = [lambda x, b=b: run_branch(*b, x) for b in table]

    @jax.jit
    def program(indices, xs):
        def step(carry, args):
            index, x = args
            return carry, lax.switch(index, functions, x)
        return lax.scan(step, 0, (indices, xs))[1]

    return program


def batch_inputs(table, indices, dtype, s, seed):
    """Every rank's input for every step, (ranks, steps, size, *s): data of the kind each
    step's op needs (exact sums/products for every dtype), independent of MPI."""
    steps = len(indices)
    kinds = [table[i][2] for i in indices]  # None (movement) or the reduction op
    stacks = {kind: all_ranks_data((steps, SIZE, *s), dtype, seed=seed, kind=kind)
              for kind in set(kinds)}
    return np.stack([stacks[kind][:, k] for k, kind in enumerate(kinds)], axis=1)


def mismatches(table, indices, data, outputs, label):
    """Descriptions of the steps whose output differs from numpy."""
    found = []
    for k, index in enumerate(indices):
        name, root, op = table[index]
        want = reference(name, root, op, data[:, k])
        got = np.asarray(outputs[k])
        if got.dtype != want.dtype or got.shape != want.shape:
            found.append(f"{label} step {k} {table[index]}: {got.dtype}{got.shape} "
                         f"!= {want.dtype}{want.shape}")
            continue
        if got.dtype == np.dtype(ml_dtypes.bfloat16):
            got, want = got.astype(np.float32), want.astype(np.float32)
        if not np.array_equal(got, want):
            found.append(f"{label} step {k} {table[index]}: {got!r} != {want!r}")
    return found


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def test_soak_random_collectives_checked_and_no_memory_growth():
    rng = np.random.default_rng(SEED)  # the same on every rank: the same sequence
    tables = [branches(dtype) for dtype, _ in CONFIGS]
    programs = [jitted_program(table) for table in tables]
    failures, counts = [], {"jit": 0, "eager": 0}
    seed = iter(range(10**9))

    def run_batch(config, mode, indices):
        dtype, s = CONFIGS[config]
        table = tables[config]
        data = batch_inputs(table, indices, dtype, s, next(seed))
        mine = data[RANK]
        if mode == "jit":
            outputs = programs[config](jnp.asarray(indices, jnp.int32), mine)
        else:
            outputs = [run_branch(*table[i], mine[k]) for k, i in enumerate(indices)]
        counts[mode] += len(indices)
        failures.extend(mismatches(table, indices, data, outputs, f"{mode} {dtype}{s}"))

    # Warm-up: every program compiled, every eager branch of EAGER_CONFIGS cached.
    start = time.perf_counter()
    for config, table in enumerate(tables):
        run_batch(config, "jit", rng.integers(0, len(table), JIT_STEPS))
        if config in EAGER_CONFIGS:
            run_batch(config, "eager", np.arange(len(table)))
    warmup_seconds = time.perf_counter() - start
    gc.collect()
    rss_after_warmup = rss_bytes()

    start = time.perf_counter()
    plan = ["jit"] * JIT_BATCHES + ["eager"] * EAGER_BATCHES
    for mode in rng.permutation(plan):
        if mode == "jit":
            config = int(rng.integers(len(CONFIGS)))
            run_batch(config, "jit", rng.integers(0, len(tables[config]), JIT_STEPS))
        else:
            config = int(rng.choice(EAGER_CONFIGS))
            run_batch(config, "eager", rng.integers(0, len(tables[config]), EAGER_STEPS))
    seconds = time.perf_counter() - start
    gc.collect()
    growth = rss_bytes() - rss_after_warmup

    total = counts["jit"] + counts["eager"]
    print(f"\nsoak on {SIZE} rank(s): {total} collectives ({counts['jit']} jitted, "
          f"{counts['eager']} eager), warm-up {warmup_seconds:.1f} s, then {seconds:.1f} s; "
          f"RSS {rss_after_warmup / 2**20:.0f} MiB after warm-up, growth "
          f"{growth / 2**20:+.1f} MiB")
    assert_in_step(12)
    everyone = WORLD.allgather((len(failures), failures[:5], growth))
    assert all(n == 0 for n, _, _ in everyone), [f for _, f, _ in everyone]
    assert total >= MIN_COLLECTIVES, total
    assert max(g for _, _, g in everyone) < RSS_GROWTH_LIMIT, \
        [f"rank {r}: {g / 2**20:+.1f} MiB" for r, (_, _, g) in enumerate(everyone)]

"""Overlapped collectives (`with mpicoll.overlap():`): same results, same order, same guarantees.

An overlapped call runs on its device's progress thread while XLA computes;
these tests check what must not change: results against numpy on every rank's
data, program order with synchronous calls interleaved on several
communicators, the check across ranks (which also sees a rank that overlaps a
call another rank does not) and errors raised as JaxRuntimeError.  Whether
the overlap saves time is measured in benchmarks/overlap.py (`make bench`).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mpicoll
from conftest import (COLLECTIVES, RANK, SIZE, WORLD, all_ranks_data, assert_in_step,
                      assert_same, call, expected, input_shape, reduce_reference, serial_only)
from test_faults import assert_aborted_by_timeout


def _targets(program, *args):
    """The FFI targets the program's collectives lower to."""
    return set(re.findall(r"custom_call @(\w+)\(", program.lower(*args).as_text()))


def _overlapped(fn):
    """jit(fn) with every collective in it traced inside mpicoll.overlap()."""
    def traced(*args):
        with mpicoll.overlap():
            return fn(*args)
    return jax.jit(traced)


@pytest.mark.parametrize("name", COLLECTIVES)
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.complex64])
def test_each_collective_overlapped_matches_numpy(name, dtype):
    stack = all_ranks_data(input_shape(name, (3, 2)), dtype, seed=7)
    root = (SIZE - 1) if name in ("bcast", "scatter", "reduce", "gather") else 0
    program = _overlapped(lambda x: call(name, x, root))
    targets = _targets(program, stack[RANK])
    out = program(stack[RANK])
    assert targets == {f"mpicoll_{name}_overlapped"}, targets
    assert_same(out, expected(name, stack, root=root))


def test_overlapped_reduce_scatter_scan_exscan_and_large_array():
    rows = all_ranks_data((SIZE, 5), np.int32, seed=3, kind="sum")
    flat = all_ranks_data((4,), np.float64, seed=4, kind="sum")
    big = all_ranks_data((1 << 18,), np.float32, seed=5, kind="sum")  # 1 MiB per rank
    program = _overlapped(lambda r, f, b: (mpicoll.reduce_scatter(r), mpicoll.scan(f),
                                           mpicoll.exscan(f), mpicoll.allreduce(b)))
    rs, sc, ex, total = program(rows[RANK], flat[RANK], big[RANK])
    assert_same(rs, reduce_reference(rows, "sum")[RANK])
    assert_same(sc, reduce_reference(flat[:RANK + 1], "sum"))
    assert_same(ex, reduce_reference(flat[:RANK], "sum") if RANK else np.zeros(4))
    assert_same(total, reduce_reference(big, "sum"))


def test_overlapped_pytree_fuses_small_leaves_and_sends_large_ones_alone():
    tree = {"w": all_ranks_data((600, 200), np.float32, seed=1, kind="sum"),  # 480 KB: alone
            "b": all_ranks_data((200,), np.float32, seed=2, kind="sum"),
            "c": all_ranks_data((3,), np.float32, seed=3, kind="sum")}
    program = _overlapped(lambda t: mpicoll.allreduce(t))
    mine = {k: v[RANK] for k, v in tree.items()}
    targets = _targets(program, mine)
    out = program(mine)
    # b and c in one message, w alone
    assert targets == {"mpicoll_allreduce_overlapped_fused", "mpicoll_allreduce_overlapped"}
    for key, stack in tree.items():
        assert_same(out[key], reduce_reference(stack, "sum"))


def test_overlapped_vector_and_point_to_point():
    counts = tuple(r % 3 + 1 for r in range(SIZE))
    rows = [all_ranks_data((counts[r], 2), np.float32, seed=20)[r] for r in range(SIZE)]
    ring = all_ranks_data((4,), np.int32, seed=21)
    program = _overlapped(lambda x, y: (
        mpicoll.allgatherv(x, counts),
        mpicoll.sendrecv(y, source=(RANK - 1) % SIZE, dest=(RANK + 1) % SIZE)))
    gathered, received = program(rows[RANK], ring[RANK])
    assert_same(gathered, np.concatenate(rows))
    assert_same(received, ring[(RANK - 1) % SIZE])


def test_overlapped_calls_in_a_loop_with_computation_between():
    """A fori_loop whose body computes while its overlapped allreduce runs."""
    x0 = all_ranks_data((64,), np.float64, seed=8, kind="sum")
    steps = 25

    def body(i, carry):
        x, acc = carry
        with mpicoll.overlap():
            total = mpicoll.allreduce(x)
        acc = acc + jnp.tanh(acc @ acc.T)[:, :1].sum()  # independent of total
        return total / SIZE + i, acc

    program = jax.jit(lambda x: lax.fori_loop(0, steps, body, (x, jnp.eye(32))))
    out, _ = program(x0[RANK])
    expect = x0.mean(axis=0)
    for i in range(steps):
        expect = expect + i
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-12)


# ---------------------------------------------------------------------------
# Ordering: a random program of overlapped and synchronous collectives on three
# communicators, the same on every rank (one seed), run in a loop and
# simulated in numpy for every rank.

KINDS = ("allreduce", "bcast", "allgather", "scan", "barrier")


def _random_program(seed, length):
    rng = np.random.default_rng(seed)
    return [(KINDS[rng.integers(len(KINDS))], int(rng.integers(3)), bool(rng.integers(2)),
             int(rng.integers(3))) for _ in range(length)]


def _groups(colors):
    """For each rank, the ranks of its communicator, in that communicator's rank order."""
    return [[m for m in range(SIZE) if colors[m] == colors[r]] for r in range(SIZE)]


def _step_traced(kind, comm, x, rank):
    if kind == "allreduce":
        return mpicoll.allreduce(x, comm=comm)
    if kind == "bcast":
        return mpicoll.bcast(x, 0, comm=comm)
    if kind == "allgather":
        everyone = mpicoll.allgather(x, comm=comm)
        return everyone[0] + everyone[-1]
    if kind == "scan":
        return mpicoll.scan(x, comm=comm)
    mpicoll.barrier(comm=comm)
    return x


def _step_numpy(kind, group, states):
    """The new value on each rank: states[r] is rank r's value before the step."""
    if kind == "allreduce":
        return [np.sum([states[m] for m in group[r]], axis=0, dtype=np.int32)
                for r in range(SIZE)]
    if kind == "bcast":
        return [states[group[r][0]] for r in range(SIZE)]
    if kind == "allgather":
        return [states[group[r][0]] + states[group[r][-1]] for r in range(SIZE)]
    if kind == "scan":
        return [np.sum([states[m] for m in group[r][:group[r].index(r) + 1]], axis=0,
                       dtype=np.int32) for r in range(SIZE)]
    return list(states)


def test_ordering_stress_random_overlapped_and_sync_calls_on_three_communicators():
    colors = {0: [0] * SIZE, 1: [0] * SIZE, 2: [r % 2 for r in range(SIZE)]}
    comms = [WORLD, WORLD.Dup(), WORLD.Split(RANK % 2, RANK)]
    groups = {c: _groups(colors[c]) for c in colors}
    program_spec = _random_program(seed=1234, length=24)
    iterations = 90  # 24 * 90 = 2,160 collectives per rank
    sizes = (4, 1000, 30000)  # int32 elements per slot: 16 B, 4 KB, 120 KB
    try:
        def body(i, slots):
            slots = list(slots)
            for kind, c, overlapped, slot in program_spec:
                with mpicoll.overlap(overlapped):
                    slots[slot] = _step_traced(kind, comms[c], slots[slot], RANK)
                slots[slot] = slots[slot] + (RANK + 1) * (i + 1)
            return tuple(slots)

        start = tuple(jnp.asarray(all_ranks_data((n,), np.int32, seed=30 + n)[RANK] % 5)
                      for n in sizes)
        program = jax.jit(lambda s: lax.fori_loop(0, iterations, body, s))
        targets = _targets(program, start)
        out = jax.block_until_ready(program(start))
    finally:
        comms[1].Free()
        comms[2].Free()
    assert any(t.endswith("_overlapped") for t in targets), targets
    assert any(t in targets for t in ("mpicoll_allreduce", "mpicoll_bcast", "mpicoll_scan")), \
        targets
    states = [[all_ranks_data((n,), np.int32, seed=30 + n)[r] % 5 for r in range(SIZE)]
              for n in sizes]
    with np.errstate(over="ignore"):
        for i in range(iterations):
            for kind, c, _, slot in program_spec:
                states[slot] = _step_numpy(kind, groups[c], states[slot])
                states[slot] = [(s + np.int32((r + 1) * (i + 1))).astype(np.int32)
                                for r, s in enumerate(states[slot])]
    for slot in range(len(sizes)):
        assert_same(out[slot], states[slot][RANK])
    assert_in_step(seed=41)


# ---------------------------------------------------------------------------
# Errors: the same exception types as synchronous calls.

def test_overlapped_call_on_a_freed_communicator_raises_jax_runtime_error():
    comm = WORLD.Dup()
    program = _overlapped(lambda x: mpicoll.allreduce(x, comm=comm))
    x = jnp.arange(3.0)
    first = program(x)
    comm.Free()
    # On JAX's C++ dispatch path (device-order programs after their first call)
    # an error of a program run synchronously comes as ValueError, JAX's own
    # conversion (jax-ml/jax#34083); the message is mpicoll's either way.
    error = (jax.errors.JaxRuntimeError if mpicoll.dispatch_mode() == "tokens"
             else (jax.errors.JaxRuntimeError, ValueError))
    with pytest.raises(error, match="no communicator registered"):
        jax.block_until_ready(program(x))
    np.testing.assert_array_equal(np.asarray(first), np.arange(3.0) * SIZE)
    assert_in_step(seed=42)


def test_ranks_that_disagree_on_overlapping_a_call_get_the_mismatch_error():
    """Rank 0 overlaps the call, the others do not: the check sees it (both calls are
    new on the communicator; where one rank's call was agreed before, it does not
    check, and the watchdog ends the job naming both: tests/test_divergence.py)."""
    def step(x):
        with mpicoll.overlap(RANK == 0):
            return mpicoll.allreduce(x)

    x = jnp.ones((4, 3, 19), jnp.float32)  # a shape no other test uses
    if SIZE == 1:  # nobody to disagree with: it runs
        assert_same(jax.jit(step)(x), np.ones((4, 3, 19), np.float32))
        return
    with pytest.raises(jax.errors.JaxRuntimeError, match="ranks called different collectives"
                       r"(.|\n)*overlapped"):
        jax.block_until_ready(jax.jit(step)(x))
    mpicoll.clear_error()
    assert_in_step(seed=43)


def test_overlap_outside_jit_runs_synchronously_and_matches():
    stack = all_ranks_data((5,), np.float32, seed=44, kind="sum")
    with mpicoll.overlap():
        out = mpicoll.allreduce(stack[RANK])
    assert_same(out, reduce_reference(stack, "sum"))


@serial_only
def test_timeout_aborts_an_overlapped_call_that_never_completes():
    """The watchdog sees the progress thread's call (and its wait for the other ranks)."""
    assert_aborted_by_timeout(
        "hang-overlapped", r"mpicoll: rank 0 \(rank 0 of solver, local device "
        r"0\) has waited [\d.]+ s in allreduce \(MPICOLL_TIMEOUT={timeout}\); aborting the job")


def test_overlap_is_refused_when_lowered_for_a_gpu():
    # The documented limit (docs/overlap.md): the progress threads are CPU's.  Lowered
    # for CUDA without a GPU here; the same call outside overlap() lowers.
    x = jnp.ones(4, jnp.float32)

    def overlapped(v):
        with mpicoll.overlap():
            return mpicoll.allreduce(v)

    with pytest.raises(NotImplementedError, match=r"mpicoll.overlap\(\) runs collectives on a "
                       r"progress thread on CPU only.*'cuda'"):
        jax.jit(overlapped).trace(x).lower(lowering_platforms=("cuda",))
    jax.jit(mpicoll.allreduce).trace(x).lower(lowering_platforms=("cuda",))

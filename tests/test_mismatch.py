"""Ranks that call different collectives: by default every rank raises, nobody
gets garbage, a bare MPI abort or a hang (docs/failures.md).

The default check ("first-run") compares each call site's call across ranks
the first time it runs.  Each case here is a new program on every rank, in
eager and jitted form, run twice (the second time the site is checked again
because its first check failed; JAX runs it on its Python path again, as it
does every call whose first call failed).  After each case the ranks must
still be in step: a matching allreduce gives the right answer.  One rank
running a program from JAX's cache (jit's C++ fast path) while another runs a
new one must raise the same type there too.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from conftest import RANK, SIZE

pytestmark = pytest.mark.skipif(SIZE < 2, reason="a mismatch between ranks needs two ranks")

MISMATCH = "ranks called different collectives"


def _odd_one_out(value_on_0, value_elsewhere):
    return value_on_0 if RANK == 0 else value_elsewhere


# A shape no other test uses: the programs below are then new on every rank,
# and a call site is compared on its first run in this process.  (A rank that
# re-runs a program while another runs a new one is not compared: docs/failures.md.)
SHAPE = (7, 11)
OTHER = (7, 12)

# name -> (function, argument) whose call differs on rank 0 from the others'.
CASES = {
    "shape": (mpicoll.allreduce, lambda: jnp.ones(_odd_one_out(SHAPE, OTHER), jnp.float32)),
    "dtype": (mpicoll.allreduce,
              lambda: jnp.ones(SHAPE, _odd_one_out(jnp.float32, jnp.int32))),
    "root": (lambda x: mpicoll.bcast(x, root=_odd_one_out(0, 1)),
             lambda: jnp.ones(SHAPE, jnp.float32)),
    "op": (lambda x: mpicoll.allreduce(x, op=_odd_one_out("sum", "max")),
           lambda: jnp.ones(SHAPE, jnp.int16)),
    "collective": (_odd_one_out(mpicoll.allreduce, mpicoll.allgather),
                   lambda: jnp.ones(SHAPE, jnp.uint16)),
    "pytree": (mpicoll.allreduce, lambda: _odd_one_out(
        {"a": jnp.ones(SHAPE, jnp.int8)},
        {"a": jnp.ones(SHAPE, jnp.int8), "b": jnp.ones(SHAPE, jnp.int8)})),
    # JAX's own vocabulary over the ranks is checked like mpicoll's calls.
    "lax.psum over RANKS": (
        lambda x: jax.shard_map(lambda v: jax.lax.psum(v, mpicoll.RANKS), mesh=mpicoll.mesh(),
                                in_specs=jax.sharding.PartitionSpec(mpicoll.RANKS),
                                out_specs=jax.sharding.PartitionSpec())(x),
        lambda: jnp.ones(_odd_one_out((5, 11), (5, 12)), jnp.float32)),
    # A non-root rank passes only its own block: it rejects the call, root would
    # have run it; the rejection meets root's check, so both raise.
    "scatter block": (mpicoll.scatter, lambda: _odd_one_out(jnp.ones((SIZE, *SHAPE), jnp.float32),
                                                            jnp.ones(SHAPE, jnp.float32))),
}


def _in_step():
    out = mpicoll.allreduce(jnp.full(2, RANK + 1.0))
    np.testing.assert_array_equal(np.asarray(out), np.full(2, SIZE * (SIZE + 1) / 2))


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("case", CASES)
def test_mismatch_raises_on_every_rank_by_default(case, mode):
    assert mpicoll.check_mode() == "first-run"
    function, argument = CASES[case]
    run = jax.jit(function) if mode == "jit" else function
    for attempt in range(2):
        with pytest.raises(jax.errors.JaxRuntimeError, match=MISMATCH) as error:
            jax.block_until_ready(run(argument()))
        lines = str(error.value).splitlines()
        ranks = [line for line in lines if line.lstrip().startswith("rank ")]
        assert len(ranks) == SIZE, lines
        # Each rank's call with the user's line of it (JAX raises where it waits).
        assert all(re.search(r", called at .*test_mismatch\.py:\d+ ", line) for line in ranks), lines
        if case.startswith("lax.") and mode == "jit":  # as written, then as mpicoll runs it
            assert all("jax.lax.psum over (mpicoll.RANKS) of float32[5," in line
                       and "per device: allreduce(" in line for line in ranks), lines
    _in_step()


# One rank calls a program from JAX's cache (jit's C++ fast path), the others a new
# one (JAX's Python path); both small programs XLA runs at dispatch.  Each case:
# (check mode, jitted, a shape no other test uses).  In first-run mode the cached
# program's collective is new there (the other branch of a cond: the first call ran
# this one), so both are compared.
# Eager calls only: a jitted function's cached call runs on jit's C++ fast path,
# which raises the error as ValueError in jaxlib <= 0.10.2 (jax-ml/jax#34083);
# docs/failures.md says so.
CACHED_AND_NEW = {
    "eager, every-call": ("every-call", False, (3, 21)),
}


@pytest.mark.parametrize("case", CACHED_AND_NEW)
def test_a_cached_program_and_a_new_one_raise_the_same_type(case):
    """Every rank raises jax.errors.JaxRuntimeError, also a rank whose eager program
    ran from JAX's cache (mpicoll/_src/primitive/dispatch.py, run_eagerly)."""
    mode, jitted, shape = CACHED_AND_NEW[case]
    if jitted:
        run = jax.jit(lambda x, second: jax.lax.cond(
            second, lambda v: mpicoll.allreduce(v, op="max"), mpicoll.allreduce, x))
    else:
        run = lambda x, second: mpicoll.allreduce(x)  # noqa: E731
    cached = jnp.ones(shape, jnp.float32)
    new = jnp.ones((shape[0], shape[1] + 1), jnp.float32)
    previous = mpicoll.set_check_mode(mode)
    raised = None
    try:
        for _ in range(2):  # the first call compiles it, the second runs it from the cache
            run(cached, False).block_until_ready()
        try:
            run(_odd_one_out(cached, new), True).block_until_ready()
        except Exception as error:  # noqa: BLE001 - every rank reports what it got
            raised = error
    finally:
        mpicoll.set_check_mode(previous)
    raised_everywhere = MPI.COMM_WORLD.allgather(
        f"{type(raised).__module__}.{type(raised).__name__}")
    _in_step()
    assert raised_everywhere == ["jax.errors.JaxRuntimeError"] * SIZE, raised_everywhere
    assert MISMATCH in str(raised), raised


def test_rejection_on_one_rank_names_it_on_every_rank():
    with pytest.raises(jax.errors.JaxRuntimeError, match=MISMATCH) as error:
        mpicoll.scatter(_odd_one_out(jnp.ones((SIZE, 5, 13), jnp.uint8), jnp.ones((), jnp.uint8)))
    text = str(error.value)
    assert f"rank 0: scatter(uint8[{SIZE},5,13], root=0)" in text, text
    assert "rank 1: rejected: mpicoll.scatter: x must have shape (comm size, ...)" in text, text
    if RANK == 1:  # the rank that rejected it chains its own error
        assert isinstance(error.value.__cause__, ValueError)
    _in_step()


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_the_same_rejection_everywhere_is_the_plain_error(mode):
    """Bad input identical on every rank: the ValueError naming the cause, as always."""
    run = jax.jit(mpicoll.scatter) if mode == "jit" else mpicoll.scatter
    with pytest.raises(ValueError, match=r"x must have shape \(comm size, \.\.\.\)"):
        run(jnp.ones(()))
    _in_step()


def test_a_call_is_compared_when_it_is_new_on_its_communicator():
    """First-run checks are keyed by the call's description, not its program: every
    rank decides alike whether to compare (a rank with a new program around a call
    the ranks agreed on does not compare it while the others skip it)."""
    comparisons = mpicoll._src.runtime.native.extension.comparisons_made
    x = jnp.full((2, 7, 13), RANK + 1.0)  # a shape no other test uses: a new call
    step = jax.jit(lambda x: mpicoll.allreduce(mpicoll.allreduce(x) * 2))
    before = comparisons()
    for _ in range(3):
        out = step(x)
    first_run = comparisons() - before
    again = jax.jit(lambda x: mpicoll.allreduce(x) + 1)  # a new program, the same call
    before = comparisons()
    again(x).block_until_ready()
    new_program = comparisons() - before
    previous = mpicoll.set_check_mode("every-call")
    try:
        before = comparisons()
        step(x).block_until_ready()
        every_call = comparisons() - before
    finally:
        mpicoll.set_check_mode(previous)
    np.testing.assert_array_equal(np.asarray(out),
                                  np.full((2, 7, 13), 2.0 * SIZE * SIZE * (SIZE + 1) / 2))
    # Two sites of one call, three runs: compared once; every-call: two per run.
    assert (first_run, new_program, every_call) == (1, 0, 2)


def test_check_off_leaves_matching_calls_working():
    previous = mpicoll.set_check_mode("off")
    try:
        _in_step()
    finally:
        mpicoll.set_check_mode(previous)
    assert mpicoll.check_mode() == previous == "first-run"


def test_set_check_mode_rejects_unknown_modes():
    with pytest.raises(ValueError, match="mode must be one of"):
        mpicoll.set_check_mode("sometimes")
    assert mpicoll.check_mode() == "first-run"

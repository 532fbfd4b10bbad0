"""Eager calls of the rank-block collectives: results, result type, and their place in order.

The results are compared with numpy on every rank's data and with the same
call under jit; the result is the array the jitted call gives (dtype, shape,
weak type, device, committed); and an eager call keeps its place in MPI order
after a pending jitted program, also when its input is that program's output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpicoll
from conftest import (COLLECTIVES, RANK, REPRESENTATIVE_DTYPES, SIZE, all_ranks_data,
                      assert_same, call, expected, input_shape, rank_data, reduce_reference)

BLOCK_OPS = COLLECTIVES + ("reduce_scatter", "scan", "exscan")


def eager_call(name, x, root=0):
    if name in ("reduce_scatter", "scan", "exscan"):
        return getattr(mpicoll, name)(x)
    return call(name, x, root=root)


def reference(name, shape, dtype, root):
    stack = all_ranks_data(shape, dtype, kind="sum")
    if name == "reduce_scatter":
        return reduce_reference(stack[:, RANK], "sum")
    if name == "scan":
        return reduce_reference(stack[:RANK + 1], "sum")
    if name == "exscan":
        return reduce_reference(stack[:RANK], "sum") if RANK else np.zeros(stack.shape[1:], dtype)
    return expected(name, stack, root=root)


@pytest.mark.parametrize("dtype", [d for d in REPRESENTATIVE_DTYPES if d != np.bool_],
                         ids=str)
@pytest.mark.parametrize("name", BLOCK_OPS)
def test_eager_matches_numpy_and_jit(name, dtype):
    shape = input_shape(name, (3,)) if name != "reduce_scatter" else (SIZE, 3)
    x = jnp.asarray(rank_data(shape, dtype, RANK, kind="sum"))
    root = SIZE - 1
    eager = eager_call(name, x, root)
    jitted = jax.jit(lambda v: eager_call(name, v, root))(x)
    assert_same(eager, reference(name, shape, dtype, root))
    assert_same(eager, jitted)
    assert eager.dtype == jitted.dtype and eager.shape == jitted.shape


def test_eager_result_is_the_array_jit_would_give():
    for x in (jnp.float32(2.0) * 1, jnp.asarray(2.0), jnp.ones(4, jnp.int32),
              jax.device_put(jnp.ones(2), jax.local_devices()[0])):
        eager, jitted = mpicoll.allreduce(x), jax.jit(mpicoll.allreduce)(x)
        assert (eager.weak_type, eager.committed, eager.sharding) == (
            jitted.weak_type, jitted.committed, jitted.sharding), x
        assert_same(eager, np.asarray(x) * SIZE)


def test_eager_call_waits_for_pending_jitted_program_and_its_input():
    # A slow jitted program with a collective is still running when the eager
    # calls come; they must neither overtake its MPI call nor read its output early.
    slow = jax.jit(lambda v: mpicoll.allreduce(
        jax.lax.fori_loop(0, 200, lambda i, a: jnp.sin(a) + a * 1e-9, v) * 0 + v))
    for step in range(5):
        x = jnp.full((64, 64), float(RANK + step), jnp.float32)
        first = slow(x)
        second = mpicoll.allreduce(first)  # input not ready yet when called
        third = mpicoll.bcast(jnp.full(3, RANK + 10 * step, jnp.int32), root=0)
        total = sum(r + step for r in range(SIZE))
        assert_same(first, np.full((64, 64), total, np.float32))
        assert_same(second, np.full((64, 64), SIZE * total, np.float32))
        assert_same(third, np.full(3, 10 * step, np.int32))


def test_repeated_eager_calls_follow_their_arguments():
    # A repeated call takes its cached program by its arguments (dispatch.py,
    # _repeated_eager_call): each call below differs from the one before in one
    # part of that key (op, dtype, shape, root, the communicator, numpy input),
    # and every step's values are new, so a program or result taken for the
    # wrong call shows.
    from mpi4py import MPI
    for step in range(6):
        x = jnp.full(3, RANK + step, jnp.float32)
        total = sum(r + step for r in range(SIZE))
        assert_same(mpicoll.allreduce(x), np.full(3, total, np.float32))
        assert_same(mpicoll.allreduce(x, "max"), np.full(3, SIZE - 1 + step, np.float32))
        assert_same(mpicoll.allreduce(x.astype(jnp.int32)), np.full(3, total, np.int32))
        assert_same(mpicoll.allreduce(x[:2]), np.full(2, total, np.float32))
        root = step % SIZE
        assert_same(mpicoll.bcast(x, root=root), np.full(3, root + step, np.float32))
        assert_same(mpicoll.allreduce(np.asarray(x)), np.full(3, total, np.float32))
        assert_same(mpicoll.allreduce(x, comm=MPI.COMM_WORLD), np.full(3, total, np.float32))


def test_a_repeated_eager_call_skips_binds_layers(monkeypatch):
    # The eager fast path: once a call has run, the same call on another array
    # of its dtype and shape runs its cached program without bind's layers
    # (layout, validation, resolution); a call that differs still goes through bind.
    from mpicoll._src.primitive import dispatch

    def through_bind(*args, **kwargs):
        raise AssertionError("bind reached")

    x = jnp.arange(5, dtype=jnp.float32) + RANK
    mpicoll.allreduce(x)
    monkeypatch.setattr(dispatch, "bind", through_bind)
    total = sum(np.arange(5, dtype=np.float32) * 2 + 2 * r for r in range(SIZE))
    assert_same(mpicoll.allreduce(x * 2), total)
    with pytest.raises(AssertionError, match="bind reached"):
        mpicoll.allreduce(x, "min")  # a new op: a first call


def test_an_eager_compile_marks_its_own_thread_only():
    """run_eagerly marks the lowering it causes as an eager call's (whose call site
    every-call checks do not compare); a jitted call lowered on another thread
    meanwhile is its own, and keeps its site compared."""
    import threading

    from mpicoll._src.primitive import define, dispatch

    seen = {}

    def program(x):
        seen["eager"] = define.lowering_eagerly.active
        other = threading.Thread(
            target=lambda: seen.setdefault("other thread", define.lowering_eagerly.active))
        other.start()
        other.join()
        return x

    dispatch.run_eagerly(program, jnp.ones(2))
    assert seen == {"eager": True, "other thread": False}, seen
    assert define.lowering_eagerly.active is False

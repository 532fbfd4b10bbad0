"""Collectives run in program order on every rank, wherever they appear.

mpicoll's collectives carry an ordered JAX effect: inside one jitted program,
in loops, conditionals and custom derivatives, XLA may neither reorder, drop
nor run them concurrently, or the ranks' calls would no longer match.
"""

import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpicoll
from conftest import (COLLECTIVES, RANK, SIZE, WORLD, all_ranks_data,
                      assert_in_step, assert_same, call, expected, input_shape)

# A sequence of collectives with varying kinds, roots, dtypes and shapes, so that
# any two mismatched calls would move different amounts of data.
SEQUENCE = [
    (COLLECTIVES[i % len(COLLECTIVES)], (3 * i + 1) % SIZE, dtype, shape)
    for i, (dtype, shape) in enumerate(
        [(np.float32, (3,)), (np.int16, (2, 2)), (np.float64, ()), (np.int64, (4,)),
         (np.complex64, (2,)), (np.uint8, (5,)), (np.int32, (1, 3))] * 3)
][:20]


def _slow_on_some_ranks(x, i):
    """Rank-dependent local work before step i (XLA cannot prove it is a no-op).

    It makes the dataflow graphs of the ranks differ, so without the effect
    tokens XLA could schedule (or run concurrently) the independent collectives
    in a different order on different ranks.
    """
    if (i + RANK) % 3 != 0:
        return x
    big = jnp.sin(jnp.arange(20000.0) * (i + 1))
    tiny = (jnp.sum(big @ big.reshape(1, -1).T) > 1e300).astype(x.dtype)  # always 0
    return x + tiny


def test_twenty_independent_collectives_in_one_program():
    inputs = [all_ranks_data(input_shape(name, shape), dtype, seed=10 + i)
              for i, (name, _, dtype, shape) in enumerate(SEQUENCE)]

    @jax.jit
    def program(xs):
        return [call(name, _slow_on_some_ranks(x, i), root)
                for i, ((name, root, _, _), x) in enumerate(zip(SEQUENCE, xs))]

    runs = [program([stack[RANK] for stack in inputs]) for _ in range(2)]
    for outs in runs:
        for (name, root, _, _), stack, out in zip(SEQUENCE, inputs, outs):
            assert_same(out, expected(name, stack, root=root))


def test_eager_and_jitted_calls_alternating():
    """Jitted programs (dispatched asynchronously) and eager calls, interleaved with
    changing roots, run in program order: nothing is waited for until the end."""
    steps = 4 * SIZE
    data = [all_ranks_data((3,), np.int64, seed=40 + i) for i in range(steps)]
    jitted = {root: jax.jit(lambda x, root=root: (mpicoll.bcast(x, root), mpicoll.allreduce(x)))
              for root in range(SIZE)}
    outs = []
    for i in range(steps):
        root = (i * 3 + 1) % SIZE
        if i % 2:
            outs.append(jitted[root](data[i][RANK]))
        else:
            outs.append((mpicoll.bcast(data[i][RANK], root), mpicoll.allreduce(data[i][RANK])))
    for i, (b, total) in enumerate(outs):
        assert_same(b, data[i][(i * 3 + 1) % SIZE])
        assert_same(total, data[i].sum(0))


def test_fori_loop_with_switch_over_roots():
    """Each iteration: an allreduce, then a bcast whose root is chosen by lax.switch."""
    steps = 2 * SIZE + 1
    states = all_ranks_data((4,), np.int64, seed=20)

    def body(i, x):
        total = mpicoll.allreduce(x)
        b = lax.switch(i % SIZE, [lambda y, k=k: mpicoll.bcast(y, k) for k in range(SIZE)],
                       x + i)
        return total % 97 + b

    out = jax.jit(lambda x: lax.fori_loop(0, steps, body, x))(states[RANK])

    for i in range(steps):  # the same loop over every rank's state, in numpy
        total = states.sum(0)
        b = states[i % SIZE] + i
        states = np.stack([total % 97 + b] * SIZE)
    assert_same(out, states[RANK])


def test_scan_carrying_reductions_and_stacking_allgathers():
    steps = 5
    xs = all_ranks_data((steps, 3), np.int32, seed=21)
    init = all_ranks_data((3,), np.int32, seed=22)

    def step(carry, x):
        carry = mpicoll.allreduce(carry, "max") + mpicoll.allreduce(x)
        return carry, mpicoll.allgather(x * 2)

    carry, ys = jax.jit(lambda c, x: lax.scan(step, c, x))(init[RANK], xs[RANK])

    ref_carry = init.max(0)
    for t in range(steps):
        ref_carry = ref_carry + xs[:, t].sum(0)  # after step 0 every rank's carry is equal
    assert_same(carry, ref_carry.astype(np.int32))
    assert_same(ys, np.stack([xs[:, t] * 2 for t in range(steps)]))


@pytest.mark.parametrize("take_true_branch", [True, False])
def test_cond_with_collectives_in_both_branches(take_true_branch):
    """The predicate comes from an allreduce, so it is the same on every rank."""
    data = all_ranks_data((3,), np.float64, seed=23)
    flag = 1.0 if take_true_branch else -1.0

    @jax.jit
    def program(x, f):
        pred = mpicoll.allreduce(f) > 0
        return lax.cond(pred,
                        lambda y: mpicoll.allreduce(y, "max") + 0 * mpicoll.gather(y)[0],
                        lambda y: mpicoll.allgather(y).sum(0) + mpicoll.bcast(y, SIZE - 1),
                        x)

    out = program(data[RANK], flag)
    after = mpicoll.allgather(jnp.asarray(RANK))  # still in step after the cond
    if take_true_branch:
        assert_same(out, data.max(0))
    else:
        assert_same(out, data.sum(0) + data[SIZE - 1])
    assert_same(after, np.arange(SIZE))


def test_while_loop_with_collective_in_condition():
    """Ranks want different trip counts; an allreduce in cond_fun makes them agree."""
    @jax.jit
    def program(my_trips):
        def cond(c):
            return mpicoll.allreduce(c[0] < my_trips, "lor")

        def body(c):
            return c[0] + 1, c[1] + mpicoll.allreduce(jnp.int64(1))

        return lax.while_loop(cond, body, (jnp.int64(0), jnp.int64(0)))

    trips, total = program(RANK + 1)
    assert int(trips) == SIZE
    assert int(total) == SIZE * SIZE


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_custom_vjp_with_collectives_in_forward_and_backward(mode):
    """f(x) = allreduce(x); its VJP is the allreduce of the cotangents."""
    @jax.custom_vjp
    def global_sum(x):
        return mpicoll.allreduce(x)

    def fwd(x):
        return mpicoll.allreduce(x), mpicoll.allgather(x)  # residual from a collective

    def bwd(gathered, g):
        return (mpicoll.allreduce(g) + 0 * gathered[0],)

    global_sum.defvjp(fwd, bwd)
    weights = all_ranks_data((3,), np.float64, seed=24)
    data = all_ranks_data((3,), np.float64, seed=25)

    def loss(x):
        return jnp.sum(global_sum(x) * weights[RANK])

    grad = jax.jit(jax.value_and_grad(loss)) if mode == "jit" else jax.value_and_grad(loss)
    value, g = grad(data[RANK])
    assert_same(value, np.sum(data.sum(0) * weights[RANK]))
    assert_same(g, weights.sum(0))


# ---------------------------------------------------------------------------
# Collectives whose results are unused still run (and block).

SLEEP = 0.4


def _shared_marker_path():
    path = os.path.join(tempfile.gettempdir(), f"mpicoll-test-{os.getpid()}")
    return WORLD.bcast(path, root=0)


def _run_with_one_late_rank(late, fn):
    """Rank `late` sleeps, creates a marker file, then calls fn; the others call fn at once.

    Returns (whether the marker existed when fn returned, seconds fn took) on this rank.
    If fn did not synchronize with the late rank, the others return before the marker exists.
    """
    marker = _shared_marker_path()
    WORLD.Barrier()
    if RANK == late:
        time.sleep(SLEEP)
        open(marker, "w").close()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    seen = os.path.exists(marker)
    WORLD.Barrier()
    if RANK == late:
        os.remove(marker)
    return seen, elapsed


def test_eager_barrier_blocks_until_every_rank_arrives():
    seen, elapsed = _run_with_one_late_rank(SIZE - 1, mpicoll.barrier)
    assert seen
    assert RANK == SIZE - 1 or elapsed >= 0.8 * SLEEP


def test_jitted_barrier_with_no_outputs_synchronizes():
    program = jax.jit(lambda: mpicoll.barrier())
    program()  # compile outside the timed region
    assert jax.make_jaxpr(program)().eqns  # the barrier survives in the traced program
    seen, elapsed = _run_with_one_late_rank(0, lambda: (program(), jax.effects_barrier()))
    assert seen
    assert RANK == 0 or elapsed >= 0.8 * SLEEP


@pytest.mark.parametrize("name", COLLECTIVES)
def test_jitted_collective_with_unused_result_still_runs(name):
    """The late rank is one the others must hear from: the root of bcast/scatter, a
    non-root of reduce/gather (whose root waits for it), anyone for the rest."""
    root = 0
    late = SIZE - 1 if name in ("reduce", "gather") else 0
    waits = RANK != late and (name not in ("reduce", "gather") or RANK == root)
    x = jnp.ones(input_shape(name, (2,)), jnp.float32)

    @jax.jit
    def program(a):
        call(name, a, root)  # result dropped
        return a + 1

    program(x)
    seen, elapsed = _run_with_one_late_rank(
        late, lambda: (program(x).block_until_ready(), jax.effects_barrier()))
    assert seen or not waits
    assert elapsed >= 0.8 * SLEEP or not waits


# ---------------------------------------------------------------------------
# mpicoll and the user's own mpi4py traffic on COMM_WORLD do not mix.

@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("comm", [None, WORLD], ids=["default", "COMM_WORLD"])
def test_interleaved_with_user_mpi4py_calls_on_comm_world(comm, mode):
    """The user's own traffic on COMM_WORLD, started in a rank-dependent order around
    mpicoll's collectives, cannot match them (mpicoll talks on a duplicate), whether
    mpicoll is given COMM_WORLD itself or uses its default.

    Even ranks start a nonblocking bcast and a send on COMM_WORLD before mpicoll's
    allreduce, odd ranks after it: on a shared communicator the collectives would
    pair up wrongly (or hang); on separate ones every rank gets the right data.
    """
    nxt, prev = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    data = all_ranks_data((4,), np.int32, seed=26)

    def allreduce(x):
        return mpicoll.allreduce(x, comm=comm)

    def bcast(x, root):
        return mpicoll.bcast(x, root, comm=comm)

    if mode == "jit":
        allreduce, bcast = jax.jit(allreduce), jax.jit(bcast, static_argnums=1)
    results, user = [], []
    for step in range(3):
        root = step % SIZE
        user_bcast = np.full(3, 1000 * step + RANK, np.int64)
        ring_out = np.array([step, RANK], np.int64)
        ring_in = np.full(2, -1, np.int64)

        def start_user_traffic():
            return [WORLD.Ibcast(user_bcast, root=root),
                    WORLD.Isend(ring_out, dest=nxt, tag=step)]

        if RANK % 2 == 0:
            requests = start_user_traffic()
            results.append(allreduce(data[RANK] + step))
        else:
            results.append(allreduce(data[RANK] + step))
            requests = start_user_traffic()
        WORLD.Recv(ring_in, source=prev, tag=step)
        MPI.Request.Waitall(requests)
        results.append(bcast(data[RANK] * step, (step + 1) % SIZE))
        user.append((user_bcast, ring_in, WORLD.allreduce(RANK + step)))

    for step in range(3):
        assert_same(results[2 * step], (data.sum(0) + SIZE * step).astype(np.int32))
        assert_same(results[2 * step + 1], data[(step + 1) % SIZE] * step)
        user_bcast, ring_in, user_sum = user[step]
        np.testing.assert_array_equal(user_bcast, np.full(3, 1000 * step + step % SIZE))
        np.testing.assert_array_equal(ring_in, [step, prev])
        assert user_sum == SIZE * (SIZE - 1) // 2 + SIZE * step
    assert_in_step()


def test_explicit_comm_world_in_program_order_with_user_calls():
    """Passing comm=MPI.COMM_WORLD itself works when the user keeps the same order everywhere."""
    x = all_ranks_data((2,), np.float32, seed=27)
    out = []
    for step in range(3):
        out.append(mpicoll.allreduce(x[RANK] * step, comm=WORLD))
        out.append(WORLD.bcast(step * 10 + RANK, root=step % SIZE))
        out.append(mpicoll.bcast(x[RANK], (step + 1) % SIZE, comm=WORLD))
        out.append(WORLD.allgather(RANK))
    for step in range(3):
        assert_same(out[4 * step], x.sum(0) * step)
        assert out[4 * step + 1] == step * 10 + step % SIZE
        assert_same(out[4 * step + 2], x[(step + 1) % SIZE])
        assert out[4 * step + 3] == list(range(SIZE))


def test_many_programs_in_a_python_loop_keep_their_order():
    """Programs dispatched back to back, each taking the last one's runtime token
    (mpicoll passes a token already on the device straight through, _compat.dispatch_hooks)."""
    assert mpicoll._src.primitive.device_order.RUNTIME_TOKEN_FAST_PATH, "JAX's runtime token set changed"
    add = jax.jit(lambda x: mpicoll.allreduce(x) + 1)
    gather = jax.jit(lambda x: mpicoll.allgather(x)[:, 0])
    x = jnp.full(3, float(RANK))
    stacked = []
    for _ in range(12):
        x = add(x)
        stacked.append(gather(x))  # independent of the next add: only the token orders them
    value = float(sum(range(SIZE)))  # x after the first allreduce, before the + 1
    for step in range(12):
        value = (SIZE * value if step else value) + 1
        np.testing.assert_array_equal(np.asarray(stacked[step]), np.full(SIZE, value))

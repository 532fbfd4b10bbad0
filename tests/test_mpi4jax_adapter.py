"""mpicoll.mpi4jax runs programs written for mpi4jax 0.9 unchanged.

The programs below are written in mpi4jax's style (its signatures, MPI.Op
objects, rank-dependent results, MPI.Status).  Each runs on mpicoll.mpi4jax
and is checked against numpy; where mpi4jax itself is installed (`make bench`
builds it), it runs on mpi4jax too and the two must agree, and the signatures
must match.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll.mpi4jax as adapter
from conftest import RANK, SIZE

try:
    import mpi4jax as real_mpi4jax
except ImportError:  # the comparison needs it; the numpy checks do not
    real_mpi4jax = None

MODULES = [adapter] + ([real_mpi4jax] if real_mpi4jax is not None else [])
RIGHT, LEFT = (RANK + 1) % SIZE, (RANK - 1) % SIZE


def rank_x(r):
    return np.arange(4, dtype=np.float32) + 10 * r


def collectives_program(m, x, comm=None):
    """Every collective, as an mpi4jax user writes them (positional op and root)."""
    stacked = jnp.stack([x + j for j in range(SIZE)])
    return {
        "allreduce": m.allreduce(x, op=MPI.SUM, comm=comm),
        "allreduce-max": m.allreduce(x, MPI.MAX),
        "allgather": m.allgather(x, comm=comm),
        "alltoall": m.alltoall(stacked),
        "bcast": m.bcast(x, SIZE - 1),
        "gather": m.gather(x, 0, comm=comm),
        "reduce": m.reduce(x, MPI.SUM, 0),
        "scatter": m.scatter(stacked if RANK == SIZE - 1 else x, SIZE - 1),
        "scan": m.scan(x, MPI.SUM),
        "ring": m.sendrecv(x, x, LEFT, RIGHT),
    }


def expected_collectives():
    xs = np.stack([rank_x(r) for r in range(SIZE)])
    x = xs[RANK]
    return {
        "allreduce": xs.sum(0), "allreduce-max": xs.max(0), "allgather": xs,
        "alltoall": np.stack([xs[j] + RANK for j in range(SIZE)]), "bcast": xs[SIZE - 1],
        "gather": xs if RANK == 0 else x,  # mpi4jax: x unchanged off root
        "reduce": xs.sum(0) if RANK == 0 else x,
        "scatter": xs[SIZE - 1] + RANK, "scan": xs[:RANK + 1].sum(0), "ring": xs[LEFT],
    }


def run_on_every_module(program, *args):
    """The program's results per module, each module's run complete before the next."""
    return [jax.block_until_ready(program(m, *args)) for m in MODULES]


def assert_results(results, expect):
    for name, value in expect.items():
        for result in results:
            np.testing.assert_array_equal(np.asarray(result[name]), value, err_msg=name)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_collectives_program(mode):
    x = jnp.asarray(rank_x(RANK))
    if mode == "jit":
        results = [jax.block_until_ready(jax.jit(lambda a, m=m: collectives_program(m, a))(x))
                   for m in MODULES]
    else:
        results = run_on_every_module(collectives_program, x)
    assert_results(results, expected_collectives())


def test_collectives_program_on_a_communicator():
    comm = MPI.COMM_WORLD.Dup()
    try:
        results = run_on_every_module(collectives_program, jnp.asarray(rank_x(RANK)), comm)
    finally:
        comm.Free()
    assert_results([{k: r[k] for k in ("allreduce", "allgather", "gather")} for r in results],
                   {k: expected_collectives()[k] for k in ("allreduce", "allgather", "gather")})


def p2p_program(m, x):
    """Even ranks send then receive; odd ranks receive from anyone, then reply."""
    partner = RANK ^ 1
    status = MPI.Status()
    if partner >= SIZE:
        return x, -1, -1
    if RANK % 2 == 0:
        m.send(x, partner, tag=3)
        got = m.recv(x, partner, tag=4, status=status)
    else:
        got = m.recv(x, status=status)  # defaults: ANY_SOURCE, ANY_TAG
        m.send(got * 2, status.Get_source() if not isinstance(got, jax.core.Tracer) else partner,
               tag=4)
    return got, status.Get_source(), status.Get_tag()


def test_send_recv_program_with_status():
    x = jnp.asarray(rank_x(RANK))
    partner = RANK ^ 1
    for m in MODULES:
        got, source, tag = p2p_program(m, x)
        if partner >= SIZE:
            continue
        if RANK % 2 == 0:
            np.testing.assert_array_equal(np.asarray(got), 2 * x)
            assert (source, tag) == (partner, 4)
        else:
            np.testing.assert_array_equal(np.asarray(got), rank_x(partner))
            assert (source, tag) == (partner, 3)


def test_status_filled_under_jit():
    status = MPI.Status()
    out = jax.jit(lambda a: adapter.sendrecv(a, a, LEFT, RIGHT, sendtag=9, status=status))(
        jnp.asarray(rank_x(RANK)))
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), rank_x(LEFT))
    assert (status.Get_source(), status.Get_tag()) == (LEFT, 9)
    assert status.Get_count(MPI.FLOAT) == 4


def test_gradients_agree_with_mpi4jax():
    """allreduce(SUM) and sendrecv are the operations mpi4jax differentiates."""
    x = jnp.asarray(rank_x(RANK), jnp.float64)

    def objective(m):
        def f(a):
            total = m.allreduce(jnp.sin(a), MPI.SUM)
            moved = m.sendrecv(a * 2.0, a, LEFT, RIGHT)
            return jnp.sum(total * 0.5) + jnp.sum(jnp.cos(moved))
        return f

    grads = [jax.block_until_ready(jax.jit(jax.grad(objective(m)))(x)) for m in MODULES]
    # allreduce's cotangent passes through; sendrecv's travels back from RIGHT.
    xs = np.stack([rank_x(r) for r in range(SIZE)]).astype(np.float64)
    expect = 0.5 * np.cos(xs[RANK]) - 2.0 * np.sin(2.0 * xs[RANK])
    for grad in grads:
        np.testing.assert_allclose(np.asarray(grad), expect, rtol=1e-12)


def token_era_program(m, x, token):
    """Every function in mpi4jax <= 0.7's form: token= passed, (result, token) unpacked."""
    stacked = jnp.stack([x + j for j in range(SIZE)])
    out = {}
    out["allreduce"], token = m.allreduce(x, op=MPI.SUM, token=token)
    out["allgather"], token = m.allgather(x, token=token)
    out["alltoall"], token = m.alltoall(stacked, token=token)
    out["bcast"], token = m.bcast(x, SIZE - 1, token=token)
    out["gather"], token = m.gather(x, 0, token=token)
    out["reduce"], token = m.reduce(x, MPI.SUM, 0, token=token)
    out["scatter"], token = m.scatter(stacked if RANK == SIZE - 1 else x, SIZE - 1, token=token)
    out["scan"], token = m.scan(x, MPI.SUM, token=token)
    out["ring"], token = m.sendrecv(x, x, LEFT, RIGHT, token=token)
    token = m.barrier(token=token)
    if SIZE > 1:
        if RANK % 2 == 0 and RANK + 1 < SIZE:
            token = m.send(x, RANK + 1, tag=5, token=token)
        elif RANK % 2 == 1:
            out["recv"], token = m.recv(x, RANK - 1, tag=5, token=token)
    return out, token


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("start", ["none", "jax-token"])
def test_token_era_returns_result_and_token(mode, start):
    """token=None starts with mpicoll's token, passed on unchanged; a JAX token the
    program made is passed on as it came (so a loop's carry keeps its type)."""
    x = jnp.asarray(rank_x(RANK))
    token = None if start == "none" else jax.lax.create_token()
    run = jax.jit(token_era_program, static_argnums=0) if mode == "jit" else token_era_program
    out, last = jax.block_until_ready(run(adapter, x, token))
    expect = {k: v for k, v in expected_collectives().items() if k != "allreduce-max"}
    if RANK % 2 == 1:
        expect["recv"] = rank_x(RANK - 1)
    assert sorted(out) == sorted(expect)
    assert_results([out], expect)
    if start == "none":
        assert last is adapter._MPICOLL_TOKEN
    else:
        assert jax.typeof(last) == jax.typeof(jax.lax.create_token())


def test_token_era_send_and_barrier_return_the_token_alone():
    given = jax.lax.create_token()
    assert adapter.barrier(token=given) is given
    assert adapter.send(jnp.ones(2), MPI.PROC_NULL, token=given) is given
    assert adapter.barrier(token=None) is adapter._MPICOLL_TOKEN
    assert adapter.barrier() is None  # mpi4jax 0.9's form


def test_mpicoll_token_adds_nothing_to_a_jitted_kernel():
    """An empty pytree: no parameter and no result in the compiled kernel, so a kernel
    that passes it on keeps JAX's C++ dispatch (benchmarks/token_cost.py times it)."""
    _, token = adapter.allreduce(jnp.ones(2), MPI.SUM, token=None)
    assert jax.tree_util.tree_leaves(token) == []
    with_token = jax.jit(lambda x, t: (x + 1, t)).lower(jnp.ones(2), token).compile()
    without = jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()
    leaves = jax.tree_util.tree_leaves
    assert leaves(with_token.in_avals) == leaves(without.in_avals)  # x alone
    assert len(leaves(with_token.out_info)) == len(leaves(without.out_info)) == 1


@pytest.mark.parametrize("bad", [3, "token", jnp.zeros(2), jnp.zeros((0,), bool)],
                         ids=["int", "str", "float-array", "empty-array"])
def test_a_wrong_token_raises_on_every_rank_before_any_mpi_call(bad):
    with pytest.raises(TypeError, match=r"mpicoll.mpi4jax.allreduce: token= must be None, a "
                                        r"token an earlier call returned, or a JAX token"):
        adapter.allreduce(jnp.ones(2), MPI.SUM, token=bad)
    with pytest.raises(TypeError, match=r"mpicoll.mpi4jax.send: token= must be None"):
        jax.jit(lambda x: adapter.send(x, RIGHT, token=bad))(jnp.ones(2))
    # No rank sent or entered a collective: the next one is the first.
    total = adapter.allreduce(jnp.ones(2), MPI.SUM)
    np.testing.assert_array_equal(np.asarray(total), np.full(2, SIZE))
    assert isinstance(adapter.has_cuda_support(), bool)
    assert adapter.has_sycl_support() is False


@pytest.mark.skipif(real_mpi4jax is None, reason="mpi4jax is not installed (make bench builds it)")
def test_signatures_match_mpi4jax():
    assert sorted(adapter.__all__) == sorted(real_mpi4jax.__all__)
    for name in real_mpi4jax.__all__:
        ours = inspect.signature(getattr(adapter, name)).parameters
        theirs = inspect.signature(getattr(real_mpi4jax, name)).parameters
        assert list(ours) == list(theirs), name
        for param in theirs:
            assert ours[param].kind == theirs[param].kind, (name, param)
            if param != "token":
                assert ours[param].default == theirs[param].default, (name, param)


def test_wrong_leading_axis_raises_on_the_calling_rank_alone_like_mpi4jax():
    """mpi4jax checks scatter's (on root) and alltoall's leading axis locally:
    only rank 0 calls here, and it raises mpi4jax's message without waiting for
    the other ranks (mpicoll's own rejections compare notes across ranks)."""
    if RANK == 0:
        x = jnp.ones((SIZE + 1,))
        with pytest.raises(ValueError, match=r"Scatter input must have shape \(nproc, \.\.\.\)"):
            adapter.scatter(x, root=0)
        with pytest.raises(ValueError, match=r"Alltoall input must have shape \(nproc, \.\.\.\)"):
            adapter.alltoall(x)
    MPI.COMM_WORLD.Barrier()

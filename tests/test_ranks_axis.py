"""Autodiff typed by JAX over the ranks: shard_map over mpicoll.mesh().

Inside it every value is invariant (the same on every rank) or varying over
mpicoll.RANKS, and a program either differentiates to the gradient of the one
global objective or raises.  References: the same objective written in one
process on every rank's data (jax.grad there), finite differences, and the
adjoint identity <ct, J t> = <J^T ct, t> summed over ranks with numpy.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import mpicoll

jax.config.update("jax_enable_x64", True)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
R = mpicoll.RANKS
MESH = mpicoll.mesh()


def typed(fn, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_specs))


def per_rank(r, shape=(3,)):
    return np.random.default_rng(100 + r).normal(size=shape)


def test_a_carry_that_an_allreduce_makes_identical_is_refused():
    # The program: under plain jit the gradient was 0.125 where finite
    # differences give 0.5.  Typed, JAX rejects the loop and names the axis.
    def run(c0):
        return jax.lax.scan(lambda c, _: (mpicoll.allreduce(c) * 0.5, None), c0, None,
                            length=3)[0]

    with pytest.raises(TypeError, match=re.escape("{V:mpicoll.RANKS}")):
        jax.grad(lambda c: typed(run, P(R), P())(c).sum())(jnp.ones(1))


def test_a_per_rank_carry_kept_with_pvary_differentiates_like_one_process():
    def run(c0):  # the objective: the per-rank outputs summed over ranks
        c = jax.lax.scan(lambda c, _: (mpicoll.pvary(mpicoll.allreduce(c) * 0.5), None),
                         c0, None, length=3)[0]
        return mpicoll.allreduce(c.sum())

    def one_process(c0s):  # rows: ranks; the objective sums the per-rank outputs
        for _ in range(3):
            c0s = jnp.broadcast_to(c0s.sum(axis=0) * 0.5, c0s.shape)
        return c0s.sum()

    c0 = jnp.asarray(per_rank(RANK, (2,)))
    got = jax.grad(typed(run, P(R), P()))(c0)
    everyone = np.stack([per_rank(r, (2,)) for r in range(SIZE)])
    np.testing.assert_allclose(got, jax.grad(one_process)(jnp.asarray(everyone))[RANK],
                               rtol=1e-12)


def test_a_replicated_parameter_collects_every_ranks_cotangent_without_pvary():
    # JAX inserts pvary where w meets per-rank data; its transpose sums over ranks.
    def loss(w, x):
        return mpicoll.allreduce(jnp.sum(jnp.tanh(w * x)))

    w = jnp.asarray(per_rank(-1))  # the same on every rank
    x = jnp.asarray(per_rank(RANK))
    got = jax.grad(typed(loss, (P(), P(R)), P()))(w, x)
    everyone = jnp.asarray(np.stack([per_rank(r) for r in range(SIZE)]))
    expected = jax.grad(lambda w: jnp.sum(jnp.tanh(w * everyone)))(w)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    np.testing.assert_allclose(COMM.allgather(np.asarray(got)), [np.asarray(got)] * SIZE)


def test_an_allreduce_of_a_replicated_value_is_size_times_it_and_so_is_its_gradient():
    typed_fn = typed(lambda w: mpicoll.allreduce(w * 2.0), P(), P())

    def fn(w):
        return float(typed_fn(w))
    assert fn(1.5) == pytest.approx(3.0 * SIZE)
    grad = float(jax.grad(typed_fn)(1.5))
    assert grad == pytest.approx(2.0 * SIZE)
    eps = 1e-6
    assert grad == pytest.approx((fn(1.5 + eps) - fn(1.5 - eps)) / (2 * eps), rel=1e-6)


def test_a_sub_communicator_sums_within_its_group():
    # Identical within a group, not across groups: typed per-rank.
    sub = COMM.Split(RANK % 2, RANK)

    def loss(w, x):
        within = mpicoll.allreduce(w * x, comm=sub)
        return mpicoll.allreduce(jnp.sum(jnp.sin(within)))

    w, x = jnp.asarray(per_rank(-1)), jnp.asarray(per_rank(RANK))
    got = jax.grad(typed(loss, (P(), P(R)), P()))(w, x)
    everyone = np.stack([per_rank(r) for r in range(SIZE)])

    def one_process(w):
        return sum(jnp.sum(jnp.sin(w * everyone[[q for q in range(SIZE) if q % 2 == r % 2]]
                                   .sum(axis=0)))
                   for r in range(SIZE))
    np.testing.assert_allclose(got, jax.grad(one_process)(w), rtol=1e-12)
    sub.Free()


# The adjoint identity for every linear collective, typed: <ct, J t> = <J^T ct, t>,
# where an inner product over a varying value sums over ranks and one over an
# invariant value (the same everywhere) counts it once.
LINEAR = {
    "allreduce": (lambda x: mpicoll.allreduce(x), (4,), False),
    "allgather": (lambda x: mpicoll.allgather(x), (4,), False),
    "bcast": (lambda x: mpicoll.bcast(x, root=SIZE - 1), (4,), False),
    "reduce": (lambda x: mpicoll.reduce(x, root=SIZE - 1), (4,), True),
    "gather": (lambda x: mpicoll.gather(x, root=0), (4,), True),
    "scatter": (lambda x: mpicoll.scatter(x, root=0), (SIZE, 3), True),
    "alltoall": (lambda x: mpicoll.alltoall(x), (SIZE, 3), True),
    "reduce_scatter": (lambda x: mpicoll.reduce_scatter(x), (SIZE, 3), True),
    "scan": (lambda x: mpicoll.scan(x), (4,), True),
    "exscan": (lambda x: mpicoll.exscan(x), (4,), True),
    "allgatherv": (lambda x: mpicoll.allgatherv(x[:1 + RANK % 2],
                                                [1 + r % 2 for r in range(SIZE)]), (4,), False),
}


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_adjoint_identity(name):
    op, shape, varying_out = LINEAR[name]
    fn = jax.shard_map(op, mesh=MESH, in_specs=P(R), out_specs=P(R) if varying_out else P())
    t = jnp.asarray(per_rank(RANK, shape))
    y, vjp = jax.vjp(fn, t)
    rng = np.random.default_rng(7 if not varying_out else 7 + RANK)
    ct = jnp.asarray(rng.normal(size=y.shape))
    (back,) = vjp(ct)
    _, forward = jax.jvp(fn, (t,), (t,))
    lhs = float(jnp.vdot(ct, forward))
    lhs = COMM.allreduce(lhs) if varying_out else lhs
    rhs = COMM.allreduce(float(jnp.vdot(back, t)))
    assert lhs == pytest.approx(rhs, rel=1e-10)


def test_pvary_of_a_per_rank_value_is_refused():
    with pytest.raises(ValueError, match="already varies over mpicoll.RANKS"):
        typed(lambda x: mpicoll.pvary({"a": x}), P(R), P(R))(jnp.ones(2))


def test_reverse_mode_outside_the_mesh_refuses_unless_the_convention_is_chosen():
    # The mode is read when a collective is called (traced): a function jit
    # has already traced keeps the mode it was traced in.
    x = jnp.asarray(per_rank(RANK))
    with pytest.raises(TypeError, match="needs to know which values are the same"):
        jax.grad(jax.jit(lambda x: mpicoll.allreduce(jnp.sum(x ** 2))))(x)
    loss = jax.jit(lambda x: mpicoll.allreduce(jnp.sum(x ** 2)))
    previous = mpicoll.set_autodiff("convention")
    try:
        np.testing.assert_allclose(jax.grad(loss)(x), 2 * x)
    finally:
        mpicoll.set_autodiff(previous)
    # Forward mode is exact outside the mesh too.
    _, tangent = jax.jvp(loss, (x,), (jnp.ones_like(x),))
    assert float(tangent) == pytest.approx(COMM.allreduce(float(2 * x.sum())))


def test_mesh_rejects_a_local_axis_named_like_the_ranks():
    with pytest.raises(ValueError, match="local_axis must differ"):
        mpicoll.mesh(R)


def _docs_program(page, containing):
    """The ```python block of docs/<page> that contains `containing` (a complete program)."""
    text = (Path(__file__).parent.parent / "docs" / page).read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    return next(block for block in blocks if containing in block)


def test_the_typed_data_parallel_program_of_the_docs_gives_the_global_gradient():
    """docs/autodiff.md's program (tests/test_docs.py runs it; here its result is checked):
    the gradient of the global loss in shard_map over mpicoll.mesh() is, on every rank,
    the one-process gradient on every rank's data."""
    names = {"__name__": "docs_program"}
    exec(compile(_docs_program("autodiff.md", "in_specs=(P(), P(mpicoll.RANKS)"),
                 "docs/autodiff.md", "exec"), names)
    X = jnp.concatenate([jnp.asarray(x) for x in COMM.allgather(np.asarray(names["x_local"]))])
    Y = jnp.concatenate([jnp.asarray(y) for y in COMM.allgather(np.asarray(names["y_local"]))])
    expected = jax.grad(names["loss"])(names["params"], X, Y)
    for got, want in zip(jax.tree.leaves(names["grads"]), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

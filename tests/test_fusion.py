"""Pytree fusion: small leaves of one dtype travel in one MPI message.

The FFI handler packs the leaves into one buffer (rank blocks stay rank blocks
for scatter, gather, allgather and alltoall) and unpacks the result, so every
leaf must come back exactly as if the collective had run on it alone.  These
tests shrink the fusion limits so that one small tree exercises every grouping:
fused buckets, a bucket split when full, a leaf large enough to go alone, and
several dtypes; then vmap, jvp and grad of a fused call, and check mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpicoll
from mpicoll._src.primitive import dispatch
from conftest import (COLLECTIVES, RANK, REDUCING, SIZE, STACKED_INPUT, assert_same, call,
                      expected, input_shape, rank_data)


@pytest.fixture
def small_fusion_limits(monkeypatch):
    """Buckets of at most 96 bytes; leaves above 64 bytes go alone."""
    monkeypatch.setattr(dispatch, "FUSION_BYTES", 96)
    monkeypatch.setattr(dispatch, "FUSION_LEAF_BYTES", 64)
    dispatch._fused_program.cache_clear()  # programs are traced with the limits of the time
    yield
    dispatch._fused_program.cache_clear()


# (shape, dtype) of each leaf; with the limits above the float32 leaves form
# two buckets (44 B, then 60 B that would not fit), (40,) float32 (160 B) goes
# alone, and the int32 and the float64 leaves are messages of their own.
LEAVES = [((3, 2), np.float32), ((), np.float32), ((5,), np.int32), ((40,), np.float32),
          ((4,), np.float32), ((0,), np.float32), ((2, 2), np.float64), ((15,), np.float32)]


def test_grouping_under_the_small_limits(small_fusion_limits):
    leaves = [np.zeros(shape, dtype) for shape, dtype in LEAVES]
    assert dispatch.messages(leaves) == [[0, 1, 4, 5], [2], [3], [6], [7]]


def _stacks(name, seed, size=SIZE):
    kind = "sum" if name in REDUCING else None
    return [np.stack([rank_data(input_shape(name, shape, size), dtype, r, seed + i, kind)
                      for r in range(size)]) for i, (shape, dtype) in enumerate(LEAVES)]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_every_grouping_matches_numpy(small_fusion_limits, name, mode):
    stacks = _stacks(name, seed=30)
    tree = {"leaves": [jnp.asarray(stack[RANK]) for stack in stacks]}
    root = SIZE - 1
    fn = lambda t: call(name, t, root)  # noqa: E731
    out = jax.jit(fn)(tree) if mode == "jit" else fn(tree)
    assert list(out) == ["leaves"] and len(out["leaves"]) == len(LEAVES)
    for stack, leaf in zip(stacks, out["leaves"]):
        assert_same(leaf, expected(name, stack, root=root))


@pytest.mark.parametrize("name", COLLECTIVES)
def test_default_limits_fuse_a_tree_into_one_message(name):
    """100 leaves of 1 KiB: one FFI call in the compiled program, results as numpy says."""
    stacks = [np.stack([rank_data(input_shape(name, (256,)), np.float32, r, 40 + i,
                                  "sum" if name in REDUCING else None) for r in range(SIZE)])
              for i in range(100)]
    fn = jax.jit(lambda t: call(name, t, 0))
    leaves = [jnp.asarray(stack[RANK]) for stack in stacks]
    hlo = fn.lower(leaves).as_text()
    assert hlo.count("stablehlo.custom_call") == 1, hlo
    assert f"custom_call @mpicoll_{name}_fused(" in hlo, hlo
    for stack, leaf in zip(stacks, fn(leaves)):
        assert_same(leaf, expected(name, stack, root=0))


@pytest.mark.parametrize("name", COLLECTIVES)
def test_vmap_of_a_fused_call(small_fusion_limits, name):
    """A batch axis on some leaves (first or last), none on others: each leaf as if alone."""
    batch = 3
    shapes = [(2,), (3, 2), (4,)]
    in_axes = [0, -1, None]
    kind = "sum" if name in REDUCING else None

    def data(r):
        out = []
        for i, (shape, axis) in enumerate(zip(shapes, in_axes)):
            s = input_shape(name, shape)
            if axis is not None:
                s = (batch, *s) if axis == 0 else (*s, batch)
            out.append(rank_data(s, np.float32, r, 50 + i, kind))
        return out

    every_rank = [data(r) for r in range(SIZE)]
    mine = [jnp.asarray(a) for a in every_rank[RANK]]
    out = jax.jit(jax.vmap(lambda t: call(name, t, 0), in_axes=(in_axes,)))(mine)
    for i, axis in enumerate(in_axes):
        stack = np.stack([every_rank[r][i] for r in range(SIZE)])
        if axis is None:
            want = np.broadcast_to(expected(name, stack), (batch, *expected(name, stack).shape))
        else:
            per_batch = np.moveaxis(stack, axis if axis == -1 else 1, 1)
            want = np.stack([expected(name, per_batch[:, b]) for b in range(batch)])
        assert_same(out[i], want)


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.usefixtures("convention_autodiff")
def test_jvp_and_grad_of_a_fused_allreduce_match_per_leaf_calls(small_fusion_limits, op):
    """Derivatives of one fused call equal those of one call per leaf."""
    xs = [jnp.asarray(rank_data((3,), np.float32, RANK, 60 + i)) for i in range(3)]
    ts = [jnp.asarray(rank_data((3,), np.float32, RANK, 70 + i)) for i in range(3)]

    def fused(*leaves):
        return mpicoll.allreduce(list(leaves), op)

    def per_leaf(*leaves):
        return [mpicoll.allreduce(leaf, op) for leaf in leaves]

    def loss(f):
        return lambda *leaves: sum(jnp.sum(jnp.sin(y) * (i + 1)) for i, y in enumerate(f(*leaves)))

    ys, dys = jax.jit(lambda: jax.jvp(fused, xs, ts))()
    ys_ref, dys_ref = jax.jit(lambda: jax.jvp(per_leaf, xs, ts))()
    grads = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(*xs)
    grads_ref = jax.jit(jax.grad(loss(per_leaf), argnums=(0, 1, 2)))(*xs)
    for got, want in zip([*ys, *dys, *grads], [*ys_ref, *dys_ref, *grads_ref]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_a_fused_call_with_an_integer_leaf_has_zero_tangent(small_fusion_limits):
    x, n = jnp.ones(3), jnp.arange(3)
    _, (dx, dn) = jax.jvp(lambda a, b: mpicoll.allreduce([a, b]), (x, n),
                          (jnp.ones(3), np.zeros(3, jax.dtypes.float0)))
    np.testing.assert_array_equal(np.asarray(dx), np.full(3, SIZE, np.float32))
    assert dn.dtype == jax.dtypes.float0


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs two ranks; the matching case runs below")
def test_check_mode_sees_a_different_tree_on_one_rank():
    """Rank 0 fuses 2 leaves, the others 3: every rank raises, naming each rank's call."""
    previous = mpicoll.set_check_mode(True)
    try:
        leaves = [jnp.ones(4, jnp.float32)] * (2 if RANK == 0 else 3)
        with pytest.raises(Exception, match="ranks called different collectives") as error:
            jax.block_until_ready(mpicoll.allreduce(leaves))
        assert "fused 2 arrays: allreduce(float32[8], op=sum)" in str(error.value)
        assert "fused 3 arrays: allreduce(float32[12], op=sum)" in str(error.value)
        # The mismatched call did not run: the ranks are still in step.
        out = mpicoll.allreduce([jnp.ones(2, jnp.float32), jnp.full(3, 2.0, jnp.float32)])
        np.testing.assert_array_equal(np.asarray(out[1]), np.full(3, 2.0 * SIZE, np.float32))
    finally:
        mpicoll.set_check_mode(previous)


@pytest.mark.parametrize("name", STACKED_INPUT + ("gather", "allgather"))
def test_check_mode_passes_matching_fused_calls(name):
    stacks = [np.stack([rank_data(input_shape(name, (2, 3)), np.int32, r, 80 + i)
                        for r in range(SIZE)]) for i in range(3)]
    previous = mpicoll.set_check_mode(True)
    try:
        out = call(name, [jnp.asarray(stack[RANK]) for stack in stacks], 0)
    finally:
        mpicoll.set_check_mode(previous)
    for stack, leaf in zip(stacks, out):
        assert_same(leaf, expected(name, stack, root=0))

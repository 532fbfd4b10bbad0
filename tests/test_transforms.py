"""vmap and autodiff of every collective, against one-process references.

Every rank regenerates the data of all ranks, X with shape (size, *s); rank r
feeds X[r] to mpicoll.  The reference is the same global function written in
one process on X with jax.numpy.  Following the shard_map convention, a
replicated output (allreduce, allgather, bcast) is one value: its cotangent is
the same on every rank and the reference differentiates that single value; a
rank-varying output is the rank's own, and the reference stacks them.
"""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll

jax.config.update("jax_enable_x64", True)

COMM = MPI.COMM_WORLD

# These tests check mpicoll's autodiff convention outside mpicoll.mesh()
# (test_ranks_axis.py checks the typed path, and the refusal by default).
pytestmark = pytest.mark.usefixtures("convention_autodiff")

RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
ROOT = SIZE - 1  # a root other than 0 whenever there are several ranks


def _reduce(X, op):
    return {"sum": X.sum, "prod": X.prod, "max": X.max, "min": X.min}[op](axis=0)


def _exclusive_cumsum(X):
    return jnp.concatenate([jnp.zeros_like(X[:1]), jnp.cumsum(X, axis=0)[:-1]])


def _zeros_but(r, value):
    return jnp.where(jnp.arange(SIZE).reshape((-1,) + (1,) * value.ndim) == r, value, 0)


# name -> (mpicoll function of the rank's x, one-process function of all ranks' X,
#          whether the output is replicated, the per-rank input shape)
CASES = {
    "allreduce-sum": (lambda x: mpicoll.allreduce(x), lambda X: _reduce(X, "sum"), True, (3, 2)),
    "allreduce-prod": (lambda x: mpicoll.allreduce(x, "prod"), lambda X: _reduce(X, "prod"), True, (3, 2)),
    "allreduce-max": (lambda x: mpicoll.allreduce(x, "max"), lambda X: _reduce(X, "max"), True, (3, 2)),
    "allreduce-min": (lambda x: mpicoll.allreduce(x, "min"), lambda X: _reduce(X, "min"), True, (3, 2)),
    "reduce-sum": (lambda x: mpicoll.reduce(x, "sum", ROOT),
                   lambda X: _zeros_but(ROOT, _reduce(X, "sum")), False, (3, 2)),
    "reduce-prod": (lambda x: mpicoll.reduce(x, "prod", ROOT),
                    lambda X: _zeros_but(ROOT, _reduce(X, "prod")), False, (3, 2)),
    "reduce-max": (lambda x: mpicoll.reduce(x, "max", ROOT),
                   lambda X: _zeros_but(ROOT, _reduce(X, "max")), False, (3, 2)),
    "bcast": (lambda x: mpicoll.bcast(x, ROOT), lambda X: X[ROOT], True, (3, 2)),
    "allgather": (lambda x: mpicoll.allgather(x), lambda X: X, True, (3, 2)),
    "gather": (lambda x: mpicoll.gather(x, ROOT), lambda X: _zeros_but(ROOT, X), False, (3, 2)),
    "scatter": (lambda x: mpicoll.scatter(x, ROOT), lambda X: X[ROOT], False, (SIZE, 3)),
    "alltoall": (lambda x: mpicoll.alltoall(x), lambda X: jnp.swapaxes(X, 0, 1), False, (SIZE, 3)),
    "reduce_scatter-sum": (lambda x: mpicoll.reduce_scatter(x), lambda X: X.sum(axis=0), False,
                           (SIZE, 3)),
    "scan-sum": (lambda x: mpicoll.scan(x), lambda X: jnp.cumsum(X, axis=0), False, (3, 2)),
    "exscan-sum": (lambda x: mpicoll.exscan(x), lambda X: _exclusive_cumsum(X), False, (3, 2)),
    # A ring: rank r sends to r + 1 and receives from r - 1.
    "sendrecv": (lambda x: mpicoll.sendrecv(x, (RANK - 1) % SIZE, (RANK + 1) % SIZE),
                 lambda X: jnp.roll(X, 1, axis=0), False, (3, 2)),
}


# The vector collectives: every rank's input is padded to MAX_ROWS rows (the
# harness stacks equal shapes) and sliced to its count before the call; outputs
# that differ in length between ranks are padded back.
VCOUNTS = tuple(1 + r % 2 for r in range(SIZE))  # rows per rank
MAX_ROWS = 2 * SIZE


def _pairs(r, j):
    """alltoallv: rows rank r sends to rank j (symmetric, so also what j sends r)."""
    return 1 + (r + j) % 2


def _pad(value, rows=MAX_ROWS):
    return jnp.pad(value, ((0, rows - value.shape[0]),) + ((0, 0),) * (value.ndim - 1))


def _concat_counts(X, counts):
    return jnp.concatenate([X[r, :counts[r]] for r in range(SIZE)])


def _alltoallv_local(x):
    send = tuple(_pairs(RANK, j) for j in range(SIZE))
    return _pad(mpicoll.alltoallv(x[:sum(send)], send, send))


def _alltoallv_global(X):
    def received(r):  # rank r's rows: from every j, the part j sends to r
        return jnp.concatenate([X[j, sum(_pairs(j, k) for k in range(r)):][:_pairs(j, r)]
                                for j in range(SIZE)])
    return jnp.stack([_pad(received(r)) for r in range(SIZE)])


CASES.update({
    "gatherv": (lambda x: mpicoll.gatherv(x[:VCOUNTS[RANK]], VCOUNTS, ROOT),
                lambda X: _zeros_but(ROOT, _concat_counts(X, VCOUNTS)),
                False, (MAX_ROWS, 3)),
    "allgatherv": (lambda x: mpicoll.allgatherv(x[:VCOUNTS[RANK]], VCOUNTS),
                   lambda X: _concat_counts(X, VCOUNTS), True, (MAX_ROWS, 3)),
    "scatterv": (lambda x: _pad(mpicoll.scatterv(x[:sum(VCOUNTS)], VCOUNTS, ROOT)),
                 lambda X: jnp.stack([_pad(X[ROOT, sum(VCOUNTS[:r]):sum(VCOUNTS[:r + 1])])
                                      for r in range(SIZE)]), False, (MAX_ROWS, 3)),
    "alltoallv": (_alltoallv_local, _alltoallv_global, False, (MAX_ROWS, 3)),
})
LINEAR = [name for name in CASES if not name.endswith(("-prod", "-max", "-min"))]


def global_data(shape, dtype, seed, near_one=False):
    """All ranks' inputs, identical on every rank: X[r] is rank r's input.

    Distinct magnitudes keep max/min free of ties, so derivatives are unique.
    near_one: magnitudes between 2**(-1/size) and 2**(1/size), so that a product
    over ranks stays between 1/2 and 2 in magnitude at any rank count (otherwise
    it grows like size!, and sin() of it amplifies rounding past any tolerance).
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.prod((SIZE, *shape))).reshape((SIZE, *shape))
    if near_one:
        X = 2.0 ** ((2 * order / max(order.size - 1, 1) - 1) / SIZE)
    else:
        X = order / 7.0 + 0.5
    X = X * rng.choice([-1.0, 1.0], size=X.shape)
    if np.issubdtype(dtype, np.complexfloating):
        X = X + 1j * rng.normal(size=X.shape) / (SIZE if near_one else 1)
    return jnp.asarray(X, dtype)


def case_data(name, shape, dtype, seed):
    """global_data for the inputs of CASES[name]: near one for products over ranks."""
    return global_data(shape, dtype, seed, near_one=name.endswith("-prod"))


def random_like(shape, dtype, seed):
    """An array identical on every rank (cotangents, weights)."""
    rng = np.random.default_rng(seed)
    value = rng.normal(size=shape)
    if np.issubdtype(dtype, np.complexfloating):
        value = value + 1j * rng.normal(size=shape)
    return jnp.asarray(value, dtype)


def tolerance(dtype):
    return dict(rtol=2e-5, atol=2e-5) if jnp.finfo(dtype).bits <= 32 else dict(rtol=1e-10, atol=1e-10)


def allsum(value):
    return COMM.allreduce(float(value), op=MPI.SUM)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", CASES)
def test_jvp_matches_one_process_reference(name, dtype):
    local_fn, global_fn, replicated, shape = CASES[name]
    X, T = case_data(name, shape, dtype, 0), global_data(shape, dtype, 1)
    y, dy = jax.jvp(local_fn, (X[RANK],), (T[RANK],))
    Y, dY = jax.jvp(global_fn, (X,), (T,))
    expect_y, expect_dy = (Y, dY) if replicated else (Y[RANK], dY[RANK])
    np.testing.assert_allclose(y, expect_y, **tolerance(dtype))
    np.testing.assert_allclose(dy, expect_dy, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("name", CASES)
def test_vjp_matches_one_process_reference(name, dtype):
    local_fn, global_fn, replicated, shape = CASES[name]
    X = case_data(name, shape, dtype, 0)
    y, pullback = jax.vjp(jax.jit(local_fn), X[RANK])
    Y, global_pullback = jax.vjp(global_fn, X)
    C = random_like(Y.shape, dtype, 2)  # the cotangent of the global output
    (ct_x,) = pullback(C if replicated else C[RANK])
    (ct_X,) = global_pullback(C)
    np.testing.assert_allclose(ct_x, ct_X[RANK], **tolerance(dtype))


@pytest.mark.parametrize("name", CASES)
def test_grad_matches_one_process_and_finite_differences(name):
    """Gradient of a non-linear global objective, checked two independent ways."""
    local_fn, global_fn, replicated, shape = CASES[name]
    X = case_data(name, shape, jnp.float64, 0)
    out_shape = jax.eval_shape(global_fn, X).shape
    W = random_like(out_shape, jnp.float64, 3)  # per rank (W[r]) for varying outputs

    def local_objective(x):
        w = W if replicated else W[RANK]
        return jnp.sum(jnp.sin(local_fn(x)) * w)

    def global_objective(X):
        Y = global_fn(X)
        return jnp.sum(jnp.sin(Y) * W)  # replicated: counted once; varying: summed over ranks

    grad = jax.grad(local_objective)(X[RANK])
    # Central finite differences along a direction V of all ranks' inputs
    # (computed before any assertion so that ranks stay in step).
    V = global_data(shape, jnp.float64, 4)
    eps = 1e-6
    value = lambda x: local_objective(x) if not replicated else local_objective(x) / SIZE  # noqa: E731
    numeric = (allsum(value(X[RANK] + eps * V[RANK])) - allsum(value(X[RANK] - eps * V[RANK]))) / (2 * eps)
    analytic = allsum(jnp.vdot(grad, V[RANK]))

    np.testing.assert_allclose(grad, jax.grad(global_objective)(X)[RANK], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", LINEAR)
def test_complex_vjp_of_linear_collectives(name):
    local_fn, global_fn, replicated, shape = CASES[name]
    X = global_data(shape, jnp.complex128, 0)
    _, pullback = jax.vjp(local_fn, X[RANK])
    Y, global_pullback = jax.vjp(global_fn, X)
    C = random_like(Y.shape, jnp.complex128, 2)
    np.testing.assert_allclose(pullback(C if replicated else C[RANK])[0],
                               global_pullback(C)[0][RANK], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["allreduce-sum", "allgather", "scatter", "alltoall", "gather",
                                  "reduce_scatter-sum", "scan-sum", "sendrecv", "allgatherv",
                                  "alltoallv"])
def test_linear_transpose_jacrev_jacfwd_checkpoint(name):
    local_fn, global_fn, replicated, shape = CASES[name]
    X = case_data(name, shape, jnp.float64, 0)
    Y, global_pullback = jax.vjp(global_fn, X)
    C = random_like(Y.shape, jnp.float64, 2)
    # Every collective runs before any assertion, so a failure cannot desynchronize ranks.
    (transposed,) = jax.linear_transpose(local_fn, X[RANK])(C if replicated else C[RANK])
    jac_rev = jax.jacrev(local_fn)(X[RANK])
    jac_fwd = jax.jacfwd(local_fn)(X[RANK])
    objective = lambda x: jnp.sum(jnp.sin(local_fn(x)))  # noqa: E731
    grad = jax.grad(objective)(X[RANK])
    checkpointed = jax.grad(jax.checkpoint(objective))(X[RANK])

    np.testing.assert_allclose(transposed, global_pullback(C)[0][RANK], rtol=1e-12)
    # J = d Y / d X; its axis `source` indexes the rank whose input is perturbed.
    J = jax.jacrev(global_fn)(X)
    source = J.ndim - len(shape) - 1
    # Reverse (forward) mode seeds the same basis vector on every rank at once:
    # rank r's Jacobian sums the global one over the output (input) ranks.
    if replicated:
        expect_rev, expect_fwd = jnp.take(J, RANK, axis=source), J.sum(axis=source)
    else:
        expect_rev, expect_fwd = jnp.take(J, RANK, axis=source).sum(axis=0), J[RANK].sum(axis=source - 1)
    np.testing.assert_allclose(jac_rev, expect_rev, rtol=1e-12)
    np.testing.assert_allclose(jac_fwd, expect_fwd, rtol=1e-12)
    np.testing.assert_allclose(checkpointed, grad, rtol=1e-12)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_transposing_allreduce_twice_gives_allreduce(mode):
    """Its transpose passes the cotangent through; the transpose of that is the
    allreduce again (mpi4jax's tests check this, and matrix-free solvers need it)."""
    x = jnp.arange(6.0).reshape(3, 2) * (RANK + 1)
    once = lambda y: jax.linear_transpose(mpicoll.allreduce, x)(y)[0]  # noqa: E731
    twice = lambda y: jax.linear_transpose(once, x)(y)[0]  # noqa: E731
    run = jax.jit(twice) if mode == "jit" else twice
    np.testing.assert_array_equal(np.asarray(once(x)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(run(x)),
                                  np.arange(6.0).reshape(3, 2) * SIZE * (SIZE + 1) / 2)


def test_derivative_of_bitwise_reduction_is_zero_for_integers_and_errors_for_nonlinear_transpose():
    x = jnp.arange(3, dtype=jnp.int32) + RANK
    y, dy = jax.jvp(lambda v: mpicoll.allreduce(v, "bxor"), (x,),
                    (np.zeros(3, dtype=jax.dtypes.float0),))
    np.testing.assert_array_equal(y, functools.reduce(np.bitwise_xor, [np.arange(3) + r for r in range(SIZE)]))
    with pytest.raises(NotImplementedError, match="allreduce.*max.*not linear"):
        jax.linear_transpose(lambda v: mpicoll.allreduce(v, "max"), jnp.ones(3))(jnp.ones(3))


# ---------------------------------------------------------------------------
# vmap: one call for the whole batch, equal to a Python loop over the batch.

@pytest.mark.parametrize("in_axis", [0, 1, -1])
@pytest.mark.parametrize("name", LINEAR + ["allreduce-max", "reduce-prod"])
def test_vmap_matches_python_loop(name, in_axis):
    local_fn, _, _, shape = CASES[name]
    batch = 4
    X = case_data(name, (batch, *shape), jnp.float64, 0)[RANK]  # (batch, *shape)
    xb = jnp.moveaxis(X, 0, in_axis)
    looped = jnp.stack([local_fn(X[b]) for b in range(batch)])
    mapped = jax.vmap(local_fn, in_axes=in_axis)(xb)
    mapped_jit = jax.jit(jax.vmap(local_fn, in_axes=in_axis, out_axes=-1))(xb)
    np.testing.assert_allclose(mapped, looped, rtol=1e-12)
    np.testing.assert_allclose(mapped_jit, jnp.moveaxis(looped, 0, -1), rtol=1e-12)


@pytest.mark.parametrize("name", ["allgather", "scatter", "alltoall", "reduce-sum", "allreduce-max"])
def test_nested_vmap_and_vmap_of_grad(name):
    local_fn, _, _, shape = CASES[name]
    X = case_data(name, (2, 3, *shape), jnp.float64, 0)[RANK]
    nested = jax.vmap(jax.vmap(local_fn, in_axes=1), in_axes=0)(jnp.moveaxis(X, 1, 2))
    looped = jnp.stack([jnp.stack([local_fn(X[i, j]) for j in range(3)]) for i in range(2)])
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(local_fn(x))))
    grads, grads_looped = jax.vmap(grad)(X[0]), jnp.stack([grad(X[0, j]) for j in range(3)])
    np.testing.assert_allclose(nested, looped, rtol=1e-12)
    np.testing.assert_allclose(grads, grads_looped, rtol=1e-12)


def test_vmap_issues_one_mpi_call_for_the_batch():
    """The lowered program of a vmapped collective contains a single custom call."""
    fn = jax.jit(jax.vmap(lambda v: mpicoll.allgather(v), in_axes=1))
    text = fn.lower(jnp.ones((3, 16))).as_text()
    assert text.count("mpicoll_allgather") == 1


# ---------------------------------------------------------------------------
# pvary and data-parallel training.

def test_pvary_takes_a_pytree():
    params = {"w": jnp.ones(3), "b": [jnp.asarray(2.0)]}
    varying = mpicoll.pvary(params)
    assert jax.tree.structure(varying) == jax.tree.structure(params)

    def local(p):
        p = mpicoll.pvary(p)
        return (p["w"] * (RANK + 1)).sum() + p["b"][0] * RANK

    grads = jax.jit(jax.grad(local))(params)
    # Each leaf's cotangent is summed over the ranks.
    np.testing.assert_allclose(np.asarray(grads["w"]), np.full(3, SIZE * (SIZE + 1) / 2))
    np.testing.assert_allclose(float(grads["b"][0]), SIZE * (SIZE - 1) / 2)


def test_pvary_sums_cotangents_of_a_replicated_value_used_per_rank():
    w = jnp.arange(3.0)  # identical on every rank
    X = global_data((3,), jnp.float64, 0)
    local = lambda w: jnp.sum(jnp.sin(mpicoll.pvary(w) * X[RANK]))  # noqa: E731
    global_ = lambda w: sum(jnp.sum(jnp.sin(w * X[r])) for r in range(SIZE))  # noqa: E731
    np.testing.assert_allclose(jax.grad(local)(w), jax.grad(global_)(w), rtol=1e-12)


def _mlp_loss(params, x, y):
    (w1, b1), (w2, b2) = params
    hidden = jnp.tanh(x @ w1 + b1)
    return jnp.mean((hidden @ w2 + b2 - y) ** 2)


def _init_params():
    rng = np.random.default_rng(7)
    return [(jnp.asarray(rng.normal(size=(4, 16)) * 0.5), jnp.zeros(16)),
            (jnp.asarray(rng.normal(size=(16, 1)) * 0.5), jnp.zeros(1))]


def test_the_readme_data_parallel_program_trains_as_one_process():
    """README.md's program (tests/test_docs.py runs it at 2 ranks; here its result is
    checked): every rank ends with the parameters of one process training on every
    rank's samples (equal shares, so the mean of the ranks' gradients is the full one)."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"<!-- data-parallel -->\n```python\n(.*?)^```", text, re.S | re.M).group(1)
    names = {"__name__": "readme_program"}
    exec(compile(code, "README.md (data-parallel)", "exec"), names)
    loss, lr = names["loss"], names["learning_rate"]
    x_all, y_all = jnp.asarray(names["x_all"]), jnp.asarray(names["y_all"])
    assert len(x_all) % SIZE == 0, "the README's samples must split evenly at this rank count"
    reference = jax.tree.map(jnp.zeros_like, names["params"])  # the program starts from zeros
    for _ in range(names["steps"]):
        reference = jax.tree.map(lambda p, g: p - lr * g, reference,
                                 jax.grad(loss)(reference, x_all, y_all))
    for got, want in zip(jax.tree.leaves(names["params"]), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    everyone = COMM.allgather([np.asarray(leaf) for leaf in jax.tree.leaves(names["params"])])
    for other in everyone:
        for got, want in zip(other, everyone[0]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("style", ["allreduce-grads", "grad-through-collectives"])
def test_data_parallel_training_matches_single_process(style):
    rng = np.random.default_rng(11)
    per_rank = 8
    X = jnp.asarray(rng.normal(size=(SIZE * per_rank, 4)))
    Y = jnp.sin(X.sum(axis=1, keepdims=True))
    x, y = X[RANK * per_rank:(RANK + 1) * per_rank], Y[RANK * per_rank:(RANK + 1) * per_rank]
    lr = 0.1

    if style == "allreduce-grads":
        @jax.jit
        def step(params):
            grads = jax.grad(_mlp_loss)(params, x, y)
            grads = jax.tree.map(lambda g: mpicoll.allreduce(g) / SIZE, grads)
            return jax.tree.map(lambda p, g: p - lr * g, params, grads)
    else:
        def global_loss(params):  # docs/autodiff.md's convention program, as written there
            local = _mlp_loss(mpicoll.pvary(params), x, y)
            return mpicoll.allreduce(local) / SIZE

        @jax.jit
        def step(params):
            grads = jax.grad(global_loss)(params)
            return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    reference_step = jax.jit(lambda params: jax.tree.map(
        lambda p, g: p - lr * g, params, jax.grad(_mlp_loss)(params, X, Y)))
    params = reference = _init_params()
    for _ in range(5):
        params, reference = step(params), reference_step(reference)
    for got, expect in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, expect, rtol=1e-10, atol=1e-12)

"""reduce_scatter, scan, exscan and the vector collectives against numpy, read
off the semantics table:

    reduce_scatter(x, op)       x: (size, *s) -> s; rank r: op over ranks of x[r]
    scan(x, op)                 -> x.shape; rank r: op over ranks 0..r
    exscan(x, op)               -> x.shape; rank r: op over ranks 0..r-1; zeros on rank 0
    gatherv(x, counts, root)    x: (counts[r], *s) -> (sum(counts), *s) on root, zeros elsewhere
    allgatherv(x, counts)       x: (counts[r], *s) -> (sum(counts), *s)
    scatterv(x, counts, root)   x: (sum(counts), *s) -> (counts[r], *s)
    alltoallv(x, sends, recvs)  x: (sum(sends), *s) -> (sum(recvs), *s), rows by source rank

(vmap and autodiff: tests/test_transforms.py.)  Every (op, dtype) pair under
jit at 1-2 ranks, one dtype per family at 3-4; eager calls for one dtype per
family.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from conftest import (ALL_DTYPES, INTEGER_DTYPES, RANK, REPRESENTATIVE_DTYPES, SIZE, VALID_PAIRS,
                      all_ranks_data, assert_same, maybe_jit, pair_id, rank_data,
                      reduce_reference)

DTYPES = ALL_DTYPES if SIZE <= 2 else REPRESENTATIVE_DTYPES
PAIRS = [(op, dtype) for op, dtype in VALID_PAIRS if dtype in DTYPES]
FIRST_PAIRS = [next(p for p in VALID_PAIRS if p[1] == dtype) for dtype in REPRESENTATIVE_DTYPES]


def expected_prefix(name, stack, op, rank=RANK):
    if name == "reduce_scatter":
        return reduce_reference(stack[:, rank], op)
    if name == "scan":
        return reduce_reference(stack[:rank + 1], op)
    if rank == 0:  # exscan
        return np.zeros_like(stack[0])
    return reduce_reference(stack[:rank], op)


def prefix_calls(x_rs, x, op):
    return (mpicoll.reduce_scatter(x_rs, op), mpicoll.scan(x, op), mpicoll.exscan(x, op))


def check_prefix(outs, rs_stack, stack, op):
    for name, out, data in zip(("reduce_scatter", "scan", "exscan"), outs,
                               (rs_stack, stack, stack)):
        assert_same(out, expected_prefix(name, data, op))


@pytest.mark.parametrize("op,dtype", PAIRS, ids=[pair_id(p) for p in PAIRS])
def test_prefix_and_reduce_scatter_every_op_and_dtype(op, dtype):
    rs_stack = all_ranks_data((SIZE, 3, 2), dtype, seed=21, kind=op)
    stack = all_ranks_data((4, 3), dtype, seed=22, kind=op)
    outs = jax.jit(lambda a, b: prefix_calls(a, b, op))(rs_stack[RANK], stack[RANK])
    check_prefix(outs, rs_stack, stack, op)


@pytest.mark.parametrize("op,dtype", FIRST_PAIRS, ids=[pair_id(p) for p in FIRST_PAIRS])
def test_prefix_and_reduce_scatter_eager(op, dtype):
    rs_stack = all_ranks_data((SIZE, 5), dtype, seed=23, kind=op)
    stack = all_ranks_data((5,), dtype, seed=24, kind=op)
    outs = prefix_calls(jnp.asarray(rs_stack[RANK]), stack[RANK], op)  # jax and numpy inputs
    check_prefix(outs, rs_stack, stack, op)


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (2, 3, 4)], ids=str)
def test_prefix_and_reduce_scatter_shapes_and_layouts(shape, mode):
    """Scalars, empty and 3-d arrays; a transposed input."""
    rs_stack = all_ranks_data((SIZE, *shape), np.float32, seed=25, kind="sum")
    stack = all_ranks_data(shape[::-1], np.int16, seed=26, kind="sum")
    fn = lambda a, b: prefix_calls(a, b.T, "sum")  # noqa: E731
    outs = (jax.jit(fn) if mode == "jit" else fn)(rs_stack[RANK], stack[RANK])
    check_prefix(outs, rs_stack, np.stack([s.T for s in stack]), "sum")


@pytest.mark.parametrize("op", ["land", "lor", "lxor"])
def test_logical_prefix_ops_give_truth_values(op):
    """MPI applies no operator on the rank whose prefix is one rank's input: mpicoll gives 0/1."""
    values = np.array([0, 1, 2, -3, 0, 5, -1, 0, 7], np.int32)
    stack = np.stack([np.roll(values, r) for r in range(SIZE)])
    rs_stack = np.stack([np.stack([np.roll(values, r + j) for j in range(SIZE)])
                         for r in range(SIZE)])
    outs = jax.jit(lambda a, b: prefix_calls(a, b, op))(rs_stack[RANK], stack[RANK])
    check_prefix(outs, rs_stack, stack, op)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_prefix_and_reduce_scatter_pytrees(mode):
    """Leaves fuse into one message per dtype (exscan's zeros on rank 0 included)."""
    shapes = [((3,), np.int32), ((2, 2), np.float32), ((), np.float32), ((0,), np.int32)]
    stacks = [all_ranks_data(s, d, seed=27 + i, kind="sum") for i, (s, d) in enumerate(shapes)]
    rs_stacks = [all_ranks_data((SIZE, *s), d, seed=37 + i, kind="sum")
                 for i, (s, d) in enumerate(shapes)]
    fn = lambda a, b: prefix_calls(a, b, "sum")  # noqa: E731
    outs = (jax.jit(fn) if mode == "jit" else fn)([jnp.asarray(s[RANK]) for s in rs_stacks],
                                                   [jnp.asarray(s[RANK]) for s in stacks])
    for i in range(len(shapes)):
        check_prefix([outs[0][i], outs[1][i], outs[2][i]], rs_stacks[i], stacks[i], "sum")


def test_prefix_and_reduce_scatter_on_a_split_communicator():
    comm = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    try:
        members = [r for r in range(SIZE) if r % 2 == RANK % 2]
        size, rank = len(members), members.index(RANK)
        rs = np.stack([rank_data((size, 2), np.int64, r, 40, "sum") for r in members])
        xs = np.stack([rank_data((3,), np.int64, r, 41, "sum") for r in members])
        outs = jax.jit(lambda a, b: (mpicoll.reduce_scatter(a, comm=comm),
                                     mpicoll.scan(b, comm=comm),
                                     mpicoll.exscan(b, comm=comm)))(rs[rank], xs[rank])
    finally:
        comm.Free()
    for name, out, data in zip(("reduce_scatter", "scan", "exscan"), outs, (rs, xs, xs)):
        assert_same(out, expected_prefix(name, data, "sum", rank))


@pytest.fixture
def pairwise_reduce_scatter():
    """Sets mpicoll's own reduce-scatter's (min block bytes, segment bytes) for one test."""
    sizes = mpicoll._src.runtime.native.extension.pairwise_reduce_scatter
    default = sizes()
    yield sizes
    sizes(*default)


# Blocks of 7 and 1030 elements in segments of 64 bytes: odd splits (a last
# segment shorter than the others, segments of 64/itemsize elements).
@pytest.mark.parametrize("op,dtype", PAIRS, ids=[pair_id(p) for p in PAIRS])
def test_pairwise_reduce_scatter_every_op_and_dtype(op, dtype, pairwise_reduce_scatter):
    """mpicoll's own reduce-scatter (every block, forced) against numpy, also in chunks."""
    pairwise_reduce_scatter(0, 64)
    stacks = [all_ranks_data((SIZE, n), dtype, seed=60 + n, kind=op) for n in (7, 1030)]
    outs = jax.jit(lambda xs: [mpicoll.reduce_scatter(x, op) for x in xs])(
        [s[RANK] for s in stacks])
    for out, stack in zip(outs, stacks):
        assert_same(out, reduce_reference(stack[:, RANK], op))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_pairwise_reduce_scatter_at_the_default_threshold(mode, pairwise_reduce_scatter):
    """Blocks just below, at and above the default threshold (256 KiB) and an odd
    number of segments; the same results as MPI_Reduce_scatter_block's path."""
    min_bytes, segment_bytes = pairwise_reduce_scatter()
    rows = [min_bytes // 4 - 1, min_bytes // 4, 2 * segment_bytes // 4 + 3]
    stacks = [all_ranks_data((SIZE, n), np.float32, seed=70 + i, kind="sum")
              for i, n in enumerate(rows)]
    fn = maybe_jit(lambda xs: [mpicoll.reduce_scatter(x) for x in xs], mode)
    pairwise = fn([jnp.asarray(s[RANK]) for s in stacks])
    pairwise_reduce_scatter(1 << 62, -1)  # MPI's only
    by_mpi = fn([jnp.asarray(s[RANK]) for s in stacks])
    for out, mpi_out, stack in zip(pairwise, by_mpi, stacks):
        assert_same(out, reduce_reference(stack[:, RANK], "sum"))
        assert_same(out, np.asarray(mpi_out))


@pytest.mark.skipif(SIZE < 3, reason="needs a third rank whose message could be confused")
def test_pairwise_reduce_scatter_messages_never_match_a_user_receive(pairwise_reduce_scatter):
    """Its messages go on a private duplicate: rank 1 posts a receive from
    ANY_SOURCE with ANY_TAG before its reduce_scatter, while rank 0 is already
    in the reduce_scatter sending to rank 1; rank 1 must get rank 2's message."""
    pairwise_reduce_scatter(0, 64)
    stack = all_ranks_data((SIZE, 33), np.int64, seed=42, kind="sum")
    mark = jnp.full((2,), 7 + RANK, jnp.int32)

    def program(x):
        got = mark
        if RANK == 1:
            got = mpicoll.recv(mark, mpicoll.ANY_SOURCE, tag=mpicoll.ANY_TAG)
        if RANK == 2:
            mpicoll.send(mark, 1, tag=5)
        return mpicoll.reduce_scatter(x), got

    out, got = jax.jit(program)(stack[RANK])
    assert_same(out, reduce_reference(stack[:, RANK], "sum"))
    assert_same(got, np.full((2,), 9 if RANK == 1 else 7 + RANK, np.int32))


def test_prefix_and_reduce_scatter_reject_bad_input():
    with pytest.raises(ValueError, match=r"reduce_scatter: x must have shape \(comm size"):
        mpicoll.reduce_scatter(jnp.ones((SIZE + 1, 2)))
    with pytest.raises(TypeError, match=r"scan: op='band' is not defined for dtype float32"):
        mpicoll.scan(jnp.ones(2, jnp.float32), "band")
    with pytest.raises(ValueError, match=r"exscan: unknown op='mean'"):
        mpicoll.exscan(jnp.ones(2), "mean")
    with pytest.raises(NotImplementedError, match=r"scan: axis_name is not supported"):
        mpicoll.scan(jnp.ones(2), axis_name="i")
    with pytest.raises(NotImplementedError, match=r"scan: op='max' has no derivative"):
        jax.grad(lambda v: mpicoll.scan(v, "max").sum())(jnp.ones(2))
    with pytest.raises(NotImplementedError, match=r"reduce_scatter: op='max' is not linear"):
        jax.linear_transpose(lambda v: mpicoll.reduce_scatter(v, "max"),
                             jnp.ones((SIZE, 2)))(jnp.ones(2))


# ---------------------------------------------------------------------------
# Vector collectives: unequal counts, a rank with none.

COUNTS = tuple((r + 1) % 3 for r in range(SIZE))  # 1, 2, 0, 1, ...: rank 2 sends no rows
SENDS = tuple((RANK + j) % 3 for j in range(SIZE))  # rows rank RANK sends to j (symmetric)


def _block(rows, dtype, rank, seed, row_shape=(2,)):
    return rank_data((rows, *row_shape), dtype, rank, seed)


def expected_vector(name, dtype, seed, root, row_shape=(2,)):
    everything = np.concatenate([_block(COUNTS[r], dtype, r, seed, row_shape)
                                 for r in range(SIZE)])
    if name == "gatherv":
        return everything if RANK == root else np.zeros_like(everything)
    if name == "allgatherv":
        return everything
    if name == "scatterv":
        root_x = _block(sum(COUNTS), dtype, root, seed, row_shape)
        start = sum(COUNTS[:RANK])
        return root_x[start:start + COUNTS[RANK]]
    # alltoallv: from every rank j, the rows j sends to RANK
    parts = []
    for j in range(SIZE):
        x_j = _block(sum((j + k) % 3 for k in range(SIZE)), dtype, j, seed, row_shape)
        start = sum((j + k) % 3 for k in range(RANK))
        parts.append(x_j[start:start + (j + RANK) % 3])
    return np.concatenate(parts)


def vector_call(name, dtype, seed, root, row_shape=(2,)):
    """(the function of x, x) for collective `name` on this rank."""
    if name in ("gatherv", "allgatherv"):
        x = _block(COUNTS[RANK], dtype, RANK, seed, row_shape)
        fn = (lambda a: mpicoll.gatherv(a, COUNTS, root)) if name == "gatherv" else \
            (lambda a: mpicoll.allgatherv(a, COUNTS))
    elif name == "scatterv":
        x = _block(sum(COUNTS), dtype, RANK, seed, row_shape)
        fn = lambda a: mpicoll.scatterv(a, COUNTS, root)  # noqa: E731
    else:
        x = _block(sum(SENDS), dtype, RANK, seed, row_shape)
        fn = lambda a: mpicoll.alltoallv(a, SENDS, SENDS)  # noqa: E731
    return fn, x


VECTOR = ("gatherv", "allgatherv", "scatterv", "alltoallv")


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", VECTOR)
def test_vector_every_dtype(name, dtype, mode):
    root = SIZE - 1
    fn, x = vector_call(name, dtype, 50, root)
    out = (jax.jit(fn) if mode == "jit" else fn)(jnp.asarray(x))
    assert_same(out, expected_vector(name, dtype, 50, root))


@pytest.mark.parametrize("row_shape", [(), (0,), (3, 2)], ids=str)
@pytest.mark.parametrize("name", VECTOR)
def test_vector_row_shapes(name, row_shape):
    fn, x = vector_call(name, np.float64, 51, 0, row_shape)
    out = jax.jit(fn)(x)
    assert_same(out, expected_vector(name, np.float64, 51, 0, row_shape))


def test_vector_reject_bad_counts():
    x = jnp.ones((COUNTS[RANK], 2))
    with pytest.raises(ValueError, match=rf"gatherv: counts has {SIZE + 1} entries"):
        mpicoll.gatherv(x, COUNTS + (1,))
    with pytest.raises(ValueError, match="allgatherv: counts has a negative count"):
        mpicoll.allgatherv(x, (-1,) * SIZE)
    with pytest.raises(TypeError, match="scatterv: counts must be a tuple of ints"):
        mpicoll.scatterv(x, 3)
    with pytest.raises(ValueError, match=r"scatterv: x must have sum\(counts\)"):
        mpicoll.scatterv(jnp.ones((sum(COUNTS) + 1, 2)), COUNTS)
    with pytest.raises(ValueError, match="gatherv: root=-1 is out of range"):
        mpicoll.gatherv(x, COUNTS, -1)
    with pytest.raises(ValueError, match="gatherv: x must have a leading axis"):
        mpicoll.gatherv(jnp.float32(1), COUNTS)
    # The one rank-dependent check, made to fail on every rank here: the messages
    # name each rank's own numbers, so with several ranks the ranks compare their
    # rejections and every rank raises the mismatch, listing them.
    raised = ValueError if SIZE == 1 else jax.errors.JaxRuntimeError
    with pytest.raises(raised, match=rf"on rank {RANK}, x has {COUNTS[RANK] + 1} rows"):
        jax.jit(lambda a: mpicoll.allgatherv(a, COUNTS))(jnp.ones((COUNTS[RANK] + 1, 2)))
    with pytest.raises(raised, match=r"but sum\(send_counts\)"):
        mpicoll.alltoallv(jnp.ones((sum(SENDS) + 1,)), SENDS, SENDS)


@pytest.mark.skipif(SIZE < 2, reason="needs a rank that is right and one that is wrong")
def test_a_wrong_row_count_on_one_rank_raises_on_every_rank():
    """First-run checks: rank 0's rejection meets the other ranks' call; all raise."""
    rows = COUNTS[RANK] + (1 if RANK == 0 else 0)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"(?s)ranks called different.*"
                                                         r"rejected: mpicoll.gatherv: on rank 0"):
        jax.block_until_ready(mpicoll.gatherv(jnp.ones((rows, 2)), COUNTS))


@pytest.mark.skipif(SIZE < 2, reason="mismatched counts need two ranks")
def test_check_mode_sees_alltoallv_counts_that_do_not_pair_up():
    """Rank 0 expects one row too many from rank 1: every rank raises; the call does not run."""
    recvs = tuple(c + (1 if RANK == 0 and j == 1 else 0) for j, c in enumerate(SENDS))
    previous_check = mpicoll.set_check_mode(True)
    try:
        with pytest.raises(Exception, match="alltoallv counts disagree") as error:
            jax.block_until_ready(mpicoll.alltoallv(jnp.ones(sum(SENDS)), SENDS, recvs))
        if RANK == 0:
            assert f"rank 1 sends {SENDS[1]} rows here, but recv_counts[1] = {recvs[1]}" \
                in str(error.value)
        with pytest.raises(Exception, match=r"ranks called different collectives.*\n.*"
                                            r"gatherv\(float64\[\*,2\], root=0, counts="):
            other = COUNTS[:-1] + (COUNTS[-1] + 1,)  # rank 0 disagrees on the last count
            jax.block_until_ready(mpicoll.gatherv(jnp.ones((COUNTS[RANK], 2)),
                                                  other if RANK == 0 else COUNTS))
        fn, x = vector_call("gatherv", np.float32, 52, 0)
        out = fn(x)  # matching calls pass, and the ranks are still in step
    finally:
        mpicoll.set_check_mode(previous_check)
    assert_same(out, expected_vector("gatherv", np.float32, 52, 0))


@pytest.mark.parametrize("dtype", INTEGER_DTYPES[:1], ids=str)
def test_vector_on_comm_self(dtype):
    x = jnp.arange(6, dtype=dtype).reshape(3, 2)
    outs = [mpicoll.gatherv(x, (3,), comm=MPI.COMM_SELF),
            mpicoll.allgatherv(x, (3,), comm=MPI.COMM_SELF),
            mpicoll.scatterv(x, (3,), comm=MPI.COMM_SELF),
            mpicoll.alltoallv(x, (3,), (3,), comm=MPI.COMM_SELF)]
    for out in outs:
        assert_same(out, np.asarray(x))

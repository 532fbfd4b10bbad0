"""The GPU staging pipeline's logic, on every machine: no GPU needed.

The CUDA handlers stage GPU data through pinned host buffers (StagedMemory in
csrc/memory/staged.h): chunks of every rank block copied in and out with 2-D
copies while MPI moves the previous chunk, staging buffers reused across calls,
and a copy instead of MPI on one rank.  The extension's test-only
`_run_staged_on_host` instantiates that same template with HostCopier
(csrc/memory/host_copier.h: memcpy on host arrays), so a wrong offset, pitch
or chunk count shows here as a wrong result.  Small chunk sizes cut every rank
block into several chunks, the last one short.  The reference is numpy on every
rank's input, gathered with mpi4py.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll._src.runtime.native import extension
from conftest import RANK, SIZE

OPS = extension.op_codes()
FACTS = extension.collectives()
BLOCK_COLLECTIVES = [name for name, facts in FACTS.items() if facts["family"] == "blocks"]
REDUCE = {"sum": lambda stack: stack.sum(axis=0, dtype=stack.dtype),
          "max": lambda stack: stack.max(axis=0),
          "land": lambda stack: np.logical_and.reduce(stack, axis=0)}
# Bytes per chunk of every rank block: 0 = one chunk; 1 = one element per chunk.
CHUNK_BYTES = [0, 1, 40, 1000]


def run_staged(name, x, out_shape, comm, root=0, op="sum", chunk_bytes=40):
    out = np.full(out_shape, 7, dtype=x.dtype)  # garbage the collective must overwrite
    extension._run_staged_on_host(name, MPI._handleof(comm), x.dtype.name,
                                  np.ascontiguousarray(x), out, root, OPS[op], chunk_bytes)
    return out


def shapes(name, block, size):
    """(input shape, output shape) of collective `name` with rank blocks of `block`."""
    facts = FACTS[name]
    rows_in = (size,) if facts["blocks_in"] else ()
    rows_out = (size,) if facts["blocks_out"] else ()
    return rows_in + block, rows_out + block


def reference(name, stack, rank, root, op):
    """What rank `rank` gets from `name`, given every rank's input (stack[r])."""
    zeros = np.zeros_like(stack[0][0] if FACTS[name]["blocks_in"] else stack[0])
    if name == "bcast":
        return stack[root]
    if name == "scatter":
        return stack[root][rank]
    if name == "reduce":
        return REDUCE[op](stack) if rank == root else zeros
    if name == "allreduce":
        return REDUCE[op](stack)
    if name == "gather":
        return stack if rank == root else np.zeros_like(stack)
    if name == "allgather":
        return stack
    if name == "alltoall":
        return stack[:, rank]
    if name == "reduce_scatter":
        return REDUCE[op](stack[:, rank])
    if name == "scan":
        return REDUCE[op](stack[:rank + 1])
    if name == "exscan":
        return REDUCE[op](stack[:rank]) if rank > 0 else zeros
    raise AssertionError(f"no reference for {name}")


def rank_input(shape, dtype, seed, rank):
    rng = np.random.default_rng([seed, rank])
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    return rng.integers(-50, 50, size=shape).astype(dtype)  # exact sums in any dtype


def check(name, comm, block=(37,), dtype=np.float32, root=0, op="sum", chunk_bytes=40, seed=0):
    size, rank = comm.Get_size(), comm.Get_rank()
    in_shape, out_shape = shapes(name, block, size)
    x = rank_input(in_shape, dtype, seed, rank)
    out = run_staged(name, x, out_shape, comm, root, op, chunk_bytes)
    stack = np.stack(comm.allgather(x))
    expect = reference(name, stack, rank, root, op)
    return out, expect


def test_block_collectives_are_all_covered():
    assert set(BLOCK_COLLECTIVES) == {"bcast", "scatter", "reduce", "allreduce", "gather",
                                      "allgather", "alltoall", "reduce_scatter", "scan",
                                      "exscan"}


@pytest.mark.parametrize("chunk_bytes", CHUNK_BYTES)
@pytest.mark.parametrize("name", BLOCK_COLLECTIVES)
def test_pipeline_matches_numpy(name, chunk_bytes):
    root = SIZE - 1  # not 0: root-dependent copies (scatter's input, gather's output) show
    out, expect = check(name, MPI.COMM_WORLD, root=root, chunk_bytes=chunk_bytes)
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("dtype, op", [(np.int32, "max"), (np.int8, "sum"), (np.float64, "sum"),
                                       (np.bool_, "land")])
@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "scan"])
def test_pipeline_dtypes_and_ops(name, dtype, op):
    out, expect = check(name, MPI.COMM_WORLD, block=(3, 5), dtype=dtype, op=op, chunk_bytes=8)
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("name", BLOCK_COLLECTIVES)
def test_one_rank_communicator(name):
    """On one rank the collective is a copy on the device (or zeros), staged for logical ops."""
    results = [check(name, MPI.COMM_SELF, chunk_bytes=12, seed=3),
               check(name, MPI.COMM_SELF, dtype=np.int32, op="land", chunk_bytes=12, seed=4)]
    for out, expect in results:
        np.testing.assert_array_equal(out, expect)


def test_staging_buffers_are_reused_across_calls():
    """Large, then small, then large again: the buffers grow once and stale bytes never show."""
    comm = MPI.COMM_WORLD
    results = []
    for seed, block in enumerate([(1 << 19,), (5,), (1 << 19,), (1,), (1000,)]):
        for name in ("allgather", "alltoall", "allreduce"):
            results.append(check(name, comm, block=block, seed=seed, chunk_bytes=1 << 16))
    for out, expect in results:
        np.testing.assert_array_equal(out, expect)


def test_empty_and_bad_calls():
    comm = MPI.COMM_WORLD
    out, expect = check("allgather", comm, block=(0,))
    np.testing.assert_array_equal(out, expect)
    with pytest.raises(RuntimeError, match="no collective named"):
        run_staged("allgatherx", np.zeros(3, np.float32), (3,), comm)
    with pytest.raises(RuntimeError, match="takes arguments"):
        run_staged("gatherv", np.zeros(3, np.float32), (3,), comm)
    with pytest.raises(RuntimeError, match="unsupported dtype/op"):
        run_staged("allreduce", np.zeros(3, np.float16), (3,), comm, op="band")
    assert RANK < SIZE

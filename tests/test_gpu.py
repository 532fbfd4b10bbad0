"""GPU arrays: every collective on CUDA device buffers, staged or CUDA-aware.

Runs where JAX has a CUDA device (`make test-gpu` on a GPU node, at 1 and 2
ranks; two ranks may share one GPU).  The rest of the suite also runs there on
GPU arrays, since JAX then places arrays on the GPU by default; this file adds
what is GPU-specific: results stay on the device, the staging pipeline at
chunk sizes that split every collective into uneven chunks (rank blocks
included), fused pytrees, transforms and pmap/shard_map over the local GPUs.
Everywhere else it is skipped with the reason; test_lowering.py checks the
cuda lowering on every machine.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpicoll
from mpicoll._src.runtime import native
from conftest import (COLLECTIVES, RANK, REPRESENTATIVE_DTYPES, ROOTED, SIZE, all_ranks_data,
                      assert_same, call, expected, input_shape, maybe_jit, reduce_reference)


def _cuda_devices():
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


GPUS = _cuda_devices()
pytestmark = pytest.mark.skipif(
    not GPUS, reason="no CUDA device here (jax.devices('cuda') is empty): the GPU suite runs "
                     "on a GPU node (`make test-gpu`)")


def on_gpu(array):
    return jax.device_put(array, GPUS[0])


def assert_on_gpu(out):
    for leaf in jax.tree.leaves(out):
        assert {d.platform for d in leaf.devices()} == {"gpu"}, leaf.devices()


@contextlib.contextmanager
def staging_chunk(chunk_bytes):
    """Run the block with the staged transport and this pipeline chunk size."""
    native.extension.set_gpu_transport(False, chunk_bytes)
    try:
        yield
    finally:
        native.extension.set_gpu_transport(native.GPU_TRANSPORT == "cuda-aware",
                                           native.GPU_CHUNK_BYTES)


def test_build_has_cuda_handlers():
    assert "cuda" in native.PLATFORMS, "a GPU is present but mpicoll was built without CUDA"


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", REPRESENTATIVE_DTYPES, ids=str)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_on_gpu_arrays(name, dtype, mode):
    kind = "max" if name in ("reduce", "allreduce") and dtype == np.bool_ else (
        "sum" if name in ("reduce", "allreduce") else None)
    op = "max" if kind == "max" else "sum"
    shape = input_shape(name, (3, 2))
    stack = all_ranks_data(shape, dtype, seed=11, kind=kind)
    root = SIZE - 1
    out = maybe_jit(lambda a: call(name, a, root, op), mode)(on_gpu(stack[RANK]))
    assert_on_gpu(out)
    assert_same(out, expected(name, stack, root=root, op=op))


# Chunk sizes that split every collective's blocks unevenly (and 0: no pipeline).
# At one rank the single-rank path runs instead (no MPI, a copy on the GPU).
@pytest.mark.parametrize("chunk_bytes", [0, 4096, 1000])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_staging_pipeline_chunks(name, chunk_bytes):
    shape = input_shape(name, (1237, 3))
    kind = "sum" if name in ("reduce", "allreduce") else None
    stack = all_ranks_data(shape, np.float32, seed=12, kind=kind)
    root = 0 if SIZE == 1 else 1
    x = on_gpu(stack[RANK])
    with staging_chunk(chunk_bytes):
        fn = jax.jit(lambda a: [call(name, a, r) for r in ([root, 0] if name in ROOTED else [0])])
        outs = jax.block_until_ready(fn(x))
    roots = [root, 0] if name in ROOTED else [0]
    for out, r in zip(outs, roots):
        assert_on_gpu(out)
        assert_same(out, expected(name, stack, root=r))


def test_pipeline_in_a_loop_keeps_buffers_apart():
    # Consecutive pipelined calls reuse the pinned buffers while the previous
    # call's copies back to the GPU may still run: each result must be its own.
    stack = all_ranks_data((50_000,), np.float32, seed=13, kind="sum")
    x = on_gpu(stack[RANK])

    def body(i, carry):
        total, value = carry
        value = mpicoll.allreduce(value) / SIZE + 1.0
        return total + value.sum(), value

    with staging_chunk(16384):
        total, value = jax.jit(lambda v: jax.lax.fori_loop(0, 5, body, (0.0, v)))(x)
    reference = stack.mean(axis=0)
    expect_total = 0.0
    for _ in range(5):
        reference = reference + 1.0
        expect_total += reference.sum()
    np.testing.assert_allclose(np.asarray(value), reference, rtol=1e-6)
    np.testing.assert_allclose(float(total), expect_total, rtol=1e-5)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_fused_pytree_on_gpu(name):
    kind = "sum" if name in ("reduce", "allreduce") else None
    shapes = [input_shape(name, s) for s in [(2,), (3, 2), (5,)]]
    stacks = [all_ranks_data(s, np.float32, seed=14 + i, kind=kind) for i, s in enumerate(shapes)]
    stacks.append(all_ranks_data(input_shape(name, (4,)), np.int32, seed=20, kind=kind))
    tree = {f"leaf{i}": on_gpu(s[RANK]) for i, s in enumerate(stacks)}
    root = SIZE - 1
    out = jax.jit(lambda t: call(name, t, root))(tree)
    assert_on_gpu(out)
    for i, stack in enumerate(stacks):
        assert_same(out[f"leaf{i}"], expected(name, stack, root=root))


@pytest.mark.usefixtures("convention_autodiff")
def test_grad_and_vmap_on_gpu():
    stack = all_ranks_data((4,), np.float32, seed=21, kind="sum")
    x = on_gpu(stack[RANK])
    # d/dx_r of sum(sin(allreduce(x))) = cos(sum_r x_r): the output is one value.
    grad = jax.jit(jax.grad(lambda a: jnp.sin(mpicoll.allreduce(a)).sum()))(x)
    assert_on_gpu(grad)
    np.testing.assert_allclose(np.asarray(grad), np.cos(stack.sum(axis=0)), rtol=1e-5)
    batch = on_gpu(np.stack([stack[RANK] * k for k in range(3)]))
    gathered = jax.jit(jax.vmap(mpicoll.allgather))(batch)
    assert gathered.shape == (3, SIZE, 4)
    np.testing.assert_array_equal(np.asarray(gathered),
                                  np.stack([stack * k for k in range(3)]))


def test_global_allreduce_in_pmap_and_shard_map_over_local_gpus():
    local = len(GPUS)
    values = np.arange(local * 3, dtype=np.float32).reshape(local, 3) + 100 * RANK
    every_rank = np.stack([np.arange(local * 3, dtype=np.float32).reshape(local, 3) + 100 * r
                           for r in range(SIZE)])
    expect = every_rank.sum(axis=(0, 1))
    out = jax.pmap(lambda v: mpicoll.allreduce(v, axis_name="i"), axis_name="i",
                   devices=GPUS)(values)
    np.testing.assert_allclose(np.asarray(out), np.broadcast_to(expect, (local, 3)))
    mesh = jax.sharding.Mesh(np.array(GPUS), ("i",))
    spec = jax.sharding.PartitionSpec("i")
    sharded = jax.jit(jax.shard_map(lambda v: mpicoll.allreduce(v, axis_name="i"), mesh=mesh,
                                    in_specs=spec, out_specs=spec))(values)
    np.testing.assert_allclose(np.asarray(sharded), np.broadcast_to(expect, (local, 3)))
    per_device = jax.pmap(lambda v: mpicoll.allgather(v), devices=GPUS)(values)
    np.testing.assert_array_equal(np.asarray(per_device),
                                  np.stack([every_rank[:, k] for k in range(local)]))


def test_logical_ops_on_one_rank_and_zeros_off_root():
    stack = all_ranks_data((6,), np.int32, seed=22, kind="land")
    x = on_gpu(stack[RANK] * 3)  # nonzero values must become 1
    out = jax.jit(lambda a: mpicoll.allreduce(a, "land"))(x)
    assert_same(out, reduce_reference(stack * 3, "land"))
    reduced = jax.jit(lambda a: mpicoll.reduce(a, "sum", SIZE - 1))(x)
    assert_same(reduced, expected("reduce", stack * 3, root=SIZE - 1))

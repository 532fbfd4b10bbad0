"""Counts above INT_MAX: a single MPI call takes an int count, so mpicoll splits
large collectives into chunks of 2**30 elements, and moves blocks larger than
that range by range with a resized datatype.  These tests move 1-byte elements
(uint8) so that > 2**31 - 1 elements fit in memory, and check the values at and
around the chunk boundaries and past 2**31, plus that everything else is zero.

The data is built inside the jitted program and only a few values and the
max/min of the remainder leave it, so the memory per rank is the collective's
input plus its output (plus MPI's internal buffers):
    allreduce, bcast                 2 * N bytes           (~4.3 GB)
    allgather, gather, scatter      (1 + size) * B bytes   (~6.5 GB at 2 ranks)
    alltoall                         2 * size * B bytes    (~8.6 GB at 2 ranks)
At 1 and 2 ranks every test runs; at more ranks a test is skipped (with the
numbers) when size times its per-rank memory does not fit in available memory.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpicoll
from conftest import RANK, SIZE, WORLD

pytestmark = pytest.mark.slow

GiB = 2 ** 30
CHUNK = 2 ** 30  # mpicoll's largest count per MPI call
N = 2 ** 31 + 2 ** 16  # more elements than an int can count
MPI_MARGIN = 1 * GiB  # per rank, for MPI's own buffers and the runtime
# Positions: both ends, both sides of every chunk boundary, and past 2**31.
POSITIONS = np.array([0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK,
                      2 * CHUNK + 12345, N - 2, N - 1], np.int64)
assert POSITIONS.max() < N and N > 2 ** 31 - 1


def _value(*indices):
    """A uint8 value that differs with every index (rank, block, position)."""
    v = 1
    for i, k in enumerate(indices):
        v = v * 31 + (i + 2) * (int(k) + 1)
    return v % 251 + 1  # never 0


def _values(*leading):
    return np.array([_value(*leading, j) for j in range(len(POSITIONS))], np.uint8)


def _needs_memory(per_rank_bytes):
    """Skip (only above 2 ranks) when every rank's share does not fit in memory."""
    needed = SIZE * (per_rank_bytes + MPI_MARGIN)
    available = None
    if RANK == 0:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    available = WORLD.bcast(available, root=0)  # the same decision on every rank
    if SIZE > 2 and needed > available:
        pytest.skip(f"needs ~{needed / GiB:.1f} GiB for {SIZE} ranks "
                    f"({per_rank_bytes / GiB:.1f} GiB each + MPI), {available / GiB:.1f} GiB "
                    "available")


def _run(program):
    WORLD.Barrier()
    start = time.perf_counter()
    out = jax.block_until_ready(program())
    WORLD.Barrier()
    print(f"[rank {RANK}/{SIZE}] {time.perf_counter() - start:.1f} s")
    return out


def _picked_and_rest(y, positions):
    """y at the positions of its last axis, and the max/min of y with those zeroed."""
    rest = y.at[..., positions].set(0)
    return y[..., positions], jnp.max(rest), jnp.min(rest)


def _check(out, expect):
    picked, rest_max, rest_min = (np.asarray(a) for a in out)
    np.testing.assert_array_equal(picked, expect)
    assert rest_max == 0 and rest_min == 0, "nonzero data outside the written positions"


def _vector_with(values):
    """An (N,) uint8 array of zeros with values at POSITIONS (built inside jit)."""
    return jnp.zeros(N, jnp.uint8).at[POSITIONS].set(values)


def test_allreduce_more_than_int_max_elements():
    _needs_memory(2 * N)
    mine = _values(RANK)
    program = jax.jit(lambda: _picked_and_rest(mpicoll.allreduce(_vector_with(mine)),
                                               POSITIONS))
    out = _run(program)
    expect = sum(_values(r).astype(np.uint64) for r in range(SIZE)).astype(np.uint8)
    _check(out, expect)


def test_bcast_more_than_int_max_elements():
    _needs_memory(2 * N)
    root = SIZE - 1
    mine = _values(RANK)
    program = jax.jit(lambda: _picked_and_rest(mpicoll.bcast(_vector_with(mine), root),
                                               POSITIONS))
    _check(_run(program), _values(root))


def _blocks_with(values):
    """A (SIZE, N) uint8 array of zeros with values[k] at POSITIONS of block k."""
    rows = np.repeat(np.arange(SIZE), len(POSITIONS))
    cols = np.tile(POSITIONS, SIZE)
    return jnp.zeros((SIZE, N), jnp.uint8).at[rows, cols].set(values.reshape(-1))


def test_allgather_blocks_larger_than_int_max():
    _needs_memory((1 + SIZE) * N)
    mine = _values(RANK)
    program = jax.jit(lambda: _picked_and_rest(mpicoll.allgather(_vector_with(mine)),
                                               POSITIONS))
    _check(_run(program), np.stack([_values(k) for k in range(SIZE)]))


def test_gather_blocks_larger_than_int_max():
    _needs_memory((1 + SIZE) * N)
    root = SIZE - 1
    mine = _values(RANK)
    program = jax.jit(lambda: _picked_and_rest(mpicoll.gather(_vector_with(mine), root),
                                               POSITIONS))
    expect = np.stack([_values(k) for k in range(SIZE)])
    _check(_run(program), expect if RANK == root else np.zeros_like(expect))


def test_scatter_blocks_larger_than_int_max():
    _needs_memory((SIZE + 1) * N)
    root = SIZE - 1
    mine = np.stack([_values(RANK, k) for k in range(SIZE)])
    program = jax.jit(lambda: _picked_and_rest(mpicoll.scatter(_blocks_with(mine), root),
                                               POSITIONS))
    _check(_run(program), _values(root, RANK))


def test_alltoall_blocks_larger_than_int_max():
    _needs_memory(2 * SIZE * N)
    mine = np.stack([_values(RANK, k) for k in range(SIZE)])
    program = jax.jit(lambda: _picked_and_rest(mpicoll.alltoall(_blocks_with(mine)),
                                               POSITIONS))
    _check(_run(program), np.stack([_values(k, RANK) for k in range(SIZE)]))

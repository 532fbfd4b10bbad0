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
At 1 and 2 ranks every test runs (measured at 2 ranks: 97 s in all, peak 8.6 GB
per rank); at more ranks a test is skipped (with the numbers) when size times
its per-rank memory does not fit in available memory.
"""

import ctypes
import ctypes.util
import gc
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
MPI_MARGIN = GiB // 2  # per rank: MPI's own buffers and the runtime (measured ~0.4 GiB)
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


def _release_freed_memory():
    """Give freed heap memory back to the OS (glibc keeps XLA's freed buffers otherwise,
    so the next test's memory check -- and the other ranks -- would find less)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:
        trim(0)


@pytest.fixture(autouse=True)
def _memory_returned_after_each_test():
    _release_freed_memory()
    yield
    _release_freed_memory()


def _values(*leading):
    return np.array([_value(*leading, j) for j in range(len(POSITIONS))], np.uint8)


def _needs_memory(per_rank_bytes):
    """Check that every rank's share fits in available memory before allocating it.

    Above 2 ranks a test that does not fit is skipped; at 1 and 2 ranks it must
    run, so it fails with the numbers instead of being killed by the OOM killer
    (which would take the rest of the run down with it) -- e.g. when another
    large job shares the machine.
    """
    needed = SIZE * (per_rank_bytes + MPI_MARGIN)
    # Read once every rank has given back the last test's memory (the fixture before this
    # test): without it rank 0 read 11.8 GiB available while rank 1 still held its
    # allgather's output (CI here, the next gather test failed).
    WORLD.Barrier()
    available = None
    if RANK == 0:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    available = WORLD.bcast(available, root=0)  # the same decision on every rank
    if needed > available:
        reason = (f"needs ~{needed / GiB:.1f} GiB for {SIZE} ranks "
                  f"({per_rank_bytes / GiB:.1f} GiB each + MPI), {available / GiB:.1f} GiB "
                  "available")
        if SIZE > 2:
            pytest.skip(reason)
        pytest.fail(reason + " (is another large job running on this machine?)")


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

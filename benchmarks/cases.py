"""What benchmarks/bench.py measures: the collectives, the sizes, each rank's input and its correct output.

Float32 values that sum exactly, so every implementation's result can be compared
with numpy's bit for bit.
"""

import argparse

import numpy as np

KIB, MIB = 1024, 1024 * 1024

OPS = ("bcast", "scatter", "reduce", "allreduce", "gather", "allgather", "alltoall", "sendrecv",
       "reduce_scatter", "allreduce_rs_ag")
BLOCK_OPS = ("scatter", "alltoall", "reduce_scatter", "allreduce_rs_ag")  # input (ranks, n)
ROOTED_RESULT_OPS = ("reduce", "gather")  # only the root's result is defined everywhere
SIZES = (4, 64, KIB, 16 * KIB, 256 * KIB, 4 * MIB, 64 * MIB)
QUICK_SIZES = (4, 64 * KIB)
PYTREE_LEAVES, PYTREE_LEAF_BYTES = 100, KIB


def parse_size(text):
    """'4', '64B', '1KiB', '16K', '4MiB', '64M' -> bytes (binary units)."""
    t = text.strip().lower().replace("ib", "").rstrip("b")
    factor = {"k": KIB, "m": MIB, "g": 1024 * MIB}.get(t[-1:], 1)
    value = int(float(t[:-1] if factor != 1 else t) * factor)
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: a multiple of 4 bytes (float32)")
    return value


def block_count(op, nbytes, size):
    """Elements per MPI block (the count argument of the MPI call)."""
    elements = nbytes // 4
    return max(1, elements // size) if op in BLOCK_OPS else elements


def input_bytes(op, count, size):
    """Bytes of one rank's input buffer: count elements, or (size, count) for block ops."""
    return 4 * count * (size if op in BLOCK_OPS else 1)


def make_input(op, rank, size, count, salt=0):
    """Rank `rank`'s input: (count,) or, for scatter/alltoall, (size, count)."""
    pattern = (np.arange(count) % 7).astype(np.float32)
    if op in BLOCK_OPS:
        return np.stack([pattern + np.float32(1 + rank * size + j + salt) for j in range(size)])
    return pattern + np.float32(rank + 1 + salt)


def expected(op, rank, size, count, salt=0):
    """Rank `rank`'s correct output (for reduce and gather, the root's; checked on root)."""
    inputs = [make_input(op, r, size, count, salt) for r in range(size)]
    if op == "bcast":
        return inputs[0]
    if op == "scatter":
        return inputs[0][rank]
    if op in ("reduce", "allreduce"):
        return np.sum(inputs, axis=0, dtype=np.float32)
    if op in ("gather", "allgather"):
        return np.stack(inputs)
    if op == "alltoall":
        return np.stack([inputs[j][rank] for j in range(size)])
    if op == "sendrecv":  # a ring: from rank - 1
        return inputs[(rank - 1) % size]
    if op == "reduce_scatter":
        return np.sum([x[rank] for x in inputs], axis=0, dtype=np.float32)
    if op == "allreduce_rs_ag":
        return np.sum(inputs, axis=0, dtype=np.float32)
    raise ValueError(op)


def checks_result(op, rank):
    """Whether this rank's result is compared with numpy (the root's only for reduce/gather)."""
    return op not in ROOTED_RESULT_OPS or rank == 0


def is_correct(out, op, rank, size, count):
    """This rank's result of one call against numpy (True where it is not checked)."""
    if not checks_result(op, rank):
        return True
    want = expected(op, rank, size, count)
    out = np.asarray(out)
    return out.shape == want.shape and np.array_equal(out, want)


def floor_buffers(op, rank, size, count):
    """(input, output) numpy buffers of one call; bcast, reduce, allreduce work in place on out."""
    x = make_input(op, rank, size, count)
    out_shape = {"scatter": (count,), "gather": (size, count), "allgather": (size, count),
                 "alltoall": (size, count), "allreduce_rs_ag": (size, count)}.get(op, (count,))
    out = np.zeros(out_shape, np.float32)
    if op in ("bcast", "reduce", "allreduce"):  # in place, like donated mpicoll
        out[...] = x
    return x, out


def feed(x, out, in_place):
    """The next input of a dependent loop.

    in_place (the collective's output aliases its input: mpicoll's bcast, reduce and
    allreduce): out itself, so MPI works on one buffer as it would in a user's loop.
    Otherwise x with its first element replaced by out's first: an O(1) update in
    place on the loop carry that makes each call depend on the previous one.  (Using
    out itself would add a full copy per call, out -> carry, to collectives that
    write a new buffer, a cost of the loop and not of the collective.)
    """
    if in_place:
        return out
    return x.at[(0,) * x.ndim].set(out[(0,) * out.ndim])


def pytree_inputs(rank, size):
    """The pytree case's leaves: PYTREE_LEAVES x PYTREE_LEAF_BYTES of allreduce input."""
    count = PYTREE_LEAF_BYTES // 4
    return [make_input("allreduce", rank, size, count, salt=i) for i in range(PYTREE_LEAVES)]


def pytree_expected(rank, size):
    count = PYTREE_LEAF_BYTES // 4
    return [expected("allreduce", rank, size, count, salt=i) for i in range(PYTREE_LEAVES)]

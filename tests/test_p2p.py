"""Point-to-point against numpy, read off the semantics table:

    send(x, dest, tag)                        -> None; x goes to dest
    recv(template, source, tag)               -> template's shape and dtype; source's x
    sendrecv(x, source, dest, sendtag, recvtag) -> the array source sent (x's shape by default)

Ordered like the collectives (program order on every rank, under jit too);
ANY_SOURCE / ANY_TAG with the matched (source, tag) returned on request;
PROC_NULL sends nowhere and receives zeros.  (vmap and autodiff of sendrecv:
tests/test_transforms.py; per device in pmap/shard_map: tests/programs/devices.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import mpicoll
from conftest import (ALL_DTYPES, RANK, REPRESENTATIVE_DTYPES, SIZE, assert_same, maybe_jit,
                      rank_data)

DTYPES = ALL_DTYPES if SIZE <= 2 else REPRESENTATIVE_DTYPES
RIGHT, LEFT = (RANK + 1) % SIZE, (RANK - 1) % SIZE
# Pairs (0, 1), (2, 3), ...: a rank without a partner (odd sizes) talks to PROC_NULL.
PARTNER = RANK ^ 1 if (RANK ^ 1) < SIZE else mpicoll.PROC_NULL


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sendrecv_ring_every_dtype(dtype, mode):
    x = rank_data((3, 2), dtype, RANK, seed=60)
    out = maybe_jit(lambda a: mpicoll.sendrecv(a, LEFT, RIGHT), mode)(x)
    assert_same(out, rank_data((3, 2), dtype, LEFT, seed=60))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_send_then_recv_between_partners_with_status(mode):
    """Even ranks send (tag 7) then receive; odd ranks receive from anyone, then reply."""
    x = rank_data((4,), np.int32, RANK, seed=61)

    def program(a):
        if RANK % 2 == 0:
            mpicoll.send(a, PARTNER, tag=7)
            return mpicoll.recv(a, PARTNER, tag=8, return_status=True)
        b, source, tag = mpicoll.recv(a, mpicoll.ANY_SOURCE, mpicoll.ANY_TAG, return_status=True)
        mpicoll.send(b + 100, source if mode == "eager" else PARTNER, tag=8)
        return b, source, tag

    got, source, tag = maybe_jit(program, mode)(x)
    if PARTNER == mpicoll.PROC_NULL:
        assert_same(got, np.zeros(4, np.int32))
        assert (int(source), int(tag)) == (mpicoll.PROC_NULL, mpicoll.ANY_TAG)
    elif RANK % 2 == 0:
        assert_same(got, x + 100)
        assert (int(source), int(tag)) == (PARTNER, 8)
    else:
        assert_same(got, rank_data((4,), np.int32, PARTNER, seed=61))
        assert (int(source), int(tag)) == (PARTNER, 7)


def test_recv_template_shapes_and_sendrecv_with_another_receive_shape():
    """recv takes an array or a ShapeDtypeStruct; sendrecv may receive another shape."""
    mine = rank_data((2, 3), np.float64, RANK, seed=62)
    left = rank_data((2, 3), np.float64, LEFT, seed=62)

    @jax.jit
    def program(a):
        sent_flat = mpicoll.sendrecv(a.reshape(-1), LEFT, RIGHT, sendtag=3, recvtag=3,
                                     recv_like=jax.ShapeDtypeStruct((6,), a.dtype))
        reshaped = mpicoll.sendrecv(a, LEFT, RIGHT, recv_like=jnp.zeros((3, 2), a.dtype))
        scalar = mpicoll.sendrecv(a[0, 0], LEFT, RIGHT)
        return sent_flat, reshaped, scalar

    flat, reshaped, scalar = program(mine)
    assert_same(flat, left.reshape(-1))
    assert_same(reshaped, left.reshape(3, 2))
    assert_same(scalar, left[0, 0])


def test_proc_null_sends_nowhere_and_receives_zeros():
    x = jnp.arange(3.0) + RANK
    out, source, tag = jax.jit(lambda a: mpicoll.sendrecv(
        a, mpicoll.PROC_NULL, mpicoll.PROC_NULL, return_status=True))(x)
    mpicoll.send(x, mpicoll.PROC_NULL)
    assert_same(out, np.zeros(3, x.dtype))
    assert (int(source), int(tag)) == (mpicoll.PROC_NULL, mpicoll.ANY_TAG)


def test_empty_messages_still_match():
    """An empty array is a real message (only the rank blocks' collectives may skip MPI)."""
    out, source, _ = jax.jit(lambda a: mpicoll.sendrecv(a, LEFT, RIGHT, return_status=True))(
        jnp.zeros((0, 2), jnp.int8))
    assert out.shape == (0, 2) and int(source) == LEFT


@pytest.mark.parametrize("loop", ["straight", "fori_loop"])
def test_program_order_is_kept_for_messages_that_need_their_receiver(loop):
    """Rank 0 sends then receives, rank 1 receives then sends, with 8 MiB messages (past any
    eager limit, so MPI_Send waits for its receive).  The two calls of a rank do not depend
    on each other: only the MPI effect keeps them in this order.  Reordered, they deadlock
    (the suite's timeout would end the run)."""
    big = jnp.full((2 * 1024 * 1024,), float(RANK), jnp.float32)

    def exchange(a):
        if PARTNER == mpicoll.PROC_NULL:
            return a
        if RANK % 2 == 0:
            mpicoll.send(a, PARTNER, tag=1)
            return mpicoll.recv(a, PARTNER, tag=2)
        got = mpicoll.recv(a, PARTNER, tag=1)
        mpicoll.send(a, PARTNER, tag=2)
        return got

    if loop == "straight":
        out = jax.jit(exchange)(big)
    else:
        out = jax.jit(lambda a: lax.fori_loop(0, 3, lambda i, v: exchange(v + 0 * i), a))(big)
    expect = float(RANK if PARTNER == mpicoll.PROC_NULL else PARTNER)  # swapped 1 or 3 times
    np.testing.assert_array_equal(np.asarray(out[:4]), np.full(4, expect, np.float32))


def test_sendrecv_on_a_split_communicator():
    comm = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    try:
        size, rank = comm.Get_size(), comm.Get_rank()
        members = [r for r in range(SIZE) if r % 2 == RANK % 2]
        out = mpicoll.sendrecv(jnp.int64(RANK), (rank - 1) % size, (rank + 1) % size, comm=comm)
    finally:
        comm.Free()
    assert int(out) == members[(rank - 1) % size]


def test_messages_of_other_senders_wait_for_their_receive():
    """Tags select: a message for tag 2 sent first is received second."""
    if PARTNER == mpicoll.PROC_NULL:
        return
    x = jnp.arange(2) + 10 * RANK
    if RANK % 2 == 0:
        mpicoll.send(x, PARTNER, tag=2)
        mpicoll.send(x + 1, PARTNER, tag=1)
    else:
        first = mpicoll.recv(x, PARTNER, tag=1)
        second = mpicoll.recv(x, PARTNER, tag=2)
        assert_same(first, np.arange(2) + 10 * PARTNER + 1)
        assert_same(second, np.arange(2) + 10 * PARTNER)


@pytest.mark.usefixtures("convention_autodiff")  # the transpose's own errors
def test_p2p_rejects_bad_input():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match=rf"send: dest={SIZE} is out of range for a "
                                         rf"communicator of size {SIZE}"):
        mpicoll.send(x, SIZE)
    with pytest.raises(ValueError, match="send: dest=.* is out of range"):
        mpicoll.send(x, mpicoll.ANY_SOURCE)  # any-source is for receiving
    with pytest.raises(ValueError, match="recv: tag=-5 is out of range"):
        mpicoll.recv(x, 0, tag=-5)
    with pytest.raises(ValueError, match="sendrecv: sendtag=.* is out of range"):
        mpicoll.sendrecv(x, 0, 0, sendtag=mpicoll.ANY_TAG)
    with pytest.raises(TypeError, match="recv: the template must have .shape and .dtype"):
        mpicoll.recv((3,), 0)
    with pytest.raises(TypeError, match="sendrecv: recv_like has dtype int32, but x has float32"):
        mpicoll.sendrecv(x.astype(jnp.float32), 0, 0, recv_like=jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="send: dest must be a static int, but it is traced"):
        jax.jit(lambda a, d: mpicoll.send(a, d))(x, 0)
    with pytest.raises(TypeError, match="recv: the template has unsupported dtype <U1"):
        mpicoll.recv(np.zeros(2, np.str_), 0)
    with pytest.raises(NotImplementedError, match="send and recv are not differentiable"):
        jax.grad(lambda a: (mpicoll.send(a, mpicoll.PROC_NULL), a.sum())[1])(x)
    with pytest.raises(NotImplementedError, match="cannot transpose a receive from ANY_SOURCE"):
        jax.linear_transpose(lambda a: mpicoll.sendrecv(a, mpicoll.ANY_SOURCE, 0), x)(x)


@pytest.mark.skipif(SIZE < 2, reason="a mismatched message needs two ranks")
def test_short_and_mismatched_messages_raise_on_the_receiver():
    """Without check mode a message shorter than the buffer raises on the receiver; with it,
    a header also catches another dtype of the same size.  The senders complete."""
    if PARTNER == mpicoll.PROC_NULL:
        pass  # no partner: only the closing ring
    elif RANK % 2 == 0:
        mpicoll.send(jnp.ones(2, jnp.float32), PARTNER)
        previous_check = mpicoll.set_check_mode(True)
        try:
            mpicoll.send(jnp.ones(4, jnp.int32), PARTNER)
        finally:
            mpicoll.set_check_mode(previous_check)
    else:
        with pytest.raises(Exception, match=r"received 8 bytes from rank \d+ \(tag 0\), but the "
                                            r"buffer holds 16"):
            mpicoll.recv(jnp.ones(4, jnp.float32), PARTNER)
        previous_check = mpicoll.set_check_mode(True)
        try:
            with pytest.raises(Exception, match=r"mpicoll check mode: recv on rank \d+ of "
                                                r"mpicoll:MPI_COMM_WORLD:device0 received "
                                                r"int32\[4\] from rank \d+ \(tag 0\) into "
                                                r"float32\[4\]"):
                mpicoll.recv(jnp.ones(4, jnp.float32), PARTNER)
        finally:
            mpicoll.set_check_mode(previous_check)
    # Everyone is still in step.
    out = mpicoll.sendrecv(jnp.int32(RANK), LEFT, RIGHT)
    assert int(out) == LEFT


def test_check_mode_passes_matching_messages():
    previous_check = mpicoll.set_check_mode(True)
    try:
        out, source, tag = jax.jit(lambda a: mpicoll.sendrecv(
            a, mpicoll.ANY_SOURCE, RIGHT, sendtag=4, return_status=True))(jnp.float32(RANK))
    finally:
        mpicoll.set_check_mode(previous_check)
    assert (float(out), int(source), int(tag)) == (LEFT, LEFT, 4)

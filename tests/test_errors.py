"""The bad-input matrix: every collective x every way to call it wrongly.

Each case must raise the right exception type, with a message naming the bad
argument, identically on every rank and before any MPI call -- so the ranks
stay in step: after every case, an allreduce still gives the right answer.
Every case runs eagerly and while tracing under jax.jit.

Cases per mode (collectives x bad values):
    root        4 rooted collectives x 7 bad roots                    =  28
    leading     scatter, alltoall x 4 bad shapes                      =   8
    dtype       7 collectives x 6 unsupported dtypes                  =  42
    x           7 collectives x 9 values that are not arrays/pytrees  =  63
    op          reduce, allreduce x 8 unknown ops                     =  16
    op/dtype    reduce, allreduce x 42 invalid (op, dtype) pairs      =  84
    comm        8 (7 collectives + barrier) x 9 bad communicators     =  72
    total                                                               313 (x 2 modes = 626)
"""

import re

import jax
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from conftest import (COLLECTIVES, INVALID_PAIRS, REDUCING, ROOTED, SIZE, STACKED_INPUT, WORLD,
                      assert_in_step, call, input_shape, pair_id, same_on_every_rank)

MODES = ("eager", "jit")


def _good_input(name, dtype=np.float32):
    return np.ones(input_shape(name, (2,)), dtype)


def check_refused(make_call, exception, argument, mode, seed):
    """make_call() must raise `exception` naming `argument`, the same on every rank."""
    run = (lambda: jax.jit(lambda: make_call())()) if mode == "jit" else make_call
    with pytest.raises(exception) as info:
        run()
    message = str(info.value)
    # The same outcome everywhere (object addresses in reprs naturally differ).
    outcome = (type(info.value).__name__, re.sub(r"0x[0-9a-fA-F]+", "0x?", message))
    assert same_on_every_rank(outcome), outcome
    assert re.search(rf"\b{argument}\b", message), message
    assert_in_step(seed)


# ---------------------------------------------------------------------------
# root: out of range -> ValueError; not an int -> TypeError.

BAD_ROOTS = [(-1, ValueError), (SIZE, ValueError), (SIZE + 7, ValueError),
             (0.0, TypeError), ("0", TypeError), (None, TypeError), (np.float32(0), TypeError)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("root,exception", BAD_ROOTS, ids=[repr(r) for r, _ in BAD_ROOTS])
@pytest.mark.parametrize("name", ROOTED)
def test_bad_root(name, root, exception, mode):
    check_refused(lambda: call(name, _good_input(name), root=root), exception, "root", mode, 1)


# ---------------------------------------------------------------------------
# scatter/alltoall: x must have shape (comm size, ...).

BAD_LEADING_SHAPES = [(), (SIZE + 1,), (SIZE + 1, 2), (0, SIZE)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", BAD_LEADING_SHAPES, ids=str)
@pytest.mark.parametrize("name", STACKED_INPUT)
def test_bad_leading_axis(name, shape, mode):
    check_refused(lambda: call(name, np.ones(shape, np.float32)), ValueError, "x", mode, 2)


# ---------------------------------------------------------------------------
# x: unsupported dtypes, and values that are not arrays at all.

BAD_DTYPES = [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4, ml_dtypes.uint4,
              ml_dtypes.float4_e2m1fn, ml_dtypes.int2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_unsupported_dtype(name, dtype, mode):
    x = np.zeros(input_shape(name, (2,)), dtype)
    check_refused(lambda: call(name, x), TypeError, "x", mode, 3)


# (Lists, tuples and dicts are pytrees, valid when every leaf is: a bad leaf is
# refused like a bad x.)
NOT_ARRAYS = {
    "str": "abc",
    "bytes": b"abc",
    "object": object(),
    "function": len,
    "str-array": np.array(["a", "b"]),
    "object-array": np.array([object(), object()]),
    "int-too-large-for-int64": 2 ** 70,
    "dict-with-a-str-leaf": {"a": np.ones(2), "b": "abc"},
    "list-with-an-object-leaf": [np.ones(2), object()],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", NOT_ARRAYS.values(), ids=NOT_ARRAYS.keys())
@pytest.mark.parametrize("name", COLLECTIVES)
def test_not_an_array(name, value, mode):
    check_refused(lambda: call(name, value), (TypeError, ValueError), "x", mode, 4)


# ---------------------------------------------------------------------------
# op: unknown -> ValueError; defined, but not for x's dtype -> TypeError.

UNKNOWN_OPS = {"mean": "mean", "empty": "", "None": None, "int": 0, "MPI.MAXLOC": MPI.MAXLOC,
               "MPI.REPLACE": MPI.REPLACE, "MPI.NO_OP": MPI.NO_OP, "MPI.OP_NULL": MPI.OP_NULL}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", UNKNOWN_OPS.values(), ids=UNKNOWN_OPS.keys())
@pytest.mark.parametrize("name", REDUCING)
def test_unknown_op(name, op, mode):
    check_refused(lambda: call(name, _good_input(name), op=op), ValueError, "op", mode, 5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op,dtype", INVALID_PAIRS, ids=[pair_id(p) for p in INVALID_PAIRS])
@pytest.mark.parametrize("name", REDUCING)
def test_op_not_defined_for_dtype(name, op, dtype, mode):
    x = np.zeros((2,), dtype)
    check_refused(lambda: call(name, x, op=op), TypeError, "op", mode, 6)


# ---------------------------------------------------------------------------
# comm: not an mpi4py communicator -> TypeError; null or freed -> ValueError;
# inter-communicator -> TypeError.

def _freed():
    comm = WORLD.Dup()
    comm.Free()
    return comm


def _intercomm():
    local = WORLD.Split(color=WORLD.rank % 2, key=WORLD.rank)
    inter = local.Create_intercomm(0, WORLD, 1 - WORLD.rank % 2, tag=78)
    local.Free()
    return inter


BAD_COMMS = {
    "int": (lambda: 0, TypeError),
    "str": (lambda: "world", TypeError),
    "object": (lambda: object(), TypeError),
    "group": (lambda: MPI.GROUP_EMPTY, TypeError),
    "info": (lambda: MPI.INFO_NULL, TypeError),
    "mpi4py-module": (lambda: MPI, TypeError),
    "COMM_NULL": (lambda: MPI.COMM_NULL, ValueError),
    "freed": (_freed, ValueError),
    "intercomm": (_intercomm, TypeError),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", BAD_COMMS)
@pytest.mark.parametrize("name", COLLECTIVES + ("barrier",))
def test_bad_comm(name, kind, mode):
    if kind == "intercomm" and SIZE < 2:
        pytest.skip("an inter-communicator needs at least 2 processes")
    make, exception = BAD_COMMS[kind]
    comm = make()
    try:
        if name == "barrier":
            check_refused(lambda: mpicoll.barrier(comm=comm), exception, "comm", mode, 7)
        else:
            check_refused(lambda: call(name, _good_input(name), comm=comm), exception, "comm",
                          mode, 7)
    finally:
        if kind == "intercomm":
            comm.Free()

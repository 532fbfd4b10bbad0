"""The bad-input matrix: every public function x every way to call it wrongly.

Each case must raise the right exception type, with a message naming the bad
argument, identically on every rank and before any MPI call -- so the ranks
stay in step: after every case, an allreduce still gives the right answer.
Every case runs eagerly and while tracing under jax.jit.

Cases per mode (functions x bad values):
    root        4 rooted collectives x 7 bad roots                     =  28
    leading     scatter, alltoall x 4 bad shapes                       =   8
    dtype       7 collectives + pvary x 6 unsupported dtypes           =  48
    byte order  7 collectives x non-native array / pytree leaf         =  14
    x           7 collectives + pvary x 9 values that are not arrays   =  72
    op          reduce, allreduce x 10 unknown ops (MPI.MAXLOC, ...)   =  20
    op/dtype    reduce, allreduce x 42 invalid (op, dtype) pairs       =  84
    comm        7 collectives + barrier + pvary x 10 bad communicators =  90
    pytree      a bad leaf, root, op or comm with a pytree x           =  28
    axis_name   the 4 global collectives: unmapped, unbound or non-name
                axis, and their dtype/comm/root/leading-axis/op checks =  33
    total                                                                425 (x 2 modes = 850)
"""

import re

import jax
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from conftest import (COLLECTIVES, INVALID_PAIRS, OPEN_MPI, RANK, REDUCING, ROOTED, SIZE,
                      STACKED_INPUT, WORLD, assert_in_step, call, input_shape, pair_id,
                      same_on_every_rank)

MODES = ("eager", "jit")
WITH_X = COLLECTIVES + ("pvary",)  # every public function that takes an x


def _good_input(name, dtype=np.float32):
    return np.ones(input_shape(name, (2,)), dtype)


def check_refused(make_call, exception, argument, mode, seed, mentions=()):
    """make_call() must raise `exception` naming `argument`, the same on every rank.

    `mentions`: further texts the message must contain.
    """
    run = (lambda: jax.jit(lambda: make_call())()) if mode == "jit" else make_call
    with pytest.raises(exception) as info:
        run()
    message = str(info.value)
    # The same outcome everywhere (object addresses in reprs naturally differ).
    outcome = (type(info.value).__name__, re.sub(r"0x[0-9a-fA-F]+", "0x?", message))
    assert same_on_every_rank(outcome), outcome
    assert re.search(rf"\b{argument}\b", message), message
    for text in mentions:
        assert text in message, message
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
@pytest.mark.parametrize("name", WITH_X)
def test_unsupported_dtype(name, dtype, mode):
    x = np.zeros(input_shape(name, (2,)), dtype)
    check_refused(lambda: call(name, x), TypeError, "x", mode, 3)


# Non-native byte order: JAX refuses such numpy arrays (jnp.asarray raises), so
# mpicoll does too, but saying why (not "x must be an array").
NON_NATIVE = np.dtype(np.float32).newbyteorder("S")  # '>f4' on little-endian machines


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tree", [False, True], ids=["array", "pytree-leaf"])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_non_native_byte_order(name, tree, mode):
    x = np.ones(input_shape(name, (2,)), NON_NATIVE)
    value = {"a": np.ones(input_shape(name, (3,)), np.float32), "b": x} if tree else x
    check_refused(lambda: call(name, value), TypeError, "x", mode, 3, mentions=["byte order"])


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
@pytest.mark.parametrize("name", WITH_X)
def test_not_an_array(name, value, mode):
    check_refused(lambda: call(name, value), (TypeError, ValueError), "x", mode, 4)


# ---------------------------------------------------------------------------
# op: unknown -> ValueError; defined, but not for x's dtype -> TypeError.

def _user_op(a, b, datatype):  # never called: mpicoll refuses user-defined ops
    raise AssertionError("a user-defined MPI.Op was called")


USER_OP = MPI.Op.Create(_user_op, commute=True)

# id -> (op, what the message must call it).  mpi4py's MPI.Op objects print as
# their address, so the message must give their MPI name instead.
UNKNOWN_OPS = {
    "mean": ("mean", "'mean'"), "empty": ("", "''"), "None": (None, "None"), "int": (0, "0"),
    "MPI.MAXLOC": (MPI.MAXLOC, "MPI.MAXLOC"), "MPI.MINLOC": (MPI.MINLOC, "MPI.MINLOC"),
    "MPI.REPLACE": (MPI.REPLACE, "MPI.REPLACE"), "MPI.NO_OP": (MPI.NO_OP, "MPI.NO_OP"),
    "MPI.OP_NULL": (MPI.OP_NULL, "MPI.OP_NULL"), "user-defined": (USER_OP, "user-defined"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op,label", UNKNOWN_OPS.values(), ids=UNKNOWN_OPS.keys())
@pytest.mark.parametrize("name", REDUCING)
def test_unknown_op(name, op, label, mode):
    check_refused(lambda: call(name, _good_input(name), op=op), ValueError, "op", mode, 5,
                  mentions=[f"op={label}" if label != "user-defined" else label])


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


def _freed_through_another_handle():
    """A second Python object for a communicator freed through the first one: it
    still holds the old handle, not MPI.COMM_NULL."""
    comm = WORLD.Dup()
    other = MPI.Intracomm(comm)
    comm.Free()
    assert other != MPI.COMM_NULL
    return other


BAD_COMMS = {
    "int": (lambda: 0, TypeError),
    "str": (lambda: "world", TypeError),
    "object": (lambda: object(), TypeError),
    "group": (lambda: MPI.GROUP_EMPTY, TypeError),
    "info": (lambda: MPI.INFO_NULL, TypeError),
    "mpi4py-module": (lambda: MPI, TypeError),
    "COMM_NULL": (lambda: MPI.COMM_NULL, ValueError),
    "freed": (_freed, ValueError),
    "freed-other-handle": (_freed_through_another_handle, ValueError),
    "intercomm": (_intercomm, TypeError),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", BAD_COMMS)
@pytest.mark.parametrize("name", WITH_X + ("barrier",))
def test_bad_comm(name, kind, mode):
    if kind == "intercomm" and SIZE < 2:
        pytest.skip("an inter-communicator needs at least 2 processes")
    if kind == "freed-other-handle" and OPEN_MPI:
        pytest.skip("Open MPI frees the object behind the handle: using it is undefined "
                    "behaviour (a segfault), which no library can detect")
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


# ---------------------------------------------------------------------------
# Pytrees: each leaf is checked like an x (through the fused path, which checks
# every leaf before any MPI call).

def _tree(name, bad_leaf):
    return {"good": _good_input(name), "bad": bad_leaf}


PYTREE_CASES = {
    # id: (collectives, make (name) -> call kwargs, exception, argument)
    "unsupported-dtype-leaf": (COLLECTIVES, lambda name: dict(
        x=_tree(name, np.zeros(input_shape(name, (2,)), ml_dtypes.float8_e4m3fn))), TypeError, "x"),
    "root-out-of-range": (ROOTED, lambda name: dict(
        x=_tree(name, _good_input(name)), root=SIZE), ValueError, "root"),
    "root-not-an-int": (ROOTED, lambda name: dict(
        x=_tree(name, _good_input(name)), root="0"), TypeError, "root"),
    "op-unknown": (REDUCING, lambda name: dict(
        x=_tree(name, _good_input(name)), op="mean"), ValueError, "op"),
    "op-not-for-one-leaf": (REDUCING, lambda name: dict(
        x=_tree(name, np.ones((2,), np.bool_)), op="sum"), TypeError, "op"),
    "leaf-leading-axis": (STACKED_INPUT, lambda name: dict(
        x=_tree(name, np.ones((SIZE + 1, 2), np.float32))), ValueError, "x"),
    "comm-not-a-comm": (COLLECTIVES, lambda name: dict(
        x=_tree(name, _good_input(name)), comm=object()), TypeError, "comm"),
}
PYTREE_PARAMS = [(name, case) for case, (names, *_) in PYTREE_CASES.items() for name in names]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,case", PYTREE_PARAMS, ids=[f"{n}-{c}" for n, c in PYTREE_PARAMS])
def test_bad_pytree(name, case, mode):
    _, make, exception, argument = PYTREE_CASES[case]
    kwargs = make(name)
    check_refused(lambda: call(name, **kwargs), exception, argument, mode, 8)


# ---------------------------------------------------------------------------
# The global collectives (axis_name=, over ranks x local devices): a name that is
# not a mapped axis, and the same argument checks as the per-rank collectives.
# This suite has one local device per rank; pmap over it maps axis "i".

GLOBAL = ("bcast", "allreduce", "allgather", "alltoall")
LOCAL = jax.local_device_count()


def _global_call(name, x, axis_name="i", root=0, op="sum", comm=None):
    fn = getattr(mpicoll, name)
    if name == "bcast":
        return fn(x, root, comm=comm, axis_name=axis_name)
    if name == "allreduce":
        return fn(x, op, comm=comm, axis_name=axis_name)
    return fn(x, comm=comm, axis_name=axis_name)


def _global_input(name, dtype=np.float32):
    return np.ones((SIZE * LOCAL, 2) if name == "alltoall" else (2,), dtype)


def _in_pmap(name, x=None, **kwargs):
    """A call of the global collective `name` inside pmap over the local devices."""
    x = _global_input(name) if x is None else x
    stacked = np.broadcast_to(x, (LOCAL, *np.shape(x))) if hasattr(x, "shape") else [x] * LOCAL
    return lambda: jax.pmap(lambda v: _global_call(name, v, **kwargs), axis_name="i")(
        np.asarray(stacked))


GLOBAL_CASES = {
    # id: (collectives, name -> make_call, exception, argument)
    "axis-outside-any-map": (GLOBAL, lambda name: lambda: _global_call(
        name, _global_input(name)), ValueError, "axis_name"),
    "axis-unbound-in-pmap": (GLOBAL, lambda name: _in_pmap(name, axis_name="j"), ValueError,
                             "axis_name"),
    "axis-not-a-name": (GLOBAL, lambda name: _in_pmap(name, axis_name=3), ValueError, "axis_name"),
    "unsupported-dtype": (GLOBAL, lambda name: _in_pmap(
        name, _global_input(name, ml_dtypes.float8_e4m3fn)), TypeError, "x"),
    "comm-not-a-comm": (GLOBAL, lambda name: _in_pmap(name, comm=0), TypeError, "comm"),
    "comm-null": (GLOBAL, lambda name: _in_pmap(name, comm=MPI.COMM_NULL), ValueError, "comm"),
    "root-out-of-range": (("bcast",), lambda name: _in_pmap(name, root=SIZE * LOCAL), ValueError,
                          "root"),
    "root-negative": (("bcast",), lambda name: _in_pmap(name, root=-1), ValueError, "root"),
    "root-not-an-int": (("bcast",), lambda name: _in_pmap(name, root=0.0), TypeError, "root"),
    "leading-axis": (("alltoall",), lambda name: _in_pmap(
        name, np.ones((SIZE * LOCAL + 1, 2), np.float32)), ValueError, "x"),
    "leading-axis-0d": (("alltoall",), lambda name: _in_pmap(
        name, np.ones((), np.float32)), ValueError, "x"),
    "op-unknown": (("allreduce",), lambda name: _in_pmap(name, op="mean"), ValueError, "op"),
    "op-MPI.MAXLOC": (("allreduce",), lambda name: _in_pmap(name, op=MPI.MAXLOC), ValueError,
                      "op"),
    "op-not-for-dtype": (("allreduce",), lambda name: _in_pmap(name, op="band"), TypeError, "op"),
    "op-not-for-bool": (("allreduce",), lambda name: _in_pmap(
        name, np.ones((2,), np.bool_), op="sum"), TypeError, "op"),
}
GLOBAL_PARAMS = [(name, case) for case, (names, *_) in GLOBAL_CASES.items() for name in names]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,case", GLOBAL_PARAMS, ids=[f"{n}-{c}" for n, c in GLOBAL_PARAMS])
def test_bad_global_call(name, case, mode):
    _, make, exception, argument = GLOBAL_CASES[case]
    check_refused(make(name), exception, argument, mode, 9)


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("op", ["sum", MPI.MAX])
def test_global_reduction_checks_its_op_once(name, op, monkeypatch):
    """Over ranks x devices the op is checked before the devices combine, then handed
    on as checked (runtime/dtypes.CheckedOp): the MPI part does not check it again."""
    from mpicoll._src.runtime import dtypes
    looked_up = []
    op_name = dtypes.op_name
    monkeypatch.setattr(dtypes, "op_name", lambda *a: looked_up.append(a[0]) or op_name(*a))
    x = np.arange(SIZE * LOCAL * 2, dtype=np.float32).reshape(SIZE * LOCAL, 2)
    stacked = np.broadcast_to(x, (LOCAL, *x.shape))
    fn = getattr(mpicoll, name)
    out = jax.pmap(lambda v: fn(v, op, axis_name="i"), axis_name="i")(stacked)
    assert len(looked_up) == 1, looked_up
    combined = x * SIZE * LOCAL if op == "sum" else x
    expected = combined if name == "allreduce" else combined[RANK * LOCAL]
    np.testing.assert_array_equal(np.asarray(out[0]), expected)


# ---------------------------------------------------------------------------
# Messages that name the cause: an overflowing int, the bad leaf of a pytree
# (its path), a traced root, axis_name where a collective has no global form.

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", WITH_X)
def test_overflowing_int_says_so(name, mode):
    check_refused(lambda: call(name, 2 ** 70), TypeError, "x", mode, 11, mentions=("overflows",))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", WITH_X)
def test_bad_leaf_is_named_by_its_path(name, mode):
    tree = {"layer": [_good_input(name), "abc"]}
    check_refused(lambda: call(name, tree), TypeError, "x", mode, 12,
                  mentions=("x['layer'][1]",))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", REDUCING)
def test_leaf_whose_dtype_the_op_lacks_is_named(name, mode):
    tree = {"w": _good_input(name), "mask": np.ones(2, np.bool_)}
    check_refused(lambda: call(name, tree, op="sum"), TypeError, "op", mode, 13,
                  mentions=("x['mask']",))


@pytest.mark.parametrize("name", ROOTED)
def test_traced_root_asks_for_a_static_root(name):
    x = _good_input(name)
    check_refused(lambda: jax.jit(lambda a, r: call(name, a, r))(x, 0), TypeError, "root",
                  "eager", 14, mentions=("static_argnums",))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ("reduce", "gather", "scatter"))
def test_axis_name_where_there_is_no_global_form(name, mode):
    fn = getattr(mpicoll, name)
    check_refused(lambda: fn(_good_input(name), axis_name="i"), NotImplementedError,
                  "axis_name", mode, 15)

"""Property tests (hypothesis), one per collective: any shape, dtype, root, op, layout.

Each example draws a shape (0 to 3 axes of length 0 to 4, so empty arrays
too), a dtype, a root, a reduction op valid for the dtype, an input layout
(C-contiguous numpy, transposed or strided views, a JAX array) and eager or
jit, and compares the collective's result with numpy on every rank's
regenerated input.

Under MPI every rank must draw the same examples and see the same outcomes,
or the ranks would call different collectives and hang:

* derandomize=True and database=None: the examples come from a fixed seed,
  never from a per-rank example database;
* the draws never depend on the rank, and each example's verdict is gathered
  from every rank (mpi4py allgather) before anything is asserted, so a wrong
  result on one rank fails the example on every rank alike;
* no shrinking (phases explicit + generate) and no health checks: both depend
  on timing, which differs between ranks.  A failure reports the first failing
  example as drawn (the shapes are small anyway).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import (ALL_DTYPES, COLLECTIVES, OPS, RANK, REDUCING, ROOTED, SIZE, VALID_PAIRS,
                      WORLD, call, expected, input_shape, rank_data)

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck), print_blob=False)
LAYOUTS = ("contiguous", "transposed", "strided", "jax")


@st.composite
def cases(draw, name):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    ops = [op for op in OPS if (op, dtype) in VALID_PAIRS]
    return {
        "shape": tuple(draw(st.lists(st.integers(0, 4), max_size=3))),
        "dtype": dtype,
        "root": draw(st.integers(0, SIZE - 1)) if name in ROOTED else 0,
        "op": draw(st.sampled_from(ops)) if name in REDUCING else "sum",
        "layout": draw(st.sampled_from(LAYOUTS)),
        "mode": draw(st.sampled_from(("eager", "jit"))),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_input(name, case, rank):
    """Rank `rank`'s input: the same values for every layout, laid out as asked."""
    shape = input_shape(name, case["shape"])
    kind = case["op"] if name in REDUCING else None
    x = rank_data(shape, case["dtype"], rank, case["seed"], kind)
    if case["layout"] == "transposed":  # a non-contiguous view with x's values
        x = np.ascontiguousarray(x.T).T
    elif case["layout"] == "strided" and x.ndim:  # every other element of a wider array
        wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
        wide[..., ::2] = x
        x = wide[..., ::2]
    elif case["layout"] == "jax":
        x = jnp.asarray(x)
    return x


def verdict(name, case):
    """(ok, why) on this rank for one example; everything collective happens here."""
    stack = np.stack([np.asarray(make_input(name, case, r)) for r in range(SIZE)])
    x = make_input(name, case, RANK)
    fn = lambda x: call(name, x, root=case["root"], op=case["op"])  # noqa: E731
    try:
        out = (jax.jit(fn) if case["mode"] == "jit" else fn)(x)
        out = jax.block_until_ready(out)
    except Exception as error:  # a verdict, not a desynchronizing early exit
        return False, f"rank {RANK}: raised {type(error).__name__}: {error}"
    want = expected(name, stack, root=case["root"], op=case["op"])
    if not isinstance(out, jax.Array):
        return False, f"rank {RANK}: returned {type(out).__name__}, not a jax.Array"
    got = np.asarray(out)
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        return False, f"rank {RANK}: {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
    if got.dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        got, want = got.astype(np.float32), want.astype(np.float32)
    if not np.array_equal(got, want):
        return False, f"rank {RANK}: {got!r} != expected {want!r}"
    return True, ""


def check_everywhere(name, case):
    """Assert on every rank alike: the example failed if it failed on any rank."""
    ok, why = verdict(name, case)
    outcomes = WORLD.allgather((ok, why))
    failed = [why for ok, why in outcomes if not ok]
    assert not failed, f"{name} {case}:\n" + "\n".join(failed)


def property_test(name):
    @SETTINGS
    @given(case=cases(name))
    def test(case):
        check_everywhere(name, case)
    test.__name__ = f"test_{name}_matches_numpy"
    return test


test_bcast_matches_numpy = property_test("bcast")
test_scatter_matches_numpy = property_test("scatter")
test_reduce_matches_numpy = property_test("reduce")
test_allreduce_matches_numpy = property_test("allreduce")
test_gather_matches_numpy = property_test("gather")
test_allgather_matches_numpy = property_test("allgather")
test_alltoall_matches_numpy = property_test("alltoall")


def test_every_collective_has_a_property_test():
    assert sorted(COLLECTIVES) == sorted(
        name[len("test_"):-len("_matches_numpy")] for name in globals()
        if name.startswith("test_") and name.endswith("_matches_numpy"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_have_the_same_values(layout):
    """make_input's layouts are what they claim: same values, and really non-contiguous."""
    case = {"shape": (3, 4), "dtype": np.dtype(np.int32), "root": 0, "op": "sum",
            "layout": layout, "mode": "eager", "seed": 1}
    base = make_input("bcast", {**case, "layout": "contiguous"}, RANK)
    x = make_input("bcast", case, RANK)
    np.testing.assert_array_equal(np.asarray(x), base)
    if layout in ("transposed", "strided"):
        assert not x.flags["C_CONTIGUOUS"]

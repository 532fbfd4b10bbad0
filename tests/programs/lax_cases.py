"""jax.lax bodies shared by lax_over_ranks.py and global_mesh.py (each written once, its
axes a parameter, run by mpicoll across ranks and by JAX in one process), and their checks."""

import jax.numpy as jnp
from jax import lax

from _common import Checker

failures = []  # this rank's failed checks, reported by _common.report_and_exit
check = Checker(failures, rtol=1e-10, atol=1e-12)


def attempt(name, fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 -- reported, then the job fails
        failures.append(f"{name}: {type(error).__name__}: {str(error)[:600]}")


def varying_axes(aval):
    """check_vma's type: the axes a value varies over (jax 0.10 spells it
    manual_axis_type.varying, later JAX vma)."""
    spelled = getattr(aval, "manual_axis_type", None)
    return spelled.varying if spelled is not None else aval.vma


def blocks(shape, participants):
    """A participant's block shape; "tile": one that any number of participants dividing
    `participants` can share along dimension 1."""
    return (2, 2 * participants) if shape == "tile" else shape


def all_gather_invariant(x, axes):
    """lax.all_gather typed invariant over axes (jax 0.10's all_gather_invariant, later
    all_gather(..., to="invarying"))."""
    from jax._src.lax import parallel
    legacy = getattr(parallel, "all_gather_invariant", None)
    return legacy(x, axes) if legacy is not None else lax.all_gather(x, axes, to="invarying")


# name -> (body(x, axes, participants in them), each participant's block shape).
# "tile": see blocks().
CASES = {
    "psum": (lambda x, a, n: lax.psum(x, a), (2, 3)),
    "pmean": (lambda x, a, n: lax.pmean(x, a), (2, 3)),
    "pmax": (lambda x, a, n: lax.pmax(x, a), (2, 3)),
    "pmin": (lambda x, a, n: lax.pmin(x, a), (2, 3)),
    "psum of a constant": (lambda x, a, n: x * lax.psum(1, a), (2,)),
    "axis_size": (lambda x, a, n: x + lax.axis_size(a), (2,)),
    "axis_index": (lambda x, a, n: x * lax.axis_index(a), (2,)),
    "all_gather": (lambda x, a, n: lax.all_gather(x, a)[None], (2, 3)),
    "all_gather_invariant": (lambda x, a, n: all_gather_invariant(x, a)[None], (2, 3)),
    "all_gather axis=1": (lambda x, a, n: lax.all_gather(x, a, axis=1), (2, 3)),
    "all_gather tiled axis=1": (lambda x, a, n: lax.all_gather(x, a, axis=1, tiled=True),
                                (2, 3)),
    "psum_scatter": (lambda x, a, n: lax.psum_scatter(x.reshape(n, -1), a)[None], "tile"),
    "psum_scatter tiled axis=1": (
        lambda x, a, n: lax.psum_scatter(x, a, scatter_dimension=1, tiled=True), "tile"),
    "all_to_all": (lambda x, a, n: lax.all_to_all(x, a, 1, 1, tiled=True), "tile"),
    "all_to_all untiled": (lambda x, a, n: lax.all_to_all(
        x.reshape(x.shape[0], n, -1), a, 1, 0).reshape(x.shape[0] * n, -1), "tile"),
    "ppermute ring": (lambda x, a, n: lax.ppermute(x, a, [(i, (i + 1) % n) for i in range(n)]),
                      (2, 3)),
    "ppermute partial": (lambda x, a, n: lax.ppermute(
        x, a, [(0, n - 1)] + [(i, i - 1) for i in range(2, n)]), (2, 3)),
    "nonlinear mix": (lambda x, a, n: jnp.tanh(lax.psum(x * x, a)) * x + lax.ppermute(
        jnp.sin(x), a, [(i, (i + 1) % n) for i in range(n)]), (2, 3)),
}



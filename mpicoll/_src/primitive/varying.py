"""The MPI ranks as a mesh axis JAX's type system tracks, pvary's typing, and the
autodiff mode's state (the public choices: ops/typed_ranks.py).

Inside shard_map over mesh() (check_vma=True, JAX's default), every value is
typed varying or invariant over RANKS: in_specs P(RANKS) marks per-rank data,
P() a value identical on every rank (parameters).  The collectives type their
outputs (allreduce/allgather/bcast over every rank: invariant; the rest:
varying) and take per-rank inputs, casting an invariant one with pvary.  JAX
then does the rest with its own rules: it inserts pvary where an invariant value
meets a varying one (the cotangent of a replicated parameter is summed over
ranks: pvary's transpose, psum over RANKS, reaches mpicoll through
over_ranks/lax.py) and rejects a loop whose carry changes type (a per-rank
carry that an allreduce makes identical).

The same typing holds over the axes of a global mesh that a communicator made
for them stands for (typed_axes).

Outside such a mesh nothing is typed and mpicoll's convention applies: a value
identical on every rank (the output of allreduce, allgather, bcast) is one
value, not `size` copies; a value that differs per rank is that rank's own, and
rank-varying scalar outputs add up across ranks into the global objective.
Reverse mode there is refused unless the user accepts that convention
(set_autodiff("convention")).
"""

import contextlib
import threading

import jax
from jax.extend.core import Primitive

from .. import _compat
from ..runtime import settings, comm as comm_layer

# The mesh axis that stands for the MPI ranks (mpicoll.RANKS; mpicoll.mesh()
# makes a mesh with it: ops/typed_ranks.py).
RANKS = "mpicoll.RANKS"


def ranks_typed():
    """Whether values traced now are typed over RANKS (shard_map over mesh(), check_vma)."""
    return _compat.axis_in_manual_mesh(RANKS)


def world():
    return comm_layer.resolve(None, "pvary")


def typed_axes(slot=None):
    """The mesh axes whose participants a communicator's ranks are, where values
    are typed over them now (shard_map with check_vma), else ().

    A communicator mpicoll made for axes of a global mesh (over_ranks/lax.py)
    stands for those axes; any other stands for RANKS inside mesh().
    """
    if not _compat.check_vma_enabled():
        return ()
    axes = (comm_layer.info_for_slot(slot).mesh_axes if slot is not None else ()) or (RANKS,)
    manual = _compat.manual_mesh_axes()
    return axes if all(axis in manual for axis in axes) else ()


def _spans_all_ranks(params):
    return (bool(comm_layer.info_for_slot(params["comm"]).mesh_axes)
            or params["size"] == world().size)


# ---------------------------------------------------------------------------
# pvary: identity on the value; its cotangent is summed over ranks.  Apply it
# to a replicated value (e.g. parameters) before using it rank-dependently, so
# that the gradient collects every rank's contribution (as shard_map does).
# No MPI call: the identity's lowering is its input.  Its transpose, the
# allreduce, is registered beside the allreduce (ops/collectives.py).

pvary_p = Primitive("mpicoll_pvary")
pvary_p.def_impl(lambda x, **params: x)
pvary_p.def_abstract_eval(
    lambda x, *, comm, **params: _compat.with_varying_axes(
        x, _compat.varying_axes(x) | set(typed_axes(comm))))
_compat.register_lowering(pvary_p, lambda ctx, x, **params: [x])
_compat.register_batching(pvary_p, lambda args, dims, **params: (pvary_p.bind(*args, **params),
                                                                 dims[0]))
_compat.register_jvp(pvary_p, lambda primals, tangents, **params: (
    pvary_p.bind(*primals, **params),
    tangents[0] if type(tangents[0]) is _compat.Zero else pvary_p.bind(tangents[0], **params)))


def cast_per_rank(x, info=None):
    """x typed varying over the communicator's axes (default: RANKS); under
    autodiff its cotangent is summed over the communicator."""
    info = info or world()
    if info.mesh_axes:
        # JAX's own: its transpose, psum over the axes, comes back to mpicoll
        # as the communicator's allreduce (over_ranks/lax.py).
        return _compat.pvary(x, info.mesh_axes)
    return pvary_p.bind(x, comm=info.slot, size=info.size)


# ---------------------------------------------------------------------------
# How the collectives type their inputs and outputs.

def typed_output(spec, x, shape, params):
    """The output aval: x's shape rule, and where typed its variance over the
    communicator's axes."""
    out = _compat.aval_with_shape(x, shape)
    axes = set(typed_axes(params["comm"]))
    if not axes:
        return out
    varying = _compat.varying_axes(x)
    # transpose_sums (the ranks x devices ops under pmap, some transposes) means
    # the sum convention, where every value counts per rank: varying.
    same_everywhere = (spec.replicates and _spans_all_ranks(params)
                       and not params.get("transpose_sums"))
    return _compat.with_varying_axes(out, varying - axes if same_everywhere else varying | axes)


def typed_input(x, info=None):
    """Where typed: a collective contributes a per-rank value.  An invariant x
    (the same on every rank) is cast with pvary, so its gradient collects every
    rank's cotangent."""
    axes = typed_axes(info.slot if info is not None else None)
    if axes and not set(axes) <= _compat.varying_axes(jax.typeof(x)):
        return cast_per_rank(x, info)
    return x


def typed_params(params):
    """Where typed, a communicator short of every rank gets the sum convention
    (its replicated outputs still differ between its groups)."""
    if typed_axes(params["comm"]) and not _spans_all_ranks(params):
        return {**params, "transpose_sums": True}
    return params


def typed_like(ct, aval, params):
    """A transpose's result, typed like the primal input it is the cotangent of."""
    axes = set(typed_axes(params["comm"]))
    if (axes and axes <= _compat.varying_axes(aval)
            and not axes <= _compat.varying_axes(jax.typeof(ct))):
        return cast_per_rank(ct, comm_layer.info_for_slot(params["comm"]))
    return ct


def check_invariant(leaf):
    """pvary's argument check inside mesh(): the value must be the same on every rank."""
    if RANKS in _compat.varying_axes(jax.typeof(leaf)):
        raise ValueError(
            f"mpicoll.pvary: x already varies over {RANKS} (a per-rank value, typed "
            f"{jax.typeof(leaf).str_short()}); pvary marks a value that is the same on every "
            "rank")


# ---------------------------------------------------------------------------
# Reverse mode outside mesh(): by default it refuses, since nothing says which
# values are the same on every rank and mpicoll's convention (one value) gives
# wrong gradients where it is not met.  set_autodiff("convention") accepts the
# convention (mpi4jax's, which mpicoll.mpi4jax sets); the sum convention of
# pmap (transpose_sums, every value per rank) is always well defined.

AUTODIFF_MODES = settings.AUTODIFF_MODES
_autodiff = settings.current().autodiff
_convention_scope = threading.local()  # mpicoll.mpi4jax's calls: mpi4jax's convention


def autodiff_checked():
    """Whether a collective bound now refuses reverse mode outside mesh()."""
    return _autodiff == "checked" and not getattr(_convention_scope, "active", False)


@contextlib.contextmanager
def convention_autodiff():
    """Collectives called inside it (on this thread) follow the convention."""
    previous = getattr(_convention_scope, "active", False)
    _convention_scope.active = True
    try:
        yield
    finally:
        _convention_scope.active = previous


def use_autodiff(mode):
    """Treat collectives traced from now on by mode (mpicoll.set_autodiff); the previous mode."""
    global _autodiff
    previous, _autodiff = _autodiff, mode
    return previous


def current_autodiff():
    """"checked" or "convention", for collectives traced from now on."""
    return _autodiff


def check_reverse_mode(name, params):
    if not params.get("checked_ad") or params.get("transpose_sums") or typed_axes(params["comm"]):
        return
    raise TypeError(
        f"mpicoll.{name}: reverse-mode autodiff through a collective needs to know which "
        "values are the same on every rank. Differentiate inside jax.shard_map over "
        "mpicoll.mesh() (in_specs P() for a value identical on every rank, "
        "P(mpicoll.RANKS) for this rank's data), where JAX checks it; or accept mpicoll's "
        "unchecked convention with mpicoll.set_autodiff('convention') or "
        "MPICOLL_AUTODIFF=convention (docs/autodiff.md)")


def refuse_unrouted_lax_over_ranks():
    """An install step (install.py, at the first use of RANKS).  The lax collectives
    over RANKS are routed to mpicoll's when they bind (over_ranks/lax.py); one that
    reaches XLA anyway (bound before the routing was installed, e.g. in a jaxpr
    traced earlier with the axis spelled out) would act on this process alone."""
    _compat.refuse_lax_collectives_over(
        RANKS, "jax.lax {name} over " + repr(RANKS) + " reached XLA, which would run it on "
        "this process alone: the axis stands for the MPI ranks. It was bound without "
        "mpicoll's routing (traced before mpicoll.RANKS or mpicoll.mesh() was first used?); "
        "name the axis as mpicoll.RANKS over mpicoll.mesh(), or use mpicoll's collectives "
        "(allreduce for psum, allgather for all_gather, sendrecv for ppermute)")
    return f"over {RANKS!r}"

"""MPI collectives as ordered JAX primitives.

One mechanism serves every collective (and, through specs registered from
vector.py and p2p.py, the variable-size collectives and point-to-point).  A
`Collective` spec gives what differs between them: the output shape rule,
whether the op takes a root and a reduction op, its vmap rule and its transpose; `_make_primitive` turns a spec
into a JAX primitive with abstract evaluation, eager evaluation, a lowering to
an FFI custom call that threads the MPI ordering token, batching and AD rules.
`_bind` validates the arguments identically on every rank before binding, so
bad input raises the same Python error everywhere and never reaches MPI.

Autodiff follows shard_map's convention: a value identical on every rank (the
output of allreduce, allgather, bcast) is one value, not `size` copies; a value
that differs per rank is that rank's own, and rank-varying scalar outputs add
up across ranks into the global objective.  `pvary` marks a replicated value
that is then used in a rank-dependent way (its cotangents are summed).
"""

import contextlib
import dataclasses
import functools
import itertools
import operator
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from . import _compat, _dtypes_and_ops, _native, comm as comm_layer, failures, overlap


class MPIEffect(_compat.Effect):
    """The ordered effect of every mpicoll collective: program order on every rank."""

    def __str__(self):
        return "MPI"


mpi_effect = MPIEffect()
_compat.register_ordered_effect(MPIEffect)
# In "tokens" dispatch mode (below) a jitted function with a collective
# dispatches on JAX's Python path, which threads the effect's runtime token
# from program to program; see _compat.
RUNTIME_TOKEN_FAST_PATH = _compat.install_runtime_token_fast_path()
# Serialized mode (_native.SERIALIZED): a program's MPI calls are all done when
# its dispatch returns, so none is in flight while Python (and mpi4py) runs.
# Eager calls complete before returning anyway (_bind).
if _native.SERIALIZED and not _compat.complete_dispatches_with(MPIEffect):
    raise ImportError("mpicoll at MPI_THREAD_SERIALIZED needs to wait for each dispatched "
                      f"program, which this JAX ({jax.__version__}) does not let it do; use "
                      "MPI_THREAD_MULTIPLE (MPI4PY_RC_THREAD_LEVEL=multiple)")

# How a jitted program's MPI calls are ordered after the previous program's
# (README, "Dispatch"): "device-order" lowers a program on one CPU device with
# its ordering token created inside it, so that JAX dispatches it on its C++
# fast path and XLA's per-device queue keeps program order; "tokens" threads
# JAX's runtime tokens from program to program (JAX's Python dispatch path).
# The serialized mode needs each dispatch to wait for its program, which only
# the runtime tokens let mpicoll do, so it keeps "tokens".  Where JAX's
# internals are not as expected the hooks are not installed and "tokens" is
# the only mode (dispatch_mode() says so).
DISPATCH_MODES = ("device-order", "tokens")
_device_order = _compat.DeviceOrderDispatch(MPIEffect)
DEVICE_ORDER_AVAILABLE = not _native.SERIALIZED and _device_order.install()


def set_dispatch(mode):
    """How programs traced after this call are ordered across dispatches; returns the previous mode.

    "device-order" (the default): programs on one CPU device carry no runtime
    token and are ordered by the device's execution queue.  "tokens": JAX's
    runtime tokens, as every program on GPU and the serialized mode use.  A
    compiled program keeps the mode it was lowered with.
    """
    if mode not in DISPATCH_MODES:
        raise ValueError(f"mpicoll.set_dispatch: mode must be one of {DISPATCH_MODES}, "
                         f"got {mode!r}")
    if mode == "device-order" and not DEVICE_ORDER_AVAILABLE:
        raise ValueError(
            "mpicoll.set_dispatch: 'device-order' is not available "
            + ("at MPI_THREAD_SERIALIZED, where each dispatch waits for its program"
               if _native.SERIALIZED else
               f"with this JAX ({jax.__version__}), whose internals mpicoll does not "
               "recognize; programs keep JAX's runtime tokens"))
    previous = dispatch_mode()
    _device_order.active = mode == "device-order"
    return previous


def dispatch_mode():
    """The current dispatch mode: "device-order" or "tokens"."""
    return "device-order" if _device_order.active else "tokens"


# Every lowered call gets its own site number, an attribute of its custom call:
# by default the handler compares a site's call across ranks the first time it
# runs (failures.py), which is how it knows a program is new.
_call_sites = itertools.count(1)

_SUM = _dtypes_and_ops.OP_CODES["sum"]
_OP_NAMES = {code: name for name, code in _dtypes_and_ops.OP_CODES.items()}


@dataclasses.dataclass(frozen=True)
class Collective:
    """The specification of one collective; everything else is shared.

    out_shape(shape, params): output shape from the input shape and the
        primitive's params (params["size"] is the comm size).
    transpose(ct, params): cotangent of x from the output's cotangent; for a
        reduction this is the op="sum" case (the other ops are not linear).
    family: "blocks" (equal rank blocks; pytrees fuse), "vector" (counts per
        rank) or "peer" (point-to-point); the last two carry `ffi_args` (ints the
        handler reads: counts, peers and tags) and have no fused form.
    check(x, info, **static): validates a family's static arguments (counts,
        peers) like the common checks, and returns the params they add.
    batch(x, dim, params): -> (x, params, out_dim) for the batched call, where a
        family's params depend on the shape; the default moves the rank axis first.
    not_differentiable: a reason; the JVP raises it (only zero tangents pass).
    replicates: the output is the same on every rank of comm (allreduce,
        allgather, bcast): typed invariant over RANKS when comm spans every rank.

    Every primitive carries the static params comm (table slot), size, root,
    op (code, -1 if none) and transpose_sums: False for mpicoll's convention
    (a replicated output is one value); True where the cotangents of a
    replicated output are summed over ranks, which the global (ranks x devices)
    collectives need to reproduce psum/all_gather under pmap.
    """
    name: str
    out_shape: Callable
    transpose: Callable
    has_root: bool = False
    reduces: bool = False
    leading_axis_is_size: bool = False  # x must have shape (size, ...)
    in_place: bool = False  # output aliases the input buffer (MPI_IN_PLACE)
    family: str = "blocks"
    check: Callable = None
    batch: Callable = None
    not_differentiable: str = None
    replicates: bool = False  # the output is identical on every rank of comm

    @property
    def target(self):
        return f"mpicoll_{self.name}"


def _run(name, x, params, **changes):
    """Bind collective `name` with params (used by rules that call other collectives)."""
    return PRIMITIVES[name].bind(x, **{**params, **changes, "ordered": True, "alias": True})


def _rank(params):
    return comm_layer.info_for_slot(params["comm"]).rank


# ---------------------------------------------------------------------------
# The collectives: shape, batching and transpose rules, one block each.

# bcast: root's x on every rank.  The output is replicated (one value), so its
# cotangent is the same everywhere and belongs to root's input alone (with
# transpose_sums, pmap's convention, every rank's cotangent is summed to root).
BCAST = Collective(
    "bcast",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: (
        _run("reduce", ct, params, op=_SUM) if params["transpose_sums"]
        else ct if _rank(params) == params["root"] else jnp.zeros_like(ct)),
    has_root=True,
    in_place=True,
    replicates=True,
)


# scatter: rank r gets root's x[r].
SCATTER = Collective(
    "scatter",
    out_shape=lambda shape, params: shape[1:],
    transpose=lambda ct, params: _run("gather", ct, params),
    has_root=True,
    leading_axis_is_size=True,
)

# reduce: the reduction on root, zeros elsewhere.  Only root's cotangent
# matters, and it reaches every rank's input.
REDUCE = Collective(
    "reduce",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: _run("bcast", ct, params, op=-1),
    has_root=True,
    reduces=True,
    in_place=True,
)

# allreduce: the reduction on every rank.  The output is one value; with
# op="sum" each rank's input receives its cotangent unchanged (or, with
# transpose_sums, the sum of every rank's cotangent, as psum under pmap).
# "Unchanged" is pvary, the identity whose own transpose is this allreduce, so
# that transposing twice gives allreduce back (as in mpi4jax), not the identity.
ALLREDUCE = Collective(
    "allreduce",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: (
        _run("allreduce", ct, params) if params["transpose_sums"]
        else pvary_p.bind(ct, comm=params["comm"], size=params["size"])),
    reduces=True,
    in_place=True,
    replicates=True,
)

# gather: the stack by rank on root, zeros elsewhere.
GATHER = Collective(
    "gather",
    out_shape=lambda shape, params: (params["size"], *shape),
    transpose=lambda ct, params: _run("scatter", ct, params),
    has_root=True,
)

# allgather: the stack by rank on every rank (one value); each input's
# cotangent is its own slice (with transpose_sums, of the sum over ranks).
ALLGATHER = Collective(
    "allgather",
    out_shape=lambda shape, params: (params["size"], *shape),
    transpose=lambda ct, params: (
        _run("allreduce", ct, params, op=_SUM) if params["transpose_sums"] else ct)[_rank(params)],
    replicates=True,
)


# alltoall: out[j] on rank r is x[r] of rank j; its own transpose.
# Not in place although the handler supports MPI_IN_PLACE: MPICH's in-place
# alltoall (pairwise Sendrecv_replace) measured 5.3x the out-of-place floor at
# 64 MiB and 2.1x at 4 MiB on 2 ranks (make bench), against 1.5x and 1.06x.
ALLTOALL = Collective(
    "alltoall",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: _run("alltoall", ct, params),
    leading_axis_is_size=True,
)

# reduce_scatter: rank r gets the reduction of every rank's x[r].  With
# op="sum" its transpose is allgather (block r came from every rank's x[r]);
# that allgather's output is a per-rank cotangent, not one replicated value, so
# it is told to sum on transposition (giving reduce_scatter back).
REDUCE_SCATTER = Collective(
    "reduce_scatter",
    out_shape=lambda shape, params: shape[1:],
    transpose=lambda ct, params: _run("allgather", ct, params, op=-1, transpose_sums=True),
    reduces=True,
    leading_axis_is_size=True,
)


def _total(ct, params):
    """The sum of ct over ranks, as a per-rank value (its transpose sums too)."""
    return _run("allreduce", ct, params, op=_SUM, transpose_sums=True)


# scan / exscan: inclusive / exclusive prefix reductions in rank order (exscan
# gives zeros on rank 0, where MPI leaves the result undefined).  With
# op="sum", the transpose is the suffix sum: x_q's cotangent is the sum of
# ct_r over r >= q (scan) or r > q (exscan), written as the total minus the
# other prefix (its rounding follows the total's magnitude).
SCAN = Collective(
    "scan",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: _total(ct, params) - _run("exscan", ct, params),
    reduces=True,
    in_place=True,
)

EXSCAN = Collective(
    "exscan",
    out_shape=lambda shape, params: shape,
    transpose=lambda ct, params: _total(ct, params) - _run("scan", ct, params),
    reduces=True,
    in_place=True,
)

SPECS = (BCAST, SCATTER, REDUCE, ALLREDUCE, GATHER, ALLGATHER, ALLTOALL, REDUCE_SCATTER, SCAN,
         EXSCAN)


# ---------------------------------------------------------------------------
# Derivatives of the non-linear reductions (prod, min, max).

def _reduction_tangent(spec, x, y, t, params):
    """Tangent of reduce/allreduce(x, op) for op in prod/min/max; linear in t."""
    op = _OP_NAMES[params["op"]]
    if spec not in (REDUCE, ALLREDUCE):
        raise NotImplementedError(f"mpicoll.{spec.name}: op={op!r} has no derivative "
                                  "(only op='sum' is differentiable)")
    summed = lambda v: _run(spec.name, v, params, op=_SUM)  # noqa: E731
    if op in ("min", "max"):
        # Like jnp.max: the selected elements' tangents, ties sharing equally.
        selected = y if spec is ALLREDUCE else _run("allreduce", x, params)
        chosen = (x == selected).astype(t.dtype)
        count = summed(chosen)
        return summed(t * chosen) * jnp.where(count > 0, 1 / jnp.where(count > 0, count, 1), 0)
    if op == "prod":
        # d(prod_r x_r) = sum_r (product of the other ranks' x) * t_r: exact with zeros.
        everyone = _run("allgather", x, params, op=-1)
        own = (jnp.arange(params["size"]) == _rank(params)).reshape((-1,) + (1,) * x.ndim)
        others = jnp.prod(jnp.where(own, jnp.ones_like(everyone), everyone), axis=0)
        return summed(others * t)
    raise NotImplementedError(f"mpicoll.{spec.name}: op={op!r} has no derivative")


# ---------------------------------------------------------------------------
# The shared mechanism.

# Every mpicoll primitive lowers to the same custom call on every platform; the
# handler registered for the platform (cpu, or cuda when built with it) runs it.
LOWERING_PLATFORMS = ("cpu", "cuda")


@functools.lru_cache(maxsize=None)
def _backend_present(platform):
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def _register_lowerings(primitive, rule):
    for platform in LOWERING_PLATFORMS:
        _compat.register_call_site_lowering(
            primitive, _lowering_for(primitive, platform, rule), platform=platform)


def _lowering_for(primitive, platform, rule):
    if platform in _native.PLATFORMS:
        return rule
    name = primitive.name.removeprefix("mpicoll_")

    def missing_handlers(ctx, *args, **params):
        # Lowering for a platform this process does not have (cross-lowering,
        # e.g. for cuda on a CPU-only machine) emits the call; running it here
        # would reach XLA without a handler, so say how to build one instead.
        if _backend_present(platform):
            raise NotImplementedError(
                f"mpicoll.{name}: this mpicoll build has no {platform} handlers, so it "
                f"cannot run on {platform} arrays. Rebuild it with CUDA "
                "support: `MPICOLL_CUDA=1 make install` (or `MPICOLL_CUDA=1 pip install "
                "--no-build-isolation .`), with cuda.h under $CUDA_HOME/include; "
                "`python -m mpicoll info` shows what a build supports")
        return rule(ctx, *args, **params)
    return missing_handlers


# vmap: one call for the whole batch.  The rank axis must stay leading, so a
# batch axis in front of it moves behind it; the output's batch axis then
# shifts by the rank axes the op adds (gather) or removes (scatter).
def _rank_axis_first(spec, x, dim):
    if spec.leading_axis_is_size and dim == 0:
        return jnp.moveaxis(x, 0, 1), 1
    return x, dim


def _out_batch_dim(x, dim, out):
    return None if dim is None else dim + out.ndim - x.ndim


def _overlapped_target(ctx, target, overlapped):
    """The FFI target of a call: `mpicoll_<op>_overlapped` for one traced in mpicoll.overlap().

    The param `overlapped` is present (True) only on such calls, so every other
    program's jaxpr is unchanged.
    """
    if not overlapped:
        return target
    platforms = set(ctx.module_context.platforms)
    if platforms - {"cpu"}:
        raise NotImplementedError(
            f"{target}: mpicoll.overlap() runs collectives on a progress thread on CPU only "
            f"for now, not on {sorted(platforms - {'cpu'})}; trace the call outside "
            "mpicoll.overlap() (it then runs synchronously on XLA's stream)")
    if target.endswith("_overlapped_fused"):
        return target
    return f"{target}_overlapped"


def _make_primitive(spec):
    primitive = Primitive(spec.target)

    def abstract_eval(x, *, ordered, **params):
        effects = {mpi_effect} if ordered else set()
        return _typed_output(spec, x, spec.out_shape(x.shape, params), params), effects

    def lowering(ctx, x, *, comm, root, op, ordered, alias, ffi_args=(), overlapped=False,
                 **params):
        token = _compat.token_in(ctx, mpi_effect) if ordered else _compat.create_token()
        # In-place ops alias their output to x (operand 1 after the token): when
        # x is donated or dead, as loop carries often are, XLA hands MPI one
        # buffer and no output is allocated; otherwise XLA copies x first.
        # Eager programs do not alias (alias=False): their input is the
        # caller's array, never donated, so aliasing would only add that copy.
        aliases = {1: 1} if spec.in_place and alias else None
        call = jax.ffi.ffi_lowering(_overlapped_target(ctx, spec.target, overlapped),
                                    has_side_effect=True, operand_output_aliases=aliases)
        # ffi_args: the vector and point-to-point families' ints (counts, peers).
        token, out = call(_compat.with_token_avals(ctx), token, x,
                          comm=np.int64(comm), root=np.int64(root), op=np.int64(op),
                          site=np.int64(next(_call_sites)),
                          args=np.asarray(ffi_args, np.int64).reshape(-1))
        if ordered:
            _compat.set_token_out(ctx, mpi_effect, token)
        return [out]

    def batch(args, dims, **params):
        (x,), (dim,) = args, dims
        if spec.batch is not None:
            x, params, out_dim = spec.batch(x, dim, params)
            return primitive.bind(x, **params), out_dim
        x, dim = _rank_axis_first(spec, x, dim)
        out = primitive.bind(x, **params)
        return out, _out_batch_dim(x, dim, out)

    def jvp(primals, tangents, **params):
        (x,), (t,) = primals, tangents
        y = primitive.bind(x, **params)
        if type(t) is _compat.Zero:
            return y, _compat.zero_tangent(jax.typeof(y))
        if spec.not_differentiable:
            raise NotImplementedError(f"mpicoll.{spec.name}: {spec.not_differentiable}")
        if spec.reduces and params["op"] != _SUM:
            return y, _reduction_tangent(spec, x, y, t, params)
        return y, primitive.bind(t, **params)  # linear

    def transpose(ct, x, **params):
        if spec.reduces and params["op"] != _SUM:
            raise NotImplementedError(f"mpicoll.{spec.name}: op={_OP_NAMES[params['op']]!r} "
                                      "is not linear and cannot be transposed")
        _check_reverse_mode(spec.name, params)
        if type(ct) is _compat.Zero:
            return [_compat.zero_tangent(x.aval)]
        return [_typed_like(spec.transpose(ct, params), x.aval)]

    primitive.def_impl(lambda *args, **params: _compat.apply_primitive(primitive, *args, **params))
    primitive.def_effectful_abstract_eval(abstract_eval)
    _register_lowerings(primitive, lowering)
    _compat.register_batching(primitive, batch)
    _compat.register_jvp(primitive, jvp)
    _compat.register_transpose(primitive, transpose)
    return primitive


PRIMITIVES = {spec.name: _make_primitive(spec) for spec in SPECS}
_SPECS_BY_NAME = {spec.name: spec for spec in SPECS}


def register(spec):
    """Make the primitive of a spec defined in another module (vector, point-to-point)."""
    assert spec.family != "blocks", "rank-block specs belong in SPECS (they have fused forms)"
    PRIMITIVES[spec.name] = _make_primitive(spec)
    _SPECS_BY_NAME[spec.name] = spec
    return spec


def _make_fused_primitive(spec):
    """The collective applied to n arrays of one dtype in one MPI message (pytrees).

    It means exactly one `spec` collective per array, with the same params; the
    FFI handler packs the arrays into one message and unpacks the result.  Its
    rules are those of the single-array primitive, applied array by array, so
    vmap and the forward pass stay fused; cotangents run per array.
    """
    primitive = Primitive(f"{spec.target}_fused")
    primitive.multiple_results = True
    single = PRIMITIVES[spec.name]

    def abstract_eval(*xs, ordered, **params):
        effects = {mpi_effect} if ordered else set()
        return [_typed_output(spec, x, spec.out_shape(x.shape, params), params)
                for x in xs], effects

    def lowering(ctx, *xs, comm, size, root, op, ordered, alias, overlapped=False,
                 **rules):  # rules: AD-only
        token = _compat.token_in(ctx, mpi_effect) if ordered else _compat.create_token()
        # As for one array: outputs alias inputs where the shapes agree, which
        # in a loop saves XLA one copy per carried array and iteration.
        aliases = ({i + 1: i + 1 for i in range(len(xs))} if spec.in_place and alias
                   else None)
        target = f"{spec.target}_overlapped_fused" if overlapped else primitive.name
        call = jax.ffi.ffi_lowering(_overlapped_target(ctx, target, overlapped),
                                    has_side_effect=True, operand_output_aliases=aliases)
        token, *outs = call(_compat.with_token_avals(ctx), token, *xs,
                            comm=np.int64(comm), root=np.int64(root), op=np.int64(op),
                            site=np.int64(next(_call_sites)))
        if ordered:
            _compat.set_token_out(ctx, mpi_effect, token)
        return outs

    def batch(args, dims, **params):
        moved = [_rank_axis_first(spec, x, dim) for x, dim in zip(args, dims)]
        outs = primitive.bind(*(x for x, _ in moved), **params)
        return outs, [_out_batch_dim(x, dim, out) for (x, dim), out in zip(moved, outs)]

    def jvp(primals, tangents, **params):
        ys = primitive.bind(*primals, **params)
        if spec.reduces and params["op"] != _SUM:
            return ys, [_compat.zero_tangent(jax.typeof(y)) if type(t) is _compat.Zero
                        else _reduction_tangent(spec, x, y, t, params)
                        for x, y, t in zip(primals, ys, tangents)]
        # Linear: the nonzero tangents travel fused too.
        live = [i for i, t in enumerate(tangents) if type(t) is not _compat.Zero]
        outs = [_compat.zero_tangent(jax.typeof(y)) for y in ys]
        if live:
            for i, out in zip(live, primitive.bind(*(tangents[i] for i in live), **params)):
                outs[i] = out
        return ys, outs

    def transpose(cts, *xs, **params):
        return [single_transpose(ct, x, **params)[0] for ct, x in zip(cts, xs)]

    single_transpose = _compat.transpose_rule(single)
    primitive.def_impl(lambda *args, **params: _compat.apply_primitive(primitive, *args, **params))
    primitive.def_effectful_abstract_eval(abstract_eval)
    _register_lowerings(primitive, lowering)
    _compat.register_batching(primitive, batch)
    _compat.register_jvp(primitive, jvp)
    _compat.register_transpose(primitive, transpose)
    return primitive


FUSED_PRIMITIVES = {spec.name: _make_fused_primitive(spec) for spec in SPECS}


def _as_array(x, caller):
    if isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return x
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype) and not dtype.isnative:
        raise TypeError(f"mpicoll.{caller}: x has non-native byte order (dtype {dtype.str!r}); "
                        "JAX and MPI need native byte order: pass "
                        "x.astype(x.dtype.newbyteorder('='))")
    try:
        return jnp.asarray(x)
    except OverflowError as error:  # a Python int beyond the integer dtype JAX gives it
        raise TypeError(f"mpicoll.{caller}: x = {x!r} overflows ({error}); pass an array "
                        "with an explicit dtype that holds it") from error
    except (TypeError, ValueError) as error:
        raise TypeError(f"mpicoll.{caller}: x must be an array or a scalar, "
                        f"got {type(x).__name__}") from error


def static_int(value, name, caller):
    """value as an int known when the program is compiled (a root, a peer, a tag)."""
    try:
        return operator.index(value)
    except TypeError:
        if isinstance(value, jax.core.Tracer):
            raise TypeError(f"mpicoll.{caller}: {name} must be a static int, but it is traced "
                            "(an argument of a jitted function?): MPI needs it when the program "
                            "is compiled; make it static (jax.jit(f, static_argnums=...) or "
                            "static_argnames) or close over it") from None
        raise TypeError(f"mpicoll.{caller}: {name} must be an int, got "
                        f"{type(value).__name__}") from None


def _check_root(root, size, caller, among=None):
    root = static_int(root, "root", caller)
    if not 0 <= root < size:
        among = among or f"a communicator of size {size}"
        raise ValueError(f"mpicoll.{caller}: root={root} is out of range for {among}")
    return root


def _validated_params(spec, x, comm, root, op, transpose_sums, static=()):
    """Check every argument (same outcome on every rank, no MPI traffic) -> (x, params).

    static: a family's own static arguments as (name, value) pairs (spec.check).
    """
    info = comm_layer.resolve(comm, spec.name)
    x = _as_array(x, spec.name)
    _dtypes_and_ops.dtype_family(x.dtype, spec.name)
    root = _check_root(root, info.size, spec.name) if spec.has_root else 0
    op_code = _dtypes_and_ops.op_code(op, x.dtype, spec.name) if spec.reduces else -1
    if spec.leading_axis_is_size and (x.ndim == 0 or x.shape[0] != info.size):
        raise ValueError(f"mpicoll.{spec.name}: x must have shape (comm size, ...) = "
                         f"({info.size}, ...), got {tuple(x.shape)}")
    params = dict(comm=info.slot, size=info.size, root=root, op=op_code,
                  transpose_sums=bool(transpose_sums), checked_ad=_autodiff_checked())
    if spec.check is not None:
        params.update(spec.check(x, info, **dict(static)))
    return x, params


def _after_pending_programs():
    """Before an eager call: the jitted collectives still pending come earlier in order.

    In device-order mode on a CPU-only process the eager program joins the same
    device queue behind them (and behind the fence of any multi-device
    program), so nothing needs to wait; GPU programs and the tokens mode order
    by runtime tokens, so wait for them (effects_barrier).
    """
    if not (_device_order.active and _cpu_only_process()):
        jax.effects_barrier()


@functools.lru_cache(maxsize=None)
def _cpu_only_process():
    return jax.default_backend() == "cpu"  # no accelerator: every array is on a CPU device


def _bind(spec, x, *, comm, root=0, op=None, transpose_sums=False, ordered=True, alias=True,
          static=(), overlapped=None):
    """Validate, then run eagerly (a concrete array outside any trace) or bind the primitive.

    ordered=False only for a program that runs synchronously with a single MPI
    call in it (see _collective), where no token is needed to order it.
    overlapped: run on the progress thread (overlap.py); None: as mpicoll.overlap()
    says now.  Eager calls are synchronous whatever it says.
    Point-to-point rejections are not compared across the communicator: only
    two of its ranks take part in a message.
    """
    agree = _agreed if spec.family != "peer" else _validate_alone
    if _compat.at_top_level():
        program, x = agree(comm, spec.name, _eager_program_for, spec, x, comm, root, op,
                           transpose_sums, static)
        _after_pending_programs()
        return program(x).block_until_ready()
    x, params = agree(comm, spec.name, _validated_params, spec, x, comm, root, op,
                      transpose_sums, static)
    x, params = _typed_input(x), _typed_params(params)
    if overlap.active() if overlapped is None else overlapped:
        params["overlapped"] = True
    return PRIMITIVES[spec.name].bind(x, **params, ordered=ordered, alias=alias)


# ---------------------------------------------------------------------------
# Rejections every rank agrees on.  Bad arguments raise before any data moves,
# and usually identically on every rank (the same code, the same shapes).  But
# a rejection can depend on this rank's own data (e.g. scatter's x on a
# non-root rank), and then the other ranks would run the call and wait for
# this one.  So a rank that rejects a call first compares notes: its rejection
# takes the place of the call's fingerprint on the call's communicator, where
# the other ranks' check of a new call (failures.py) meets it.  If every rank
# rejected the call alike, the error is raised as it is; if not, every rank
# raises the mismatch (JaxRuntimeError, as a mismatch found while running).

def _agreed(comm, caller, validate, *args):
    """validate(*args), whose errors every rank agrees on (see above)."""
    try:
        return validate(*args)
    except (TypeError, ValueError) as error:
        _compare_rejection(comm, caller, error)
        raise


def _validate_alone(comm, caller, validate, *args):
    """validate(*args) for point-to-point: a rejection is this rank's alone."""
    return validate(*args)


def _compare_rejection(comm, caller, error):
    if failures.check_mode() == "off":  # nobody checks: the other ranks are not listening
        return
    try:
        info = comm_layer.resolve(comm, caller)
    except (TypeError, ValueError):  # no communicator to compare on (identical on every rank)
        return
    jax.effects_barrier()  # this rank's pending collectives are not running meanwhile
    # The program would run on one device, or on each local device under
    # pmap/shard_map, each talking on its own communicator.
    devices = 1 if _compat.at_top_level() else _compat.devices_running_this_trace()
    for device in range(min(devices, len(info.per_device))):
        mismatch = _native.extension.compare_call(info.slot, device, f"rejected: {error}")
        if mismatch:
            raise jax.errors.JaxRuntimeError(mismatch) from error


# Eager calls: one compiled program per (collective, communicator slot, root, op,
# dtype, shape), looked up by the arguments as given, so a repeated call skips
# validation (the key's parts are exactly what the checks depend on).  An
# explicit communicator is still resolved on every call: that is what notices
# it was freed, and a re-registered communicator gets a new slot.
_EAGER_PROGRAMS = {}


def _eager_program_for(spec, x, comm, root, op, transpose_sums, static=()):
    """The program for a call outside any trace (cached), and x as an array.

    The caller runs it synchronously: completing the call before returning
    keeps MPI order across eager calls without JAX's ordered-effect tokens, so
    JAX's C++ dispatch fast path applies (microseconds instead of the Python
    path).  Jitted work that is still pending runs first
    (_after_pending_programs), so it cannot be overtaken.
    """
    x = _as_array(x, spec.name)  # numpy arrays and scalars run the same cached program
    slot = None if comm is None else comm_layer.resolve(comm, spec.name).slot
    cacheable = type(root) is int and (op is None or type(op) is str)
    key = ((spec.name, slot, root, op, transpose_sums, x.dtype, x.shape, static) if cacheable
           else None)
    program = _EAGER_PROGRAMS.get(key)
    if program is None:
        x, params = _validated_params(spec, x, comm, root, op, transpose_sums, static)
        program = _eager_program(spec.name, tuple(params.items()))
        if cacheable:
            _EAGER_PROGRAMS[key] = program
    return program, x


@functools.lru_cache(maxsize=None)
def _eager_program(name, params):
    primitive = PRIMITIVES[name]
    return jax.jit(functools.partial(primitive.bind, **dict(params), ordered=False, alias=False))


# ---------------------------------------------------------------------------
# Pytrees: small leaves of one dtype travel fused in one MPI message (tensor
# fusion), in buckets of at most FUSION_BYTES; a leaf above FUSION_LEAF_BYTES
# goes alone, zero-copy.  Measured in a jitted loop, 2 ranks, 16 float32
# leaves: fused / one call per leaf = 1/2.5 at 4 KiB, 1/3.6 at 16 KiB, 1/1.8
# at 64 KiB, 1/1.2 at 256 KiB, but 1.5 at 1 MiB, where packing costs more
# than the calls it saves.  The result keeps the tree's structure.

FUSION_BYTES = 4 * 1024 * 1024
FUSION_LEAF_BYTES = 256 * 1024


def _collective(spec, x, **kwargs):
    """One array -> _bind; a pytree -> validated leaves fused per dtype, one call per bucket."""
    if isinstance(x, jax.Array):  # the common case, without flattening
        return _bind(spec, x, **kwargs)
    leaves, treedef = jax.tree.flatten(x)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a single array or scalar
        return _bind(spec, leaves[0], **kwargs)
    if not leaves:
        return x
    leaves = _agreed(kwargs["comm"], spec.name, _each_leaf, x, leaves,
                     lambda leaf: _as_array(leaf, spec.name))
    _agreed(kwargs["comm"], spec.name, functools.partial(_check_leaves, **kwargs), spec, x,
            leaves)  # every leaf, before any MPI call
    kwargs["comm"] = comm_layer.resolve(kwargs["comm"], spec.name)
    if spec.reduces:
        kwargs["op"] = _dtypes_and_ops.op_name(kwargs["op"], spec.name)
    if not _compat.at_top_level():  # one program for the tree, its messages in order
        program = _fused_program(spec, ordered=True, alias=True, overlapped=overlap.active(),
                                 **kwargs)
        return jax.tree.unflatten(treedef, program(tuple(leaves)))
    # Eagerly, each message runs like an eager array call: its own cached
    # program, synchronously and without the ordered effect, so JAX dispatches
    # it on its C++ fast path (a program with effects takes its Python path,
    # 1.6 ms instead of 0.45 ms with 100 arrays); completing each before the
    # next keeps the order.  Eager inputs are the caller's arrays: no aliasing.
    program = _fused_program(spec, ordered=False, alias=False, overlapped=False, **kwargs)
    results = [None] * len(leaves)
    _after_pending_programs()
    for indices in _messages(leaves):
        outs = jax.block_until_ready(program(tuple(leaves[i] for i in indices)))
        for i, out in zip(indices, outs):
            results[i] = out
    return jax.tree.unflatten(treedef, results)


@functools.lru_cache(maxsize=None)
def _fused_program(spec, **kwargs):
    return jax.jit(functools.partial(_fused_leaves, spec, **kwargs))


def _messages(leaves):
    """Leaf indices grouped into MPI messages, the same on every rank: a large
    leaf alone, small leaves of one dtype together up to FUSION_BYTES."""
    messages, open_buckets = [], {}  # open_buckets: dtype -> [indices, bytes]
    for index, leaf in enumerate(leaves):
        nbytes = leaf.size * leaf.dtype.itemsize
        if nbytes > FUSION_LEAF_BYTES:
            messages.append([index])
            continue
        bucket = open_buckets.get(leaf.dtype)
        if bucket is None or bucket[1] + nbytes > FUSION_BYTES:
            bucket = open_buckets[leaf.dtype] = [[], 0]
            messages.append(bucket[0])
        bucket[0].append(index)
        bucket[1] += nbytes
    return messages


def _check_leaves(spec, tree, leaves, *, comm, root=0, op=None):
    """_validated_params for every leaf: once per distinct (dtype, leading axis), in tree order."""
    distinct = {}
    for index, leaf in enumerate(leaves):
        distinct.setdefault((leaf.dtype, leaf.shape[:1]), index)
    _each_leaf(tree, leaves, lambda leaf: _validated_params(spec, leaf, comm, root, op, False),
               indices=distinct.values())


def _each_leaf(tree, leaves, fn, indices=None):
    """[fn(leaf) for the leaves at indices (default: all)]; an error names the leaf's path."""
    results = []
    for index in range(len(leaves)) if indices is None else indices:
        try:
            results.append(fn(leaves[index]))
        except (TypeError, ValueError) as error:
            path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][index]
            raise type(error)(f"{error} (in the pytree leaf x{jax.tree_util.keystr(path)})") \
                from error
    return results


def _fused_leaves(spec, leaves, ordered, alias, overlapped, **kwargs):
    messages = _messages(leaves)
    # Without the ordered effect nothing orders two messages in one program.
    assert ordered or len(messages) == 1, "an unordered program holds one message"
    results = [None] * len(leaves)
    for indices in messages:
        if len(indices) == 1:
            results[indices[0]] = _bind(spec, leaves[indices[0]], ordered=ordered, alias=alias,
                                        overlapped=overlapped, **kwargs)
            continue
        _, params = _validated_params(spec, leaves[indices[0]], kwargs["comm"],
                                      kwargs.get("root", 0), kwargs.get("op"), False)
        if overlapped:
            params["overlapped"] = True
        outs = FUSED_PRIMITIVES[spec.name].bind(*(_typed_input(leaves[i]) for i in indices),
                                                **_typed_params(params),
                                                ordered=ordered, alias=alias)
        for i, out in zip(indices, outs):
            results[i] = out
    return results


# ---------------------------------------------------------------------------
# Barrier: no data, only the ordering token.

barrier_p = Primitive("mpicoll_barrier")
barrier_p.multiple_results = True
barrier_p.def_impl(lambda **params: _compat.apply_primitive(barrier_p, **params))
barrier_p.def_effectful_abstract_eval(lambda *, comm: ([], {mpi_effect}))


def _barrier_lowering(ctx, *, comm):
    token = _compat.token_in(ctx, mpi_effect)
    (token,) = jax.ffi.ffi_lowering("mpicoll_barrier", has_side_effect=True)(
        _compat.with_token_avals(ctx), token, comm=np.int64(comm),
        site=np.int64(next(_call_sites)))
    _compat.set_token_out(ctx, mpi_effect, token)
    return []


_register_lowerings(barrier_p, _barrier_lowering)


# ---------------------------------------------------------------------------
# pvary: identity on the value; its cotangent is summed over ranks.  Apply it
# to a replicated value (e.g. parameters) before using it rank-dependently, so
# that the gradient collects every rank's contribution (as shard_map does).

pvary_p = Primitive("mpicoll_pvary")
pvary_p.def_impl(lambda x, **params: x)
pvary_p.def_abstract_eval(
    lambda x, **params: _compat.with_varying_axes(x, _compat.varying_axes(x) | {RANKS})
    if _ranks_typed() else x)
_compat.register_lowering(pvary_p, lambda ctx, x, **params: [x])
_compat.register_batching(pvary_p, lambda args, dims, **params: (pvary_p.bind(*args, **params),
                                                                 dims[0]))
_compat.register_jvp(pvary_p, lambda primals, tangents, **params: (
    pvary_p.bind(*primals, **params),
    tangents[0] if type(tangents[0]) is _compat.Zero else pvary_p.bind(tangents[0], **params)))


def _pvary_transpose(ct, x, *, comm, size):
    if type(ct) is _compat.Zero:
        return [_compat.zero_tangent(x.aval)]
    return [_run("allreduce", ct, dict(comm=comm, size=size, root=0, op=_SUM,
                                       transpose_sums=False))]


_compat.register_transpose(pvary_p, _pvary_transpose)


# ---------------------------------------------------------------------------
# The ranks as a mesh axis JAX's type system tracks.  Inside shard_map over
# mesh() (check_vma=True, JAX's default), every value is typed varying or
# invariant over RANKS: in_specs P(RANKS) marks per-rank data, P() a value
# identical on every rank (parameters).  The collectives type their outputs
# (allreduce/allgather/bcast over every rank: invariant; the rest: varying)
# and take per-rank inputs, casting an invariant one with pvary.  JAX then does
# the rest with its own rules: it inserts pvary where an invariant value meets
# a varying one (the cotangent of a replicated parameter is summed over ranks,
# via route_pvary_transpose below) and rejects a loop whose carry changes type
# (a per-rank carry that an allreduce makes identical).  Outside such a mesh
# nothing is typed and the convention in the module docstring applies.

RANKS = "mpicoll.RANKS"


def mesh(local_axis=None, devices=None):
    """A jax.sharding.Mesh whose first axis, RANKS, stands for the MPI ranks.

    Locally the RANKS axis has size 1 (this process); mpicoll's collectives
    act across it.  With local_axis (a name), a second axis spans this
    process's devices (default: all local devices), for per-device data
    (P((RANKS, local_axis))) and the global collectives (axis_name=local_axis).
    Without it the mesh holds one device (default: the first local one).
    """
    from jax.sharding import Mesh
    if local_axis == RANKS:
        raise ValueError(f"mpicoll.mesh: local_axis must differ from {RANKS!r}")
    if devices is None:
        devices = jax.local_devices() if local_axis is not None else jax.local_devices()[:1]
    devices = np.array(list(devices))
    if local_axis is None:
        if devices.size != 1:
            raise ValueError(f"mpicoll.mesh: {devices.size} devices need a local_axis name")
        return Mesh(devices.reshape(1), (RANKS,))
    return Mesh(devices.reshape(1, -1), (RANKS, local_axis))


def _ranks_typed():
    return _compat.axis_in_manual_mesh(RANKS)


def _world():
    return comm_layer.resolve(None, "pvary")


def _spans_all_ranks(params):
    return params["size"] == _world().size


def _typed_output(spec, x, shape, params):
    """The output aval: x's shape rule, and inside mesh() its RANKS variance."""
    out = _compat.aval_with_shape(x, shape)
    if not _ranks_typed():
        return out
    varying = _compat.varying_axes(x)
    # transpose_sums (the global ops under pmap, some transposes) means the
    # sum convention, where every value counts per rank: varying.
    same_everywhere = (spec.replicates and _spans_all_ranks(params)
                       and not params.get("transpose_sums"))
    return _compat.with_varying_axes(
        out, varying - {RANKS} if same_everywhere else varying | {RANKS})


def _cast_per_rank(x):
    """x typed varying over RANKS; under autodiff its cotangent is summed over all ranks."""
    world = _world()
    return pvary_p.bind(x, comm=world.slot, size=world.size)


def _typed_input(x):
    """Inside mesh(): a collective contributes a per-rank value.  An invariant x
    (the same on every rank) is cast with pvary, so its gradient collects every
    rank's cotangent."""
    if _ranks_typed() and RANKS not in _compat.varying_axes(jax.typeof(x)):
        return _cast_per_rank(x)
    return x


def _typed_params(params):
    """Inside mesh(), a communicator short of every rank gets the sum convention
    (its replicated outputs still differ between its groups)."""
    if _ranks_typed() and not _spans_all_ranks(params):
        return {**params, "transpose_sums": True}
    return params


def _typed_like(ct, aval):
    """A transpose's result, typed like the primal input it is the cotangent of."""
    if (_ranks_typed() and RANKS in _compat.varying_axes(aval)
            and RANKS not in _compat.varying_axes(jax.typeof(ct))):
        return _cast_per_rank(ct)
    return ct


# Reverse mode outside mesh(): by default it refuses, since nothing says which
# values are the same on every rank and mpicoll's convention (one value) gives
# wrong gradients where it is not met.  set_autodiff("convention") accepts the
# convention (mpi4jax's, which mpicoll.mpi4jax sets); the sum convention of
# pmap (transpose_sums, every value per rank) is always well defined.
AUTODIFF_MODES = ("checked", "convention")
_autodiff = "checked"
_convention_scope = threading.local()  # mpicoll.mpi4jax's calls: mpi4jax's convention


def _autodiff_checked():
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


def set_autodiff(mode):
    """How reverse-mode autodiff treats collectives outside mesh(); returns the previous mode.

    It applies to collectives called (traced) after it, on every rank alike.

    "checked" (the default): transposing a collective outside shard_map over
    mpicoll.mesh() raises TypeError, where JAX would type the ranks.
    "convention": mpicoll's unchecked convention (README, "vmap and autodiff").
    Forward mode (jvp, jacfwd) is exact either way.
    """
    global _autodiff
    if mode not in AUTODIFF_MODES:
        raise ValueError(f"mpicoll.set_autodiff: mode must be one of {AUTODIFF_MODES}, "
                         f"got {mode!r}")
    previous, _autodiff = _autodiff, mode
    return previous


def autodiff_mode():
    """The current autodiff mode: "checked" or "convention"."""
    return _autodiff


def _check_reverse_mode(name, params):
    if not params.get("checked_ad") or params.get("transpose_sums") or _ranks_typed():
        return
    raise TypeError(
        f"mpicoll.{name}: reverse-mode autodiff through a collective needs to know which "
        "values are the same on every rank. Differentiate inside jax.shard_map over "
        "mpicoll.mesh() (in_specs P() for a value identical on every rank, "
        "P(mpicoll.RANKS) for this rank's data), where JAX checks it; or accept mpicoll's "
        "unchecked convention with mpicoll.set_autodiff('convention') or "
        "MPICOLL_AUTODIFF=convention (README: vmap and autodiff)")


def _sum_over_ranks(ct):
    world = _world()
    return _run("allreduce", ct, dict(comm=world.slot, size=world.size, root=0, op=_SUM,
                                      transpose_sums=False))


_compat.route_pvary_transpose(RANKS, _sum_over_ranks)
_compat.refuse_lax_collectives_over(
    RANKS, "jax.lax {name} over " + repr(RANKS) + " would act on this process alone: the "
    "axis stands for the MPI ranks; use mpicoll's collectives (allreduce for psum, allgather "
    "for all_gather, sendrecv for ppermute, the communicator's rank for axis_index)")


# ---------------------------------------------------------------------------
# Public API (MPI's names and argument order).

def bcast(x, root=0, *, comm=None, axis_name=None):
    """Root's x on every rank (MPI_Bcast). Output shape: x.shape.

    With axis_name (the local device axis of pmap/shard_map), root is a global
    participant index rank * local_devices + device.
    """
    if axis_name is not None:
        return global_collectives.bcast(x, root, comm, axis_name)
    return _collective(BCAST, x, comm=comm, root=root)


def _no_global_form(name, axis_name, instead):
    if axis_name is not None:
        raise NotImplementedError(
            f"mpicoll.{name}: axis_name is not supported: {name} has no global (ranks x "
            f"devices) form; {instead}, or call {name} without axis_name inside pmap/shard_map "
            "(one collective per local device)")


def scatter(x, root=0, *, comm=None, axis_name=None):
    """Rank r gets root's x[r]; x has shape (size, *s) on every rank (MPI_Scatter). Output: s."""
    _no_global_form("scatter", axis_name, "use alltoall(x, axis_name=...)")
    return _collective(SCATTER, x, comm=comm, root=root)


def reduce(x, op="sum", root=0, *, comm=None, axis_name=None):
    """Reduction of x over ranks on root, zeros elsewhere (MPI_Reduce). Output: x.shape."""
    _no_global_form("reduce", axis_name, "use allreduce(x, op, axis_name=...)")
    return _collective(REDUCE, x, comm=comm, root=root, op=op)


def allreduce(x, op="sum", *, comm=None, axis_name=None):
    """Reduction of x over ranks on every rank (MPI_Allreduce). Output: x.shape.

    With axis_name, over every device of every rank (like lax.psum for op="sum").
    """
    if axis_name is not None:
        return global_collectives.allreduce(x, op, comm, axis_name)
    return _collective(ALLREDUCE, x, comm=comm, op=op)


def gather(x, root=0, *, comm=None, axis_name=None):
    """Stack of every rank's x by rank on root, zeros elsewhere (MPI_Gather). Output: (size, *x.shape)."""
    _no_global_form("gather", axis_name, "use allgather(x, axis_name=...)")
    return _collective(GATHER, x, comm=comm, root=root)


def allgather(x, *, comm=None, axis_name=None):
    """Stack of every rank's x by rank on every rank (MPI_Allgather). Output: (size, *x.shape).

    With axis_name: the stack of every participant's x, (size * local_devices, *x.shape).
    """
    if axis_name is not None:
        return global_collectives.allgather(x, comm, axis_name)
    return _collective(ALLGATHER, x, comm=comm)


def alltoall(x, *, comm=None, axis_name=None):
    """out[j] on rank r is x[r] of rank j; x has shape (size, *s) (MPI_Alltoall). Output: x.shape.

    With axis_name, over every participant: x has shape (size * local_devices, *s).
    """
    if axis_name is not None:
        return global_collectives.alltoall(x, comm, axis_name)
    return _collective(ALLTOALL, x, comm=comm)


def reduce_scatter(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction over ranks of x[r]; x has shape (size, *s) (MPI_Reduce_scatter_block). Output: s.

    With axis_name, over every participant: x has shape (size * local_devices, *s)
    and participant p gets the reduction of every participant's x[p] (like
    lax.psum_scatter for op="sum").
    """
    if axis_name is not None:
        return global_collectives.reduce_scatter(x, op, comm, axis_name)
    return _collective(REDUCE_SCATTER, x, comm=comm, op=op)


def scan(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction of x over ranks 0..r (MPI_Scan). Output: x.shape."""
    _no_global_form("scan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return _collective(SCAN, x, comm=comm, op=op)


def exscan(x, op="sum", *, comm=None, axis_name=None):
    """Rank r gets the reduction of x over ranks 0..r-1; zeros on rank 0 (MPI_Exscan). Output: x.shape."""
    _no_global_form("exscan", axis_name, "use allgather(x, axis_name=...) and a local cumsum")
    return _collective(EXSCAN, x, comm=comm, op=op)


def barrier(*, comm=None):
    """Block until every rank of comm reaches this point (MPI_Barrier), in program order."""
    info = comm_layer.resolve(comm, "barrier")
    barrier_p.bind(comm=info.slot)


def pvary(x, *, comm=None):
    """x (an array or a pytree) unchanged; under autodiff its cotangent is summed over ranks.

    Use it on a value that is identical on every rank (parameters, a bcast or
    allreduce result) before using it in a rank-dependent way, so that the
    gradient collects every rank's contribution.
    """
    info = comm_layer.resolve(comm, "pvary")
    leaves, treedef = jax.tree.flatten(x)
    leaves = _each_leaf(x, leaves, lambda leaf: _as_array(leaf, "pvary"))
    _each_leaf(x, leaves, lambda leaf: _dtypes_and_ops.dtype_family(leaf.dtype, "pvary"))
    if _ranks_typed():
        _each_leaf(x, leaves, _check_invariant)
    return jax.tree.unflatten(treedef, [pvary_p.bind(leaf, comm=info.slot, size=info.size)
                                        for leaf in leaves])


def _check_invariant(leaf):
    if RANKS in _compat.varying_axes(jax.typeof(leaf)):
        raise ValueError(
            f"mpicoll.pvary: x already varies over {RANKS} (a per-rank value, typed "
            f"{jax.typeof(leaf).str_short()}); pvary marks a value that is the same on every "
            "rank")


from . import global_collectives  # noqa: E402  (composes the primitives defined above)

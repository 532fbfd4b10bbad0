"""One way to make an mpicoll primitive: the ordered MPI effect, the FFI call, define(spec).

Every mpicoll primitive lowers to a custom call of the extension that takes the
MPI ordering token first and returns it first (`ordered_ffi_call`), so every
rank issues its MPI calls in program order.  `define(spec)` turns a Collective
spec (primitive/spec.py) into its primitive, and for the blocks family into the fused
primitive that moves n arrays of one dtype in one message, each with abstract
evaluation, eager evaluation, the lowering, batching and AD rules.
`effectful_primitive` serves the calls that are not collectives of one array
(barrier, the receive status, the ranks x devices combine).
"""

import contextlib
import functools
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from .. import PACKAGE_DIR, users_line_now
from .. import _compat
from ..runtime import native, dtypes
from . import sharded, varying
from .spec import SPECS


class MPIEffect(_compat.Effect):
    """The ordered effect of every mpicoll collective: program order on every rank."""

    def __str__(self):
        return "MPI"


mpi_effect = MPIEffect()  # registered as an ordered effect by install.py

# Every lowered call gets its own site number, an attribute of its custom call:
# by default the handler compares a site's call across ranks the first time it
# runs (failures.py), which is how it knows a program is new.
_call_sites = itertools.count(1)

# A jax.named_scope whose name starts with this names the collective as the user
# wrote it, where mpicoll runs it in its own calls (over_ranks/lax.py): reports
# and mismatch messages say both.
WRITTEN_AS_PREFIX = "jax.lax."

# What a routed jax.lax call binds mpicoll's collectives as, on this thread, while
# it binds them (over_ranks/lax.py): (the written-as name, the user's line of the
# call).  Under jit the named_scope carries the name to the lowering; an eager
# shard_map lowers each collective into a program of its own, inside the bind,
# where the user's scope and line are no longer in the lowering's name stack and
# traceback: there this is what names the call.
_routed = threading.local()


@contextlib.contextmanager
def routed_as(written_as, line):
    outer = getattr(_routed, "call", None)
    _routed.call = (written_as, line)
    try:
        yield
    finally:
        _routed.call = outer

class _EagerLowering(threading.local):
    active = False


# Set while an eager call compiles its program (dispatch.run_eagerly), for the
# thread that compiles it (JAX lowers on the calling thread; another thread's
# lowering meanwhile is its own, a jitted call's): JAX caches that program by
# signature, so its site's source line is the first caller's, and every-call
# checks compare the sites of jitted calls only.
lowering_eagerly = _EagerLowering()


def ordered_ffi_call(ctx, target, *operands, ordered=True, aliases=None, numbered=True,
                     **attributes):
    """Lower to the FFI custom call `target`(token, *operands) -> (token, *outputs).

    ordered: the token is the MPI effect's, threaded from the previous MPI call
    of the program to the next; unordered calls (a synchronous eager program
    with one MPI call) get a fresh one.  aliases: {operand: output} indices
    counted after the token, for in-place calls.  Integer attributes are passed
    as int64; every call gets its own site number (`site`), except where the
    handler checks nothing across ranks (numbered=False).
    """
    mesh = _compat.lowering_mesh(ctx)
    if mesh is not None:
        _check_process_major(mesh)
    devices = _compat.partitioned_devices(ctx)
    if devices > 1:
        # XLA would partition the side-effecting call over the program's devices and
        # stop on an internal error; sharded.py lays out every value it can see.
        raise NotImplementedError(
            f"{target}: a value without a layout of its own in a program that spans "
            f"{devices} devices (jit of arrays placed over several devices, with automatic "
            "axes): XLA chooses its layout when it compiles, which mpicoll cannot see when "
            "it traces the call. Place it (jax.device_put(x, NamedSharding(mesh, spec))), "
            "trace under jax.set_mesh(mesh), or call mpicoll inside jax.shard_map")
    token = _compat.token_in(ctx, mpi_effect) if ordered else _compat.create_token()
    call = jax.ffi.ffi_lowering(target, has_side_effect=True,
                                operand_output_aliases=aliases)
    if numbered:
        attributes["site"] = next(_call_sites)
        # mpicoll's own frames are skipped.  JAX's traceback of a jitted mpicoll
        # function (jax.jit(mpicoll.allreduce)) ends in mpicoll's frames: then the
        # line compiling the program (its first call) is the user's, not compared in
        # every-call mode (another rank may first call it from another line).
        where = _compat.user_source_line(ctx, PACKAGE_DIR)
        compared = where is not None and not lowering_eagerly.active
        written_as = _compat.lowering_scope(ctx, WRITTEN_AS_PREFIX)
        routed = getattr(_routed, "call", None)
        if written_as is None and routed is not None:  # lowered inside the routed bind
            written_as, where = routed[0], routed[1] or where
        where = where or users_line_now()
        if where or written_as:
            native.extension.describe_site(attributes["site"], where or "", compared,
                                           written_as or "")
    attributes = {name: np.int64(value) if isinstance(value, (int, np.integer)) else value
                  for name, value in attributes.items()}
    token, *outs = call(_compat.with_token_avals(ctx), token, *operands, **attributes)
    if ordered:
        _compat.set_token_out(ctx, mpi_effect, token)
    return outs



@functools.lru_cache(maxsize=None)
def _check_process_major(mesh):
    """A mesh over several processes must list their devices process-major, each
    process's in its local order: mpicoll's communicators and handlers number the
    participants that way (over_ranks/lax.py)."""
    devices = list(mesh.devices.flat)
    if len({device.process_index for device in devices}) == 1:
        return
    local = jax.local_device_count()
    expected = [(i // local, i % local) for i in range(len(devices))]
    order = {device: index for index, device in enumerate(jax.local_devices())}
    found = [(device.process_index, order.get(device, i % local))
             for i, device in enumerate(devices)]
    if found != expected:
        raise ValueError(
            f"mpicoll: the mesh {dict(mesh.shape)} lists its devices as (process, local "
            f"device) {found}; mpicoll needs them process-major, each process's devices in "
            "the order of jax.local_devices(): build it with jax.make_mesh(...) or "
            "Mesh(np.array(jax.devices()).reshape(...), names)")


# ---------------------------------------------------------------------------
# Lowerings for every platform.  Every mpicoll primitive lowers to the same
# custom call on every platform; the handler registered for the platform (cpu,
# or cuda when built with it) runs it.
LOWERING_PLATFORMS = ("cpu", "cuda")


@functools.lru_cache(maxsize=None)
def _backend_present(platform):
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def _lowering_for(primitive, platform, rule):
    if platform in native.PLATFORMS:
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


def effectful_primitive(name, abstract_eval, lowering, *, multiple_results=False,
                        lowerings=None):
    """A primitive with MPI's effect: eager evaluation, abstract_eval -> (avals, effects),
    `lowering` on every platform (or `lowerings`: {platform: rule})."""
    primitive = Primitive(name)
    primitive.multiple_results = multiple_results
    primitive.def_impl(lambda *args, **params: _compat.apply_primitive(primitive, *args,
                                                                       **params))
    primitive.def_effectful_abstract_eval(abstract_eval)
    for platform in LOWERING_PLATFORMS:
        rule = (lowerings or {}).get(platform)  # a platform's own rule is used as it is
        _compat.register_call_site_lowering(
            primitive, rule or _lowering_for(primitive, platform, lowering), platform=platform)
    return primitive


def _effects(ordered):
    return {mpi_effect} if ordered else set()


# ---------------------------------------------------------------------------
# vmap: one call for the whole batch.  The rank axis must stay leading, so a
# batch axis in front of it moves behind it; the output's batch axis then
# shifts by the rank axes the op adds (gather) or removes (scatter).

def _rank_axis_first(spec, x, dim):
    if spec.leading_axis_is_size and dim == 0:
        return jax.numpy.moveaxis(x, 0, 1), 1
    return x, dim


def _out_batch_dim(x, dim, out):
    return None if dim is None else dim + out.ndim - x.ndim


def _overlapped_target(ctx, target, overlapped, here_once_arrived):
    """The FFI target of a call and its extra attributes: `mpicoll_<op>_overlapped`
    for one traced in mpicoll.overlap(), or for a device's call on its shard of a
    sharded array (here_once_arrived: it runs on XLA's thread where every rank has
    already arrived, else on the progress thread; entries/cpu.cc, RunOverlapped).

    The params `overlapped` and `here_once_arrived` are present (True) only on
    such calls, so every other program's jaxpr is unchanged.
    """
    if not overlapped:
        return target, {}
    platforms = set(ctx.module_context.platforms)
    if platforms - {"cpu"}:
        raise NotImplementedError(
            f"{target}: mpicoll.overlap() runs collectives on a progress thread on CPU only "
            f"for now, not on {sorted(platforms - {'cpu'})}; trace the call outside "
            "mpicoll.overlap() (it then runs synchronously on XLA's stream)")
    attributes = {"here_once_arrived": int(bool(here_once_arrived))}
    if target.endswith("_fused"):
        return f"{target.removesuffix('_fused')}_overlapped_fused", attributes
    return f"{target}_overlapped", attributes


def _on_each_device(ctx, devices, primitive, spec, xs, params):
    """The lowering of a call on values XLA lays out when it compiles: a jit over
    arrays placed on several devices, with automatic axes, where mpicoll saw no
    layout when it traced the call (primitive/sharded.py lays out every value it
    can see).  XLA cannot partition a side-effecting call, so the call runs in a
    manual region over the program's devices, each array replicated into it (XLA
    gathers a sharded one first) and split over the devices as sharded.py splits
    a replicated array: each byte crosses the network once per process."""
    mesh = jax.sharding.AbstractMesh((devices,), ("_mpicoll_devices",))
    if tuple(ctx.module_context.platforms) == ("cpu",):  # never waits on XLA's thread (sharded.py)
        params = dict(params, overlapped=True, here_once_arrived=True)

    def each(*values):
        outs = []
        for value in values:
            # A value typed with a layout (vmap of a sharded array) keeps it.
            typed = sharded.layout_of(value, spec.name)
            layout = typed or sharded.Layout(mesh, (), value.ndim)
            region = sharded.region(spec.name, layout, spec.family,
                                    lambda shard: primitive.bind(shard, **params))
            outs.append(region(value))
        return outs

    return _compat.lower_function(ctx, each, *xs, multiple_results=True)


def _tangent(spec, x, y, t, params):
    """The tangent of a non-linear reduction (op != sum)."""
    if spec.reduction_jvp is None:
        raise NotImplementedError(
            f"mpicoll.{spec.name}: op={dtypes.OP_NAMES[params['op']]!r} has no derivative "
            "(only op='sum' is differentiable)")
    return spec.reduction_jvp(x, y, t, params)


def _nonlinear(spec, params):
    return spec.reduces and params["op"] != dtypes.SUM


def _single_array_primitive(spec):
    def abstract_eval(x, *, ordered, **params):
        return varying.typed_output(spec, x, spec.out_shape(x.shape, params), params), \
            _effects(ordered)

    def lowering(ctx, x, *, comm, root, op, ordered, alias, ffi_args=(), overlapped=False,
                 here_once_arrived=False, **params):
        devices = _compat.partitioned_devices(ctx)
        if devices:  # a value XLA lays out when it compiles: see _on_each_device
            return _on_each_device(ctx, devices, primitive, spec, (x,), dict(
                comm=comm, root=root, op=op, ordered=ordered, alias=alias, ffi_args=ffi_args,
                **params))
        # In-place ops alias their output to x (operand 0 after the token): when
        # x is donated or dead, as loop carries often are, XLA hands MPI one
        # buffer and no output is allocated; otherwise XLA copies x first.
        # Eager programs do not alias (alias=False): their input is the
        # caller's array, never donated, so aliasing would only add that copy.
        # ffi_args: the vector and point-to-point families' ints (counts, peers).
        target, attributes = _overlapped_target(ctx, spec.target, overlapped, here_once_arrived)
        return ordered_ffi_call(
            ctx, target, x, ordered=ordered,
            aliases={1: 1} if spec.in_place and alias else None, comm=comm, root=root, op=op,
            args=np.asarray(ffi_args, np.int64).reshape(-1), **attributes)

    primitive = effectful_primitive(spec.target, abstract_eval, lowering)

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
        if _nonlinear(spec, params):
            return y, _tangent(spec, x, y, t, params)
        return y, primitive.bind(t, **params)  # linear

    def transpose(ct, x, **params):
        if _nonlinear(spec, params):
            raise NotImplementedError(f"mpicoll.{spec.name}: "
                                      f"op={dtypes.OP_NAMES[params['op']]!r} "
                                      "is not linear and cannot be transposed")
        varying.check_reverse_mode(spec.name, params)
        if type(ct) is _compat.Zero:
            return [_compat.zero_tangent(x.aval)]
        return [varying.typed_like(spec.transpose(ct, params), x.aval, params)]

    _compat.register_batching(primitive, batch)
    _compat.register_jvp(primitive, jvp)
    _compat.register_transpose(primitive, transpose)
    return primitive


def _fused_primitive(spec, single):
    """The collective applied to n arrays of one dtype in one MPI message (pytrees).

    It means exactly one `spec` collective per array, with the same params; the
    FFI handler packs the arrays into one message and unpacks the result.  Its
    rules are those of the single-array primitive, applied array by array, so
    vmap and the forward pass stay fused; cotangents run per array.
    """
    def abstract_eval(*xs, ordered, **params):
        return [varying.typed_output(spec, x, spec.out_shape(x.shape, params), params)
                for x in xs], _effects(ordered)

    def lowering(ctx, *xs, comm, size, root, op, ordered, alias, overlapped=False,
                 here_once_arrived=False, **rules):  # rules: AD-only
        devices = _compat.partitioned_devices(ctx)
        if devices:  # one array at a time, each as the single-array call does
            return _on_each_device(ctx, devices, single, spec, xs, dict(
                comm=comm, size=size, root=root, op=op, ordered=ordered, alias=alias,
                **rules))
        # As for one array: outputs alias inputs where the shapes agree, which
        # in a loop saves XLA one copy per carried array and iteration.
        aliases = ({i + 1: i + 1 for i in range(len(xs))} if spec.in_place and alias
                   else None)
        target, attributes = _overlapped_target(ctx, f"{spec.target}_fused", overlapped,
                                                here_once_arrived)
        return ordered_ffi_call(ctx, target, *xs, ordered=ordered, aliases=aliases, comm=comm,
                                root=root, op=op, **attributes)

    primitive = effectful_primitive(f"{spec.target}_fused", abstract_eval, lowering,
                                    multiple_results=True)

    def batch(args, dims, **params):
        moved = [_rank_axis_first(spec, x, dim) for x, dim in zip(args, dims)]
        outs = primitive.bind(*(x for x, _ in moved), **params)
        return outs, [_out_batch_dim(x, dim, out) for (x, dim), out in zip(moved, outs)]

    def jvp(primals, tangents, **params):
        ys = primitive.bind(*primals, **params)
        if _nonlinear(spec, params):
            return ys, [_compat.zero_tangent(jax.typeof(y)) if type(t) is _compat.Zero
                        else _tangent(spec, x, y, t, params)
                        for x, y, t in zip(primals, ys, tangents)]
        # Linear: the nonzero tangents travel fused too.
        live = [i for i, t in enumerate(tangents) if type(t) is not _compat.Zero]
        outs = [_compat.zero_tangent(jax.typeof(y)) for y in ys]
        if live:
            for i, out in zip(live, primitive.bind(*(tangents[i] for i in live), **params)):
                outs[i] = out
        return ys, outs

    single_transpose = _compat.transpose_rule(single)

    def transpose(cts, *xs, **params):
        return [single_transpose(ct, x, **params)[0] for ct, x in zip(cts, xs)]

    _compat.register_batching(primitive, batch)
    _compat.register_jvp(primitive, jvp)
    _compat.register_transpose(primitive, transpose)
    return primitive


# The extension's table of collectives (csrc/ops.def), by name.
_NATIVE_COLLECTIVES = native.extension.collectives()
_NATIVE_FAMILIES = {"blocks": "blocks", "vector": "vector", "vector_pairs": "vector",
                    "peer": "peer"}


def define(spec):
    """Make and register the primitive(s) of a spec; returns the spec.

    The spec must match its row in the extension's table (name, family, root,
    reduction), so the two lists of collectives cannot drift apart.
    """
    row = _NATIVE_COLLECTIVES.get(spec.name)
    if row is None:
        raise AssertionError(f"mpicoll: the extension has no collective {spec.name!r}")
    if (_NATIVE_FAMILIES[row["family"]] != spec.family or bool(row["reduces"]) != spec.reduces
            or bool(row["rooted"]) != spec.has_root):
        raise AssertionError(f"mpicoll: the spec of {spec.name} disagrees with the "
                             f"extension's row {row}")
    assert spec.name not in SPECS, f"{spec.name} is defined twice"
    SPECS[spec.name] = spec
    single = _single_array_primitive(spec)
    spec.owns(single, _fused_primitive(spec, single) if spec.family == "blocks" else None)
    return spec


def reduction_tangent(name, op, x, selected, t, summed, gathered, own_row):
    """The derivative of a reduction with the non-linear op (min, max, prod) over
    some participants, linear in the tangent t: summed(v) sums v over them,
    gathered() stacks every participant's x, own_row() is this participant's
    place in that stack, selected is the min or max (reduce asks for it).  The
    other reductions differentiate op="sum" only.  Shared by the rank-block
    collectives (ops/collectives.py) and the local meeting's allreduce
    (ops/local_meeting.py)."""
    if op in ("min", "max"):
        # Like jnp.max: the selected elements' tangents, ties sharing equally.
        chosen = (x == selected()).astype(t.dtype)
        count = summed(chosen)
        return summed(t * chosen) * jnp.where(count > 0, 1 / jnp.where(count > 0, count, 1), 0)
    if op == "prod":
        # d(prod_p x_p) = sum_p (product of the others' x) * t_p: exact with zeros.
        everyone = gathered()
        own = (jnp.arange(everyone.shape[0]) == own_row()).reshape((-1,) + (1,) * x.ndim)
        others = jnp.prod(jnp.where(own, jnp.ones_like(everyone), everyone), axis=0)
        return summed(others * t)
    raise NotImplementedError(f"mpicoll.{name}: op={op!r} has no derivative")

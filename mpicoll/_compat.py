"""Every private JAX API mpicoll uses, in one place.

JAX's internals move between releases; when one of these breaks, this file is
the only one to change.  Each helper states what it needs from JAX.
"""

import inspect

import jax
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src.interpreters import mlir as _mlir

ShapedArray = _core.ShapedArray
abstract_token = _core.abstract_token
Effect = _effects.Effect
register_lowering = _mlir.register_lowering
_LOWERING_CACHE_OPT_OUT = "cacheable" in inspect.signature(_mlir.register_lowering).parameters


def register_call_site_lowering(primitive, rule, platform):
    """Register a lowering that runs for every call site, never shared between them.

    JAX may lower identical equations of one module once and call that
    function from each; mpicoll's lowering numbers each call site (failures.py:
    first-run checks), so it opts out of that cache where JAX has one.
    """
    if _LOWERING_CACHE_OPT_OUT:
        _mlir.register_lowering(primitive, rule, platform=platform, cacheable=False)
    else:
        _mlir.register_lowering(primitive, rule, platform=platform)

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


def register_ordered_effect(effect_type):
    """Make effect_type an ordered effect JAX threads tokens for, everywhere it may appear.

    Ordered: calls run in program order on every rank (tokens thread through the
    lowering).  Allowed in control flow, custom_vjp/jvp and remat.  Shardable so
    that JAX accepts it on several devices (pmap/shard_map), as io_callback does.
    """
    for effect_set in (
        _effects.ordered_effects,
        _effects.lowerable_effects,
        _effects.control_flow_allowed_effects,
        _effects.custom_derivatives_allowed_effects,
        _effects.remat_allowed_effects,
        _effects.shardable_ordered_effects,
    ):
        effect_set.add_type(effect_type)


def reset_effect_tokens():
    """Forget the runtime tokens of ordered effects (the last one may carry an error).

    On a GPU a failed program's error surfaces when its outputs are read, and the
    ordering token it produced carries the same error into every later program
    with the effect; a fresh token ends that.
    """
    _dispatch.runtime_tokens.clear()


def aval_with_shape(aval, shape):
    """aval with a new shape, keeping dtype, weak type and how it varies over manual axes.

    Inside shard_map a per-device collective's output varies over the mesh axes
    exactly as its input does (device k's result is its own).
    """
    return aval.update(shape=tuple(shape))


def at_top_level():
    """True outside every JAX trace (jit, grad, vmap, ...): values are concrete."""
    return _core.trace_state_clean()


def create_token():
    """A fresh token for a custom call that needs no ordering (synchronous eager calls)."""
    return _mlir.create_token()


def apply_primitive(primitive, *args, **params):
    """Eager evaluation of a primitive: JAX compiles it once per signature and caches it."""
    return _dispatch.apply_primitive(primitive, *args, **params)


def token_in(ctx, effect):
    """The ordering token flowing into this lowering for effect."""
    return ctx.tokens_in.get(effect)


def set_token_out(ctx, effect, token):
    """Pass the custom call's output token on to the next effectful operation."""
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({effect: token})))


def with_token_avals(ctx):
    """The lowering context as seen by a custom call taking and returning a token first."""
    return ctx.replace(avals_in=[abstract_token, *ctx.avals_in],
                       avals_out=[abstract_token, *ctx.avals_out])


# --- transformations --------------------------------------------------------
from jax._src import ad_util as _ad_util  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import batching as _batching  # noqa: E402

Zero = _ad_util.Zero
is_undefined_primal = _ad.is_undefined_primal


def zero_tangent(aval):
    """A symbolic zero tangent/cotangent for a value of abstract type aval."""
    return Zero(aval.to_tangent_aval())


def register_jvp(primitive, rule):
    """rule(primals, tangents, **params) -> (primal_out, tangent_out)."""
    _ad.primitive_jvps[primitive] = rule


def register_transpose(primitive, rule):
    """rule(cotangent, *undefined_primals, **params) -> list of cotangents."""
    _ad.primitive_transposes[primitive] = rule


def transpose_rule(primitive):
    """The transpose rule registered for primitive."""
    return _ad.primitive_transposes[primitive]


def register_batching(primitive, rule):
    """rule(args, batch_dims, **params) -> (out, out_batch_dim); called when some arg is batched."""
    def batcher(axis_data, args, dims, **params):
        del axis_data
        if all(d is None for d in dims):
            out = primitive.bind(*args, **params)
            return out, ([None] * len(out) if primitive.multiple_results else None)
        return rule(args, dims, **params)
    _batching.fancy_primitive_batchers[primitive] = batcher


# --- collectives over manual mesh axes (pmap / shard_map) -------------------
from jax._src import config as _config  # noqa: E402
from jax._src.lax import parallel as _parallel  # noqa: E402


def check_vma_enabled():
    """True inside shard_map(check_vma=True): values are typed invariant/varying over axes.

    pmap traces as shard_map(check_vma=False), where psum transposes to psum.
    """
    return bool(_config._check_vma.value)


def axis_in_manual_mesh(name):
    """True where `name` is a manual mesh axis of the trace and values are typed
    invariant/varying (shard_map with check_vma=True)."""
    return check_vma_enabled() and name in getattr(_mesh.get_abstract_mesh(), "manual_axes", ())


def varying_axes(aval):
    """The manual mesh axes over which a value varies (its `vma`)."""
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def with_varying_axes(aval, axes):
    """aval typed as varying over exactly `axes`."""
    axes = frozenset(axes)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return aval.update(manual_axis_type=mat.update(varying=axes))
    return aval.update(vma=axes)


def route_pvary_transpose(axis, transpose_over_axis):
    """Make the transpose of JAX's own pvary over `axis` call transpose_over_axis.

    JAX inserts pvary where an invariant value meets a varying one (a replicated
    parameter times per-device data) and transposes it to psum over the mesh
    axes, which XLA runs among the local devices.  For mpicoll's ranks axis the
    sum is over MPI ranks instead: transpose_over_axis(ct) does that part and
    JAX's rule the other axes.  Other pvary axes are untouched.
    """
    pvary = getattr(_core, "pvary_p", None)
    original = _ad.primitive_transposes.get(pvary)
    if original is None or getattr(original, "_mpicoll_routed", None) == axis:
        return

    def transpose(ct, x, *, axes):
        if axis not in axes:
            return original(ct, x, axes=axes)
        if type(ct) is Zero:
            return [zero_tangent(x.aval)]
        rest = tuple(a for a in axes if a != axis)
        ct = transpose_over_axis(ct)
        return original(ct, x, axes=rest) if rest else [ct]

    transpose._mpicoll_routed = axis
    _ad.primitive_transposes[pvary] = transpose


def refuse_lax_collectives_over(axis, message):
    """Make JAX's own collectives (psum, all_gather, ppermute, axis_index, ...)
    over `axis` raise message.format(name=...) when lowered.

    XLA would run them among this process's devices only, where mpicoll's
    ranks axis (size 1 locally) stands for every MPI rank: a silent no-op.
    The lowering rules of lax.parallel's primitives are wrapped; a call over
    other axes goes to JAX's rule unchanged.
    """
    primitives = [value for value in vars(_parallel).values()
                  if isinstance(value, _core.Primitive)]
    tables = [(None, _mlir._lowerings)] + list(_mlir._platform_specific_lowerings.items())
    for platform, table in tables:
        for primitive in primitives:
            entry = table.get(primitive)
            if entry is None or getattr(entry.rule, "_mpicoll_refuses", None) == axis:
                continue

            def lowering(ctx, *args, original=entry.rule, name=primitive.name, **params):
                axes = params.get("axes", params.get("axis_name", ()))
                if axis == axes or (isinstance(axes, (tuple, list)) and axis in axes):
                    raise ValueError(message.format(name=name))
                return original(ctx, *args, **params)

            lowering._mpicoll_refuses = axis
            _mlir.register_lowering(primitive, lowering, platform=platform,
                                    inline=getattr(entry, "inline", True))


def all_gather_invariant(x, axis_name, *, axis=0, tiled=False):
    """all_gather whose output is typed invariant over axis_name (shard_map check_vma)."""
    legacy = getattr(_parallel, "all_gather_invariant", None)  # up to jax 0.11
    if legacy is not None:
        return legacy(x, axis_name, axis=axis, tiled=tiled)
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")


from jax._src import mesh as _mesh  # noqa: E402


def devices_running_this_trace():
    """How many devices will run the program being traced: inside pmap/shard_map
    the product of the manual mesh axes, else 1 (vmap axes are not devices)."""
    mesh = _mesh.get_abstract_mesh()
    count = 1
    for name in getattr(mesh, "manual_axes", ()):
        count *= mesh.shape[name]
    return count


def install_runtime_token_fast_path():
    """Skip JAX's resharding of an ordered effect's runtime token when it already
    lives on the one device a program runs on.

    Every dispatch of a program with an ordered effect (every jitted function
    with an mpicoll collective) asks JAX for the effect's token from the last
    program.  JAX device_puts it to a NamedSharding over a Mesh it builds anew
    each time, even when the token is already on that device: measured here,
    two thirds of the ~0.9 ms a one-device dispatch of such a program took.
    For one device the result is the token as it is, so it is returned
    directly; everything else goes to JAX's own method.  Returns False (and
    changes nothing) where JAX's token set does not look as expected.
    """
    token_set = getattr(_dispatch, "RuntimeTokenSet", None)
    original = getattr(token_set, "get_token_input", None)
    if original is None or getattr(original, "_mpicoll_fast_path", False):
        return original is not None
    if list(inspect.signature(original).parameters) != ["self", "eff", "devices"]:
        return False

    def get_token_input(self, eff, devices):
        token = self.current_tokens.get(eff)
        if type(token) is _core.Token and len(devices) == 1:
            sharding = getattr(token._buf, "sharding", None)
            if sharding is not None and sharding._device_assignment == (devices[0],):
                return token
        return original(self, eff, devices)

    get_token_input._mpicoll_fast_path = True
    get_token_input.jax_original = original  # for benchmarks/dispatch.py's comparison
    token_set.get_token_input = get_token_input
    return True


def runtime_token_methods():
    """(JAX's get_token_input, mpicoll's fast one or None): for benchmarks."""
    current = _dispatch.RuntimeTokenSet.get_token_input
    return getattr(current, "jax_original", current), (
        current if getattr(current, "_mpicoll_fast_path", False) else None)


def complete_dispatches_with(effect_type):
    """Make every dispatch of a program with an ordered effect of effect_type wait
    until the program has finished before it returns to Python.

    JAX hands each such program's output token to its RuntimeTokenSet
    (set_token_result) right after dispatching it; waiting on that token there
    makes the dispatch synchronous.  Returns False (and changes nothing) where
    JAX's token set does not look as expected.
    """
    token_set = getattr(_dispatch, "RuntimeTokenSet", None)
    original = getattr(token_set, "set_token_result", None)
    if original is None or getattr(original, "_mpicoll_waits_for", None) is effect_type:
        return original is not None
    if list(inspect.signature(original).parameters) != ["self", "eff", "token"]:
        return False

    def set_token_result(self, eff, token):
        original(self, eff, token)
        if isinstance(eff, effect_type):
            token.block_until_ready()

    set_token_result._mpicoll_waits_for = effect_type
    token_set.set_token_result = set_token_result
    return True



# --- dispatch of one-device CPU programs without runtime tokens ---------------
import re  # noqa: E402
import weakref  # noqa: E402

import numpy as _np  # noqa: E402

from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax._src.interpreters import pxla as _pxla  # noqa: E402
from jax._src import sharding_impls as _sharding_impls  # noqa: E402

_IN_MODULE_LOWERING_PARAMETERS = ["closed_jaxpr", "num_devices", "platforms"]


def _lowering_argument_positions():
    """Where pxla._cached_lowering_to_hlo takes closed_jaxpr, num_devices and platforms,
    read from pxla's source (the function is a C++ cache with no signature); None
    where any is missing or passed otherwise than by position."""
    try:
        source = inspect.getsource(_pxla)
    except (OSError, TypeError):
        return None
    match = re.search(r"^def _cached_lowering_to_hlo\((.*?)\):", source, re.M | re.S)
    if match is None:
        return None
    names = [re.split(r"[:=]", part)[0].strip()
             for part in re.sub(r"\[[^\]]*\]", "", match.group(1)).split(",")]
    positions = {name: names.index(name) for name in _IN_MODULE_LOWERING_PARAMETERS
                 if name in names}
    call = re.search(r"= _cached_lowering_to_hlo\((.*?)\)\n", source, re.S)
    if len(positions) < len(_IN_MODULE_LOWERING_PARAMETERS) or call is None:
        return None
    # pxla's call must pass these three by position (the hook reads them so).
    if any(f"{name}=" in call.group(1) for name in _IN_MODULE_LOWERING_PARAMETERS):
        return None
    return positions


# A jaxpr with its constants: core.ClosedJaxpr up to jax 0.11; from jax 0.12 a
# core.Jaxpr carries its constants itself (ClosedJaxpr is gone).
_CLOSED_JAXPR_TYPE = getattr(_core, "ClosedJaxpr", _core.Jaxpr)


def _closed_jaxpr(jaxpr, consts):
    """jaxpr (constants as constvars) closed over consts, in this JAX's form."""
    if _CLOSED_JAXPR_TYPE is not _core.Jaxpr:
        return _CLOSED_JAXPR_TYPE(jaxpr, consts)
    return _core.Jaxpr(jaxpr, consts=list(consts))


class DeviceOrderDispatch:
    """Programs on one CPU device order their MPI calls by the device's queue, not by
    JAX's runtime tokens, so that JAX dispatches them on its C++ fast path.

    Why it is safe: XLA's CPU client runs the single-device executions of one device
    in the order they were enqueued (each waits for the device's last enqueued
    execution), and every program's custom calls run in program order (JAX still
    threads the effect's token through the program; the token now starts inside
    the module instead of coming from the previous program).  Programs on several
    devices (pmap, shard_map) keep runtime tokens; they only wait for earlier
    multi-device programs, so a fence orders them against single-device ones in
    both directions (fence_multi_device_token, fence_after_multi_device_token).

    `active` is read when a program is lowered (a compiled program keeps the way
    it was lowered) and when a multi-device program is dispatched.
    """

    def __init__(self, effect_type):
        self.effect_type = effect_type
        self.active = False
        self.installed = False
        self._wrapped = weakref.WeakKeyDictionary()  # closed jaxpr -> its in-module form
        self._in_module_call = None
        self._fence = None

    # The token of effect_type created inside the module: an equation wrapping the
    # whole program, whose own effects leave effect_type out.
    def _make_in_module_call(self):
        primitive = _core.Primitive("mpicoll_in_module_token")
        primitive.multiple_results = True
        effect_type = self.effect_type

        def abstract_eval(*avals, jaxpr):
            effects = {e for e in jaxpr.effects if not isinstance(e, effect_type)}
            return jaxpr.out_avals, effects

        def lowering(ctx, *args, jaxpr):
            own = [e for e in _effects.ordered_effects.filter_in(jaxpr.effects)
                   if isinstance(e, effect_type)]
            outer = dict(ctx.tokens_in.items())
            tokens = _mlir.TokenSet({**outer, **{e: _mlir.create_token() for e in own}})
            outs, tokens_out = _mlir.jaxpr_subcomp(
                ctx.module_context, jaxpr.jaxpr, ctx.name_stack, tokens, (), *args,
                dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering,
                outer_traceback=None)
            # The last custom call has a side effect: XLA keeps it without its token.
            ctx.set_tokens_out(_mlir.TokenSet({e: tokens_out.get(e) for e in outer}))
            return outs

        primitive.def_effectful_abstract_eval(abstract_eval)
        _mlir.register_lowering(primitive, lowering)
        return primitive

    def in_module_form(self, closed_jaxpr):
        """closed_jaxpr as one equation whose effect_type token starts inside it."""
        wrapped = self._wrapped.get(closed_jaxpr)
        if wrapped is None:
            jaxpr = closed_jaxpr.jaxpr
            inner = _closed_jaxpr(_pe.convert_constvars_jaxpr(jaxpr), ())
            outvars = [_core.Var(aval) for aval in closed_jaxpr.out_avals]
            effects = {e for e in jaxpr.effects if not isinstance(e, self.effect_type)}
            equation = _core.new_jaxpr_eqn([*jaxpr.constvars, *jaxpr.invars], outvars,
                                           self._in_module_call, dict(jaxpr=inner), effects)
            outer = _core.Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, [equation], effects,
                                jaxpr.debug_info)
            wrapped = _closed_jaxpr(outer, closed_jaxpr.consts)
            self._wrapped[closed_jaxpr] = wrapped
        return wrapped

    def _applies(self, closed_jaxpr, num_devices, platforms):
        return (self.active and num_devices == 1 and tuple(platforms) == ("cpu",)
                and any(isinstance(e, self.effect_type) for e in closed_jaxpr.effects))

    def install(self):
        """Hook JAX's lowering and runtime tokens; False (nothing changed) where JAX's
        internals are not as expected."""
        if self.installed:
            return True
        original = getattr(_pxla, "_cached_lowering_to_hlo", None)
        token_set = getattr(_dispatch, "RuntimeTokenSet", None)
        positions = _lowering_argument_positions()
        if (original is None or token_set is None or positions is None
                or not hasattr(_mlir, "jaxpr_subcomp") or not hasattr(_mlir, "TokenSet")
                or not hasattr(_pe, "convert_constvars_jaxpr")
                or "outer_traceback" not in inspect.signature(_mlir.jaxpr_subcomp).parameters
                or not all(hasattr(_mesh, name) for name in (
                    "empty_concrete_mesh", "empty_abstract_mesh", "use_abstract_mesh"))
                or not hasattr(_sharding_impls, "_internal_use_concrete_mesh")):
            return False
        get_token_input = token_set.get_token_input
        set_token_result = token_set.set_token_result
        block_until_ready = getattr(token_set, "block_until_ready", None)
        if block_until_ready is None:
            return False
        if (list(inspect.signature(get_token_input).parameters) != ["self", "eff", "devices"]
                or list(inspect.signature(set_token_result).parameters)
                != ["self", "eff", "token"]):
            return False
        self._in_module_call = self._make_in_module_call()
        dispatch_order = self
        jaxpr_at, devices_at, platforms_at = (positions[name]
                                              for name in _IN_MODULE_LOWERING_PARAMETERS)

        def cached_lowering_to_hlo(*args, **kwargs):
            if len(args) > max(jaxpr_at, devices_at, platforms_at):
                closed_jaxpr = args[jaxpr_at]
                if (isinstance(closed_jaxpr, _CLOSED_JAXPR_TYPE)
                        and type(args[devices_at]) is int
                        and isinstance(args[platforms_at], tuple)
                        and dispatch_order._applies(closed_jaxpr, args[devices_at],
                                                    args[platforms_at])):
                    try:
                        wrapped = dispatch_order.in_module_form(closed_jaxpr)
                    except (TypeError, AttributeError):  # JAX's jaxpr classes changed:
                        wrapped = closed_jaxpr            # this program keeps its tokens
                    args = list(args)
                    args[jaxpr_at] = wrapped
            return original(*args, **kwargs)

        def fenced_get_token_input(self, eff, devices):
            token = get_token_input(self, eff, devices)
            if dispatch_order.active and len(devices) > 1 and isinstance(
                    eff, dispatch_order.effect_type):
                token = dispatch_order.fence_multi_device_token(token)
            return token

        def fenced_set_token_result(self, eff, token):
            set_token_result(self, eff, token)
            if dispatch_order.active and isinstance(eff, dispatch_order.effect_type):
                dispatch_order.fence_after_multi_device_token(token)

        def fenced_block_until_ready(self):
            # jax.effects_barrier(): programs without runtime tokens are done too.
            if dispatch_order.active:
                dispatch_order.wait_for_cpu_devices()
            block_until_ready(self)

        cached_lowering_to_hlo.jax_original = original
        _pxla._cached_lowering_to_hlo = cached_lowering_to_hlo
        # get_token_input is looked up on the class at each call: later patches
        # (install_runtime_token_fast_path) wrap this one and keep it.
        token_set.get_token_input = fenced_get_token_input
        token_set.set_token_result = fenced_set_token_result
        token_set.block_until_ready = fenced_block_until_ready
        self.installed = True
        return True

    def _fence_on(self, shard):
        """A single-device execution on shard's device that reads shard: it runs after
        the device's earlier executions and after shard is ready, and later
        single-device executions there wait for it."""
        if self._fence is None:
            self._fence = jax.jit(lambda t: t | t)
        # A multi-device program may be dispatched inside shard_map's mesh, which
        # jit would check the fence's one device against; and effects_barrier()
        # may be called while a function is traced (a rejected call compares
        # notes first), where the fence must still run, not be traced.
        with _sharding_impls._internal_use_concrete_mesh(_mesh.empty_concrete_mesh), \
                _mesh.use_abstract_mesh(_mesh.empty_abstract_mesh), \
                jax.ensure_compile_time_eval():
            return self._fence(shard)

    @staticmethod
    def _on_cpu_devices(array):
        """A token over several CPU devices (GPU programs keep JAX's tokens alone)."""
        devices = array.sharding.device_set
        return len(devices) > 1 and all(d.platform == "cpu" for d in devices)

    def _refit(self, token, shards):
        array = token._buf
        return _core.Token(jax.make_array_from_single_device_arrays(
            array.shape, array.sharding, shards))

    def fence_multi_device_token(self, token):
        """The token input of a multi-device program, ready only once every single-device
        program enqueued before it on its devices has run."""
        array = token._buf
        if not self._on_cpu_devices(array):
            return token
        return self._refit(token, [self._fence_on(s.data) for s in array.addressable_shards])

    def fence_after_multi_device_token(self, token):
        """After a multi-device program: on each of its devices, an execution that waits
        for its token, so that later single-device programs wait for it too."""
        array = getattr(token, "_buf", None)
        if array is None or not self._on_cpu_devices(array):
            return
        for shard in array.addressable_shards:
            self._fence_on(shard.data)

    def wait_for_cpu_devices(self):
        """Wait until every program enqueued so far on this process's CPU devices has run."""
        try:
            devices = jax.local_devices(backend="cpu")
        except RuntimeError:  # no CPU backend
            return
        with jax.ensure_compile_time_eval():  # also when called while tracing
            fences = [self._fence_on(jax.device_put(_np.zeros(0, bool), device))
                      for device in devices]
        for fence in fences:
            fence.block_until_ready()

    def lowers_in_module(self, closed_jaxpr, num_devices=1, platforms=("cpu",)):
        """For tests: whether a program would be lowered with its token inside."""
        return self._applies(closed_jaxpr, num_devices, platforms)

"""JAX's dispatch internals that mpicoll hooks: runtime tokens and the lowering of programs.

The policy that uses them (when a program's MPI token starts inside it, the
fences between single- and multi-device programs) is mpicoll's own, in
primitive/device_order.py; here is only what touches JAX's private dispatch machinery,
each hook feature-detected: it returns False and changes nothing where JAX's
internals are not as expected.
"""

import collections
import inspect
import re
import weakref

import jax
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import mesh as _mesh
from jax._src import sharding_impls as _sharding_impls
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters import pxla as _pxla


# JAX's own functions that mpicoll replaced, by (owner, name), recorded by the first
# replacement: later ones wrap whatever is there (mpicoll's own), so this is the one
# place that still knows JAX's (benchmarks compare against it).
_jax_originals = {}


_fast_path_installed = False


def _replace(owner, name, replacement):
    """owner.name = replacement, JAX's function kept in _jax_originals."""
    _jax_originals.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, replacement)


def install_runtime_token_fast_path(max_ahead):
    """Hand a program the last program's runtime token as it is, instead of JAX's copy
    of it, when the token already lives on the program's devices.

    Every dispatch of a program with an ordered effect (every jitted function
    with an mpicoll collective in "tokens" mode, and every one over several
    devices) asks JAX for the effect's token from the last program.  JAX
    device_puts it to a NamedSharding over a Mesh it builds anew each time, and
    for a token that device_put WAITS for the last program to finish and makes
    fresh empty buffers: measured here, two thirds of a one-device dispatch
    (~0.9 ms), and over several devices every dispatch waited for the program
    before it (so a shard_map step could never be dispatched ahead).

    Here the token on the same devices is returned as it is (in another order of
    the same CPU devices, its shards are regrouped without a copy; over several
    GPUs JAX's method stays, as no machine here has two): each device's
    part of the next program then waits, in XLA's runtime, for that device's
    part of the last one, and Python dispatches on.  Over several devices no
    more than `max_ahead` such programs are left in flight: XLA's CPU client
    admits 32 executions per device and makes a pool thread WAIT for a free
    slot, and a multi-device program needs a pool thread for each of its
    devices at once; with the pool as small as the device count (XLA sizes it
    max(cores, devices)), threads waiting for slots starve the executions that
    would free them (seen as a deadlock at 2 x 2 on 2 cores).  Everything else
    goes to JAX's own method.  Returns False (and changes nothing) where JAX's
    token set does not look as expected.
    """
    global _fast_path_installed
    token_set = getattr(_dispatch, "RuntimeTokenSet", None)
    original = getattr(token_set, "get_token_input", None)
    if original is None or _fast_path_installed:
        return original is not None
    if list(inspect.signature(original).parameters) != ["self", "eff", "devices"]:
        return False
    shardings = {}  # devices -> the sharding JAX gives a token over them

    def regrouped(array, devices):
        """`array`'s shards as a token over `devices` (the same set), or None."""
        by_device = {shard.device: shard.data for shard in array.addressable_shards}
        if set(by_device) != set(devices):
            return None
        sharding = shardings.get(devices)
        if sharding is None:
            sharding = shardings[devices] = jax.sharding.NamedSharding(
                jax.sharding.Mesh(list(devices), "x"), jax.sharding.PartitionSpec("x"))
        return _core.Token(jax.make_array_from_single_device_arrays(
            array.shape, sharding, [by_device[d] for d in devices]))

    def get_token_input(self, eff, devices):
        token = self.current_tokens.get(eff)
        array = getattr(token, "_buf", None) if type(token) is _core.Token else None
        held = getattr(getattr(array, "sharding", None), "_device_assignment", None)
        if held is None:
            return original(self, eff, devices)
        devices = tuple(devices)
        if len(devices) == 1:
            return token if held == devices else original(self, eff, devices)
        if any(d.platform != "cpu" for d in devices):  # several GPUs: not measured
            return original(self, eff, devices)
        if held != devices:
            token = regrouped(array, devices) if set(held) == set(devices) else None
            if token is None:
                return original(self, eff, devices)
        in_flight = self.__dict__.setdefault("mpicoll_in_flight", collections.deque())
        in_flight.append(token)
        if len(in_flight) > max_ahead:
            in_flight.popleft().block_until_ready()
        self.current_tokens[eff] = token
        return token

    _replace(token_set, "get_token_input", get_token_input)
    _fast_path_installed = True
    return True


def runtime_token_methods():
    """(JAX's own get_token_input, the one in place now: mpicoll's hooks around its
    fast path, or JAX's where mpicoll changed nothing): for benchmarks/dispatch.py,
    which swaps JAX's in for its comparison and puts the current one back."""
    token_set = _dispatch.RuntimeTokenSet
    current = token_set.get_token_input
    return _jax_originals.get((token_set, "get_token_input"), current), current


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


# --- programs whose ordering token starts inside them ---------------------------
_IN_MODULE_LOWERING_PARAMETERS = ["closed_jaxpr", "num_devices", "platforms"]


# Where pxla._cached_lowering_to_hlo takes (closed_jaxpr, num_devices, platforms),
# per jax line mpicoll's hook was checked against: the function is a C++ cache
# with no signature to inspect, so each line's positions were read from its
# pxla.py (0.10.2 and 0.12.0.1, which CI runs; 0.11.2, the GPU machine's), and
# at import the installed source is checked to say the same.  A line not in the
# table, or a source that disagrees with it, is a missing hook: import warns,
# naming it, the dispatch falls back to runtime tokens, and tests/test_install.py
# fails.
LOWERING_POSITIONS = {
    (0, 10): {"closed_jaxpr": 0, "num_devices": 9, "platforms": 15},
    (0, 11): {"closed_jaxpr": 0, "num_devices": 10, "platforms": 16},
    (0, 12): {"closed_jaxpr": 0, "num_devices": 10, "platforms": 16},
}


def jax_line():
    """(major, minor) of the installed jax."""
    return tuple(int(part) for part in jax.__version__.split(".")[:2])


def _lowering_argument_positions():
    """Where pxla._cached_lowering_to_hlo takes closed_jaxpr, num_devices and
    platforms on this jax: LOWERING_POSITIONS's entry for its line, where the
    installed source agrees; None for a line the table lacks, or a source that
    says otherwise."""
    known = LOWERING_POSITIONS.get(jax_line())
    if known is None or _positions_in_source() != known:
        return None
    return known


def _positions_in_source():
    """The positions as pxla's source has them (the check of the table), or None
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


class InModuleToken:
    """Rewrites a program so that the token of effect_type starts inside its module.

    The whole program becomes one equation whose own effects leave effect_type
    out, so JAX gives it no runtime token for that effect (and dispatches it on
    its C++ fast path); the equation's lowering creates the token and threads
    it through the program's calls in program order as before.
    """

    def __init__(self, effect_type):
        self.effect_type = effect_type
        self._wrapped = weakref.WeakKeyDictionary()  # closed jaxpr -> its in-module form
        self._primitive = None

    @staticmethod
    def available():
        """Whether this JAX has what the rewrite and the lowering hook need."""
        return (_lowering_argument_positions() is not None
                and getattr(_pxla, "_cached_lowering_to_hlo", None) is not None
                and hasattr(_mlir, "jaxpr_subcomp") and hasattr(_mlir, "TokenSet")
                and hasattr(_pe, "convert_constvars_jaxpr")
                and "outer_traceback" in inspect.signature(_mlir.jaxpr_subcomp).parameters)

    def _make_primitive(self):
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

    def form(self, closed_jaxpr):
        """closed_jaxpr as one equation whose effect_type token starts inside it."""
        wrapped = self._wrapped.get(closed_jaxpr)
        if wrapped is None:
            if self._primitive is None:
                self._primitive = self._make_primitive()
            jaxpr = closed_jaxpr.jaxpr
            inner = _closed_jaxpr(_pe.convert_constvars_jaxpr(jaxpr), ())
            outvars = [_core.Var(aval) for aval in closed_jaxpr.out_avals]
            effects = {e for e in jaxpr.effects if not isinstance(e, self.effect_type)}
            equation = _core.new_jaxpr_eqn([*jaxpr.constvars, *jaxpr.invars], outvars,
                                           self._primitive, dict(jaxpr=inner), effects)
            outer = _core.Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, [equation], effects,
                                jaxpr.debug_info)
            wrapped = _closed_jaxpr(outer, closed_jaxpr.consts)
            self._wrapped[closed_jaxpr] = wrapped
        return wrapped


def hook_program_lowering(rewrite):
    """Lower every program as rewrite(closed_jaxpr, num_devices, platforms) says: a jaxpr
    to lower instead, or None to lower it as it is.  False (nothing changed) where
    JAX's lowering function is not as expected."""
    original = getattr(_pxla, "_cached_lowering_to_hlo", None)
    positions = _lowering_argument_positions()
    if original is None or positions is None:
        return False
    jaxpr_at, devices_at, platforms_at = (positions[name]
                                          for name in _IN_MODULE_LOWERING_PARAMETERS)

    def cached_lowering_to_hlo(*args, **kwargs):
        if len(args) > max(jaxpr_at, devices_at, platforms_at):
            closed_jaxpr = args[jaxpr_at]
            if (isinstance(closed_jaxpr, _CLOSED_JAXPR_TYPE)
                    and type(args[devices_at]) is int
                    and isinstance(args[platforms_at], tuple)):
                try:
                    replacement = rewrite(closed_jaxpr, args[devices_at], args[platforms_at])
                except (TypeError, AttributeError):  # JAX's jaxpr classes changed:
                    replacement = None                # this program keeps its tokens
                if replacement is not None:
                    args = list(args)
                    args[jaxpr_at] = replacement
        return original(*args, **kwargs)

    cached_lowering_to_hlo.jax_original = original
    _pxla._cached_lowering_to_hlo = cached_lowering_to_hlo
    return True


def missing_hooks():
    """What of JAX's internals the device-order dispatch hooks into is not as this
    module expects, named ([] where everything is): checked at install, so a JAX
    that changed them is said at import (primitive/device_order.py), and
    tests/test_install.py fails on it."""
    missing = []
    if getattr(_pxla, "_cached_lowering_to_hlo", None) is None \
            or _lowering_argument_positions() is None:
        checked = ", ".join(f"{major}.{minor}" for major, minor in sorted(LOWERING_POSITIONS))
        missing.append("pxla._cached_lowering_to_hlo(closed_jaxpr, ..., num_devices, ..., "
                       "platforms, ...) at the positions mpicoll checked for jax "
                       f"{checked}, called with them by position")
    if not (hasattr(_mlir, "jaxpr_subcomp") and hasattr(_mlir, "TokenSet")
            and "outer_traceback" in inspect.signature(_mlir.jaxpr_subcomp).parameters):
        missing.append("mlir.jaxpr_subcomp(..., outer_traceback=) and mlir.TokenSet")
    if not hasattr(_pe, "convert_constvars_jaxpr"):
        missing.append("partial_eval.convert_constvars_jaxpr")
    if not runtime_token_hooks_available():
        missing.append("dispatch.RuntimeTokenSet.get_token_input(eff, devices), "
                       "set_token_result(eff, token), block_until_ready()")
    if not outside_meshes_available():
        missing.append("mesh.empty_concrete_mesh, empty_abstract_mesh, use_abstract_mesh, "
                       "sharding_impls._internal_use_concrete_mesh")
    return missing


def runtime_token_hooks_available():
    """Whether JAX's RuntimeTokenSet has the three methods hook_runtime_tokens wraps."""
    token_set = getattr(_dispatch, "RuntimeTokenSet", None)
    return (token_set is not None and hasattr(token_set, "block_until_ready")
            and list(inspect.signature(token_set.get_token_input).parameters)
            == ["self", "eff", "devices"]
            and list(inspect.signature(token_set.set_token_result).parameters)
            == ["self", "eff", "token"])


def hook_runtime_tokens(token_input, after_token_result, before_barrier):
    """Wrap JAX's runtime tokens of ordered effects:
    token_input(eff, devices, token) -> the token a program on `devices` gets;
    after_token_result(eff, token) runs after a program hands back its token;
    before_barrier() runs first in jax.effects_barrier()."""
    if not runtime_token_hooks_available():
        return False
    token_set = _dispatch.RuntimeTokenSet
    get_token_input = token_set.get_token_input
    set_token_result = token_set.set_token_result
    block_until_ready = token_set.block_until_ready

    def hooked_get_token_input(self, eff, devices):
        return token_input(eff, devices, get_token_input(self, eff, devices))

    def hooked_set_token_result(self, eff, token):
        set_token_result(self, eff, token)
        after_token_result(eff, token)

    def hooked_block_until_ready(self):
        before_barrier()
        block_until_ready(self)

    # These wrap what is there now: for get_token_input, mpicoll's fast path
    # (install_runtime_token_fast_path, an earlier install step), which wraps JAX's
    # own; the methods are looked up on the class at each call.
    _replace(token_set, "get_token_input", hooked_get_token_input)
    _replace(token_set, "set_token_result", hooked_set_token_result)
    _replace(token_set, "block_until_ready", hooked_block_until_ready)
    return True


def outside_meshes():
    """A context in which jit ignores any mesh of the caller (shard_map's context mesh),
    and runs rather than traces (also when entered while a function is traced)."""
    import contextlib
    stack = contextlib.ExitStack()
    stack.enter_context(_sharding_impls._internal_use_concrete_mesh(_mesh.empty_concrete_mesh))
    stack.enter_context(_mesh.use_abstract_mesh(_mesh.empty_abstract_mesh))
    stack.enter_context(jax.ensure_compile_time_eval())
    return stack


def outside_meshes_available():
    return (all(hasattr(_mesh, name) for name in (
        "empty_concrete_mesh", "empty_abstract_mesh", "use_abstract_mesh"))
        and hasattr(_sharding_impls, "_internal_use_concrete_mesh"))


def token_array(token):
    """The array behind a runtime token (None if it has none)."""
    return getattr(token, "_buf", None)


def token_from_shards(token, shards):
    """A runtime token like `token`, made of the given per-device shards."""
    array = token._buf
    return _core.Token(jax.make_array_from_single_device_arrays(array.shape, array.sharding,
                                                                shards))


# --- errors on jit's C++ fast path ------------------------------------------------
# A program that fails while XLA runs it at dispatch (on CPU, a program under ~1000
# flops whose device is idle runs inline) raises jax.errors.JaxRuntimeError on JAX's
# Python path (a program's first call), but ValueError with the same text from jit's
# C++ fast path (a call from JAX's cache): jaxlib's PjitFunction vectorcall turns a
# failed status into ValueError (jax-ml/jax#34083, up to at least jaxlib 0.10.2).
# A program that runs asynchronously reports the error when its result is read, as
# JaxRuntimeError on both paths.
_STATUS_TEXT = re.compile(
    r"(CANCELLED|UNKNOWN|INVALID_ARGUMENT|DEADLINE_EXCEEDED|NOT_FOUND|ALREADY_EXISTS|"
    r"PERMISSION_DENIED|RESOURCE_EXHAUSTED|FAILED_PRECONDITION|ABORTED|OUT_OF_RANGE|"
    r"UNIMPLEMENTED|INTERNAL|UNAVAILABLE|DATA_LOSS|UNAUTHENTICATED): ")


def runtime_error_from_fast_path(error):
    """The jax.errors.JaxRuntimeError that JAX's Python path raises for what jit's fast
    path raised as `error` (a ValueError whose text is an XLA status, "INTERNAL: ...");
    None for any other error."""
    if type(error) is ValueError and _STATUS_TEXT.match(str(error)):
        return jax.errors.JaxRuntimeError(str(error))
    return None

"""Effects, tokens and lowering registration: the private JAX APIs every primitive needs."""

import inspect

import jax
from jax._src import array as _array
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src.interpreters import mlir as _mlir

ShapedArray = _core.ShapedArray
# The type of a concrete array (never a tracer): `type(x) is ConcreteArray` is the
# cheapest exact test, for the eager calls' cache lookup (primitive/dispatch.py).
ConcreteArray = _array.ArrayImpl
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


def backends_initialized():
    """Whether JAX has created its backends (after which jax.distributed cannot start)."""
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())


def user_source_line(ctx, skip_prefix):
    """"file:line (function)" of the user's code a lowering rule's equation was traced
    at: the first frame JAX counts as user code whose file is not under skip_prefix."""
    return _user_line(getattr(ctx, "traceback", None), skip_prefix)


def lowering_scope(ctx, prefix):
    """The innermost jax.named_scope whose name starts with `prefix` that a lowering
    rule's equation was traced in (its name stack), or None."""
    stack = getattr(getattr(ctx, "name_stack", None), "stack", ())
    for entry in reversed(stack):
        name = getattr(entry, "name", "")
        if type(entry).__name__ == "Scope" and name.startswith(prefix):
            return name
    return None


def current_user_source_line(skip_prefix):
    """user_source_line of the code running now (outside a lowering rule)."""
    from jax._src import source_info_util
    return _user_line(source_info_util.current().traceback, skip_prefix)


def _user_line(traceback, skip_prefix):
    from jax._src import source_info_util
    if traceback is None:
        return None
    for frame in source_info_util.user_frames(traceback):
        if not frame.file_name.startswith(skip_prefix):
            return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    return None


def hide_frames_under(path):
    """Leave frames of files under `path` out of the tracebacks JAX filters (as JAX's own)."""
    from jax._src import traceback_util
    traceback_util.register_exclusion(path)


def api_boundary(function):
    """An exception raised below `function` gets a traceback without the hidden frames
    (JAX's and those of hide_frames_under), as at JAX's own API functions."""
    from jax._src import traceback_util
    return traceback_util.api_boundary(function)

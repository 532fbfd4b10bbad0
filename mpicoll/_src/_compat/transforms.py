"""Registering vmap, JVP and transpose rules (JAX's private rule tables)."""

from jax._src import ad_util as _ad_util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching

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

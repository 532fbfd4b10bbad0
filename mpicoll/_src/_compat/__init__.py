"""Every private JAX API mpicoll uses, in one package.

JAX's internals move between releases; when one of these breaks, this package
is the only place to change.  Each helper states what it needs from JAX.

  core            effects, ordering tokens, lowering registration, eager evaluation
  transforms      vmap, JVP and transpose rule tables
  mesh            manual mesh axes: varying types, JAX's pvary, lax collectives
  dispatch_hooks  runtime tokens and program lowering (the device-order dispatch), and
                  the exception type of errors on jit's C++ fast path
  backends        JAX's CPU backend factory: gloo's listeners on one address
"""

from .core import (  # noqa: F401
    JAX_VERSION, ConcreteArray, Effect, api_boundary, hide_frames_under, ShapedArray, abstract_token, apply_primitive, aval_with_shape,
    backends_initialized,
    at_top_level, create_token, register_call_site_lowering, register_lowering,
    register_ordered_effect, reset_effect_tokens, set_token_out, token_in, user_source_line,
    lowering_scope,
    current_user_source_line,
    with_token_avals)
from .transforms import (  # noqa: F401
    Zero, is_undefined_primal, register_batching, register_jvp, register_transpose,
    transpose_rule, zero_tangent)
from .mesh import (  # noqa: F401
    all_gather_invariant, axis_in_manual_mesh, context_abstract_mesh, context_mesh_set,
    current_mesh_shape,
    is_batched, lower_function, lowering_mesh, no_context_mesh, partitioned_devices,
    manual_mesh_axes, check_vma_enabled, devices_running_this_trace,
    pvary, refuse_lax_collectives_over, route_lax_collectives, size_axis, unrouted_lax,
    varying_axes, with_varying_axes)
from . import dispatch_hooks  # noqa: F401
from .backends import bind_gloo_listeners  # noqa: F401
from .dispatch_hooks import (  # noqa: F401
    complete_dispatches_with, install_runtime_token_fast_path, runtime_error_from_fast_path,
    runtime_token_methods)

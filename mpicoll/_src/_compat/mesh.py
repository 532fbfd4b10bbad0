"""Manual mesh axes (pmap / shard_map): varying types, JAX's pvary, and lax collectives."""

import contextlib
import functools
import threading

import jax
from jax._src import config as _config
from jax._src import core as _core
from jax._src import mesh as _mesh
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.lax import parallel as _parallel



def check_vma_enabled():
    """True inside shard_map(check_vma=True): values are typed invariant/varying over axes.

    pmap traces as shard_map(check_vma=False), where psum transposes to psum.
    """
    return bool(_config._check_vma.value)


def axis_in_manual_mesh(name):
    """True where `name` is a manual mesh axis of the trace and values are typed
    invariant/varying (shard_map with check_vma=True)."""
    return check_vma_enabled() and name in getattr(_mesh.get_abstract_mesh(), "manual_axes", ())


def manual_mesh_axes():
    """The axes of the mesh being traced that are manual here (inside shard_map or pmap)."""
    return tuple(getattr(_mesh.get_abstract_mesh(), "manual_axes", ()))


def current_mesh_shape():
    """(axis names, sizes) of the mesh being traced (the abstract mesh)."""
    mesh = _mesh.get_abstract_mesh()
    return tuple(getattr(mesh, "axis_names", ())), tuple(getattr(mesh, "axis_sizes", ()))


def lowering_mesh(ctx):
    """The concrete mesh a lowering runs under (shard_map under jit), or None."""
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None or isinstance(mesh, _mesh.AbstractMesh):  # its devices come later
        return None
    return mesh if getattr(mesh, "devices", None) is not None else None


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


def route_lax_collectives(route):
    """Give route(primitive_name, args, params) the first word on every bind of
    lax.parallel's primitives (psum, all_gather, ppermute, axis_index, ...).

    It returns the result in the primitive's place, or NotImplemented to let the
    primitive bind as JAX would.  Intercepting bind rather than the public
    functions catches every path to the primitive (jax.lax.pmean, axis_index of
    a tuple, pswapaxes, a name imported before mpicoll) and leaves the
    transforms to the route: a vmapped or differentiated call arrives with
    tracers, before any of JAX's rules for the primitive run.  Returns the
    names of the primitives routed.
    """
    routed = []
    for value in vars(_parallel).values():
        if not isinstance(value, _core.Primitive) or "bind" in vars(value):
            continue

        def bind(*args, primitive=value, original=type(value).bind, **params):
            if _binding_unrouted.active:  # mpicoll's own, over device axes (unrouted_lax)
                return original(primitive, *args, **params)
            out = route(primitive.name, args, params)
            if out is NotImplemented:
                return original(primitive, *args, **params)
            return out

        value.bind = bind
        routed.append(value.name)
    return routed


class _BindingUnrouted(threading.local):
    active = False


_binding_unrouted = _BindingUnrouted()


@contextlib.contextmanager
def _unrouted():
    previous, _binding_unrouted.active = _binding_unrouted.active, True
    try:
        yield
    finally:
        _binding_unrouted.active = previous


class _UnroutedLax:
    """jax.lax with its collectives bound as JAX binds them, never through
    route_lax_collectives' router: what mpicoll itself calls over device axes
    (a process's local devices, or a global mesh JAX runs).  A name of jax.lax
    read here is the same function, called with the router bypassed; the
    bypass is per thread and lasts for the call (a transform JAX applies later,
    a transpose or a batching rule, binds through the router again, which hands
    device axes back to JAX)."""

    def __getattr__(self, name):
        function = getattr(jax.lax, name)

        @functools.wraps(function)
        def unrouted(*args, **kwargs):
            with _unrouted():
                return function(*args, **kwargs)

        setattr(self, name, unrouted)
        return unrouted


unrouted_lax = _UnroutedLax()


def size_axis(name, size):
    """Make the axis environment report size() for the axis `name` of a mesh.

    shard_map binds each mesh axis at its size in the mesh; mpicoll's ranks
    axis is 1 there (this process) but stands for every rank.  JAX reads the
    size of a named axis from the environment for lax.axis_size, psum of a
    constant, pmean's divisor and the shape of all_gather: all of them then
    see the number of ranks.
    """
    original = _core.AxisEnv.axis_size
    if getattr(original, "_mpicoll_sized", None) == name:
        return

    def axis_size(self, axis_name):
        if axis_name == name and axis_name in self.axis_sizes and name in manual_mesh_axes():
            return size()
        return original(self, axis_name)

    axis_size._mpicoll_sized = name
    _core.AxisEnv.axis_size = axis_size


def pvary(x, axes):
    """JAX's own pvary: x typed varying over `axes` too (an identity; its transpose
    is psum over them)."""
    missing = tuple(axis for axis in axes if axis not in varying_axes(jax.typeof(x)))
    return _core.pvary_p.bind(x, axes=missing) if missing else x


def all_gather_invariant(x, axis_name, *, axis=0, tiled=False):
    """all_gather whose output is typed invariant over axis_name (shard_map check_vma)."""
    legacy = getattr(_parallel, "all_gather_invariant", None)  # up to jax 0.11
    with _unrouted():  # called by mpicoll over device axes
        if legacy is not None:
            return legacy(x, axis_name, axis=axis, tiled=tiled)
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")




def devices_running_this_trace():
    """How many devices will run the program being traced: inside pmap/shard_map
    the product of the manual mesh axes, else 1 (vmap axes are not devices)."""
    mesh = _mesh.get_abstract_mesh()
    count = 1
    for name in getattr(mesh, "manual_axes", ()):
        count *= mesh.shape[name]
    return count


_DEVICE_CONTEXT = getattr(_config, "device_context", None)  # jax 0.10's; gone in 0.12


def context_mesh_set():
    """Whether a concrete mesh is in context (jax.set_mesh)."""
    if _DEVICE_CONTEXT is not None and _DEVICE_CONTEXT.value is None:
        return False  # the common case, in 0.1 us where jax has the config entry
    return not _mesh.get_concrete_mesh().empty


class no_context_mesh:
    """A block that compiles and runs without the context mesh: mpicoll's eager
    programs name their own devices (one, or a sharded array's mesh), and under
    jax.set_mesh JAX would otherwise compile them for the context mesh's devices."""

    def __enter__(self):
        self._set = jax.set_mesh(None) if context_mesh_set() else None
        return self

    def __exit__(self, *exc):
        if self._set is not None:
            self._set.__exit__(*exc)


def context_abstract_mesh():
    """The abstract mesh in context while tracing (jax.set_mesh's), or None."""
    mesh = _mesh.get_abstract_mesh()
    return None if mesh.empty else mesh


def partitioned_devices(ctx):
    """How many devices a lowering's program is partitioned over by XLA (outside
    any manual region), or 0 where XLA will not partition it."""
    from jax._src import sharding_impls as _impls
    context = ctx.module_context.axis_context
    if isinstance(context, _impls.ShardingContext) and context.num_devices > 1:
        return context.num_devices
    return 0


def lower_function(ctx, function, *args, multiple_results):
    """Lower function(*args) in place of a primitive (its ordering tokens threaded)."""
    return _mlir.lower_fun(function, multiple_results=multiple_results)(ctx, *args)


def is_batched(x):
    """Whether x is being vmapped (a BatchTracer)."""
    return isinstance(x, _batching.BatchTracer)

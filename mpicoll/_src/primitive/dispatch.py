"""From a call to its primitive: validation agreed across ranks, eager calls, pytree fusion.

`bind` is the one entry of every collective of one array: it resolves the
communicator once, validates identically on every rank, then either runs the
call eagerly (a concrete array outside any trace: a cached one-call program,
completed before returning) or binds the primitive into the trace.
`collective` adds pytrees: small leaves of one dtype travel fused in one MPI
message.
"""

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from .. import _compat
from . import define, varying, validate, sharded
from ..runtime import dtypes, comm as comm_layer, faults
from .device_order import after_pending_programs


def bind(spec, x, *, comm, root=0, op=None, transpose_sums=False, ordered=True, alias=True,
         static=(), overlapped=None, here_once_arrived=False, layout=None):
    """Validate, then run eagerly (a concrete array outside any trace) or bind the primitive.

    comm: an mpi4py communicator, None (the default) or an already resolved
    comm.CommInfo.  ordered=False only for a program that runs synchronously
    with a single MPI call in it (see collective), where no token is needed to
    order it.  overlapped: run on the progress thread; None: as
    mpicoll.overlap() says now (overlapped_now).  here_once_arrived (with
    overlapped): run on XLA's thread where every rank has already arrived, else
    on the progress thread (a sharded array's per-device calls).  Eager calls
    are synchronous whatever they say.
    Point-to-point rejections are not compared across the communicator: only
    two of its ranks take part in a message.
    """
    agree = validate.agreed if spec.family != "peer" else validate.alone
    # An array over several local devices: each moves its shard (point-to-point
    # calls, whose shapes are static arguments, take that path in ops/p2p.py).
    if layout is None and spec.family != "peer":
        layout = sharded.layout_of(x, spec.name)
    if layout is not None:
        return _sharded(spec, x, layout, comm=comm, root=root, op=op,
                        transpose_sums=transpose_sums, static=static)
    if _compat.at_top_level():
        program, x = agree(comm, spec.name, _eager_program_for, spec, x, comm, root, op,
                           transpose_sums, static)
        after_pending_programs()
        return run_eagerly(program, x)
    info = comm_layer.resolve(comm, spec.name)
    x, params = agree(info, spec.name, validate.validated_params, spec, x, info, root, op,
                      transpose_sums, static)
    x, params = varying.typed_input(x, info), varying.typed_params(params)
    _mark_overlapped(params, overlapped_now() if overlapped is None else overlapped,
                     here_once_arrived)
    return spec.primitive.bind(x, **params, ordered=ordered, alias=alias)


def _mark_overlapped(params, overlapped, here_once_arrived):
    """Adds the params of a call run on the progress thread (define.py lowers it to
    the overlapped handler), present only on such calls."""
    if overlapped:
        params["overlapped"] = True
        if here_once_arrived:
            params["here_once_arrived"] = True


def _sharded(spec, x, layout, *, comm, root, op, transpose_sums, static):
    """The collective of an array laid out over several local devices (sharded.py):
    each device's shard, on its own communicator, inside one manual region."""
    info = comm_layer.resolve(comm, spec.name)
    # On CPU no XLA thread waits in MPI for a rank that has not arrived, so the
    # program's own collectives can always rendezvous: a per-device call runs
    # on XLA's thread only once every rank is in it, else on the progress thread.
    call = functools.partial(bind, spec, overlapped=_on_cpu(x), here_once_arrived=True,
                             comm=info, root=root, op=op, transpose_sums=transpose_sums,
                             static=static)
    if not _compat.at_top_level():
        return sharded.run(spec.name, x, layout, call, spec.family)
    key = (spec.name, layout.key(), info.slot, root, op, transpose_sums, static)
    return _run_sharded_eagerly(key, lambda: functools.partial(
        sharded.run, spec.name, layout=layout, call=call, family=spec.family), x)


def _run_sharded_eagerly(key, region, x):
    """A sharded call outside any trace: region() jitted (cached by key), run now,
    after pending programs; outside any context mesh, as the program names its mesh."""
    try:
        program = _SHARDED_PROGRAMS.get(key)
    except TypeError:  # an unhashable op or static argument: not cached
        key, program = None, None
    if program is None:
        program = jax.jit(region())
        if key is not None:
            _SHARDED_PROGRAMS[key] = program
    after_pending_programs()
    return run_eagerly(program, x)


_SHARDED_PROGRAMS = {}


def forget_programs():
    """Drop the cached eager programs (mpicoll.shrink: they name old communicators)."""
    _EAGER_PROGRAMS.clear()
    _SHARDED_PROGRAMS.clear()
    _eager_program.cache_clear()


def on_each_device(fn, args, layout, out_specs):
    """fn(*shards) on each device's shards of args (laid out as `layout`), as one
    manual region; at the top level compiled and run now, after pending programs."""
    region = jax.shard_map(fn, mesh=layout.mesh, in_specs=tuple(layout.spec for _ in args),
                           out_specs=out_specs, check_vma=False)
    if not _compat.at_top_level():
        return region(*args)
    after_pending_programs()
    program = jax.jit(region)
    return run_eagerly(lambda packed: program(*packed), tuple(args))


# mpicoll.overlap() (ops/scheduling.py): whether collectives traced now on this
# thread lower to overlapped handlers, which queue the MPI call on a progress
# thread of their device and return at once (an FFI future).
_overlap = threading.local()


def overlapped_now():
    """Whether collectives traced now on this thread are overlapped."""
    return getattr(_overlap, "enabled", False)


@contextlib.contextmanager
def overlapping(enabled):
    """Collectives traced inside it on this thread are overlapped (enabled) or not."""
    previous = overlapped_now()
    _overlap.enabled = bool(enabled)
    try:
        yield
    finally:
        _overlap.enabled = previous


def per_device_overlap():
    """Whether per-device calls in a manual region run on the progress threads (CPU)."""
    return jax.default_backend() == "cpu"


def _on_cpu(x):
    """Whether x lives on CPU devices (its mesh's, else the default backend's)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    kind = getattr(mesh, "device_kind", None) or getattr(mesh, "_device_kind", None)
    if isinstance(kind, str):
        return kind == "cpu"
    return jax.default_backend() == "cpu"


# Eager calls: one compiled program per (collective, communicator slot, root, op,
# dtype, shape), looked up by the arguments as given, so a repeated call skips
# validation (the key's parts are exactly what the checks depend on).  An
# explicit communicator is still resolved on every call: that is what notices
# it was freed, and a re-registered communicator gets a new slot.
_EAGER_PROGRAMS = {}


def _eager_key(spec, slot, root, op, transpose_sums, x, static):
    """_EAGER_PROGRAMS' key: what the checks depend on (slot None: the default communicator)."""
    return spec.name, slot, root, op, transpose_sums, x.dtype, x.shape, static


def _eager_program_for(spec, x, comm, root, op, transpose_sums, static=()):
    """The program for a call outside any trace (cached), and x as an array.

    The caller runs it synchronously: completing the call before returning
    keeps MPI order across eager calls without JAX's ordered-effect tokens, so
    JAX's C++ dispatch fast path applies (microseconds instead of the Python
    path).  Jitted work that is still pending runs first
    (after_pending_programs), so it cannot be overtaken.
    """
    info = None if comm is None else comm_layer.resolve(comm, spec.name)
    x = validate.as_array(x, spec.name)  # numpy arrays and scalars run the same program
    cacheable = type(root) is int and (op is None or type(op) is str)
    key = (_eager_key(spec, info and info.slot, root, op, transpose_sums, x, static)
           if cacheable else None)
    program = _EAGER_PROGRAMS.get(key)
    if program is None:
        info = info or comm_layer.resolve(None, spec.name)
        x, params = validate.validated_params(spec, x, info, root, op, transpose_sums, static)
        program = _eager_program(spec, tuple(params.items()))
        if cacheable:
            _EAGER_PROGRAMS[key] = program
    return program, x


_PLAIN_ARGUMENTS = frozenset(("comm", "root", "op"))


def _repeated_eager_call(spec, x, kwargs):
    """The cached program of an eager call bind has already run, or None.

    The eager path's common case, a repeated call on one device's concrete array
    with the default communicator, skips bind's layers: each would find what
    the first call found (no layout: one device; at the top level; checks that
    depend only on the key's parts; nothing to resolve), so the lookup is
    _eager_program_for's own key (_eager_key), built straight from the arguments.  Anything
    else (a communicator, a traced or sharded array, a first call) goes
    through bind.
    """
    if (kwargs.get("comm") is not None or not kwargs.keys() <= _PLAIN_ARGUMENTS
            or type(x.sharding) is not SingleDeviceSharding or not _compat.at_top_level()):
        return None
    try:
        return _EAGER_PROGRAMS.get(_eager_key(spec, None, kwargs.get("root", 0),
                                              kwargs.get("op"), False, x, ()))
    except TypeError:  # an unhashable op: never cached
        return None


def run_eagerly(program, x):
    """program(x), completed; a failure raises jax.errors.JaxRuntimeError whichever
    way JAX ran the program.

    A cached program runs on jit's C++ fast path, which raises a failure XLA
    reports at dispatch (an MPI error, a mismatch: the program is small and runs
    inline) as ValueError, where the program's first call raises JaxRuntimeError;
    said here as the first call says it, so that every rank raises the same type
    (the try costs nothing until something is raised).
    """
    try:
        eager = define.lowering_eagerly
        outer, eager.active = eager.active, True  # its call site is not compared (see there)
        try:
            if _compat.context_mesh_set():  # the program names its own devices
                with _compat.no_context_mesh():
                    out = program(x)
            else:
                out = program(x)
        finally:
            eager.active = outer
        if type(out) is _compat.ConcreteArray:
            return out.block_until_ready()
        return jax.block_until_ready(out)
    except ValueError as error:
        runtime_error = _compat.runtime_error_from_fast_path(error)
        if runtime_error is None:
            raise
        lost = faults.as_rank_lost(runtime_error)
        if lost is not None:
            raise lost from runtime_error
        raise runtime_error.with_traceback(error.__traceback__) from None
    except jax.errors.JaxRuntimeError as error:
        lost = faults.as_rank_lost(error)
        if lost is None:
            raise
        raise lost from error


@functools.lru_cache(maxsize=None)
def _eager_program(spec, params):
    return jax.jit(functools.partial(spec.primitive.bind, **dict(params), ordered=False,
                                     alias=False))


# ---------------------------------------------------------------------------
# Pytrees: small leaves of one dtype travel fused in one MPI message (tensor
# fusion), in buckets of at most FUSION_BYTES; a leaf above FUSION_LEAF_BYTES
# goes alone, zero-copy.  Measured in a jitted loop, 2 ranks, 16 float32
# leaves: fused / one call per leaf = 1/2.5 at 4 KiB, 1/3.6 at 16 KiB, 1/1.8
# at 64 KiB, 1/1.2 at 256 KiB, but 1.5 at 1 MiB, where packing costs more
# than the calls it saves.  The result keeps the tree's structure.

FUSION_BYTES = 4 * 1024 * 1024
FUSION_LEAF_BYTES = 256 * 1024


def collective(spec, x, **kwargs):
    """One array -> bind; a pytree -> validated leaves fused per dtype, one call per bucket."""
    if type(x) is _compat.ConcreteArray:
        program = _repeated_eager_call(spec, x, kwargs)
        if program is not None:
            after_pending_programs()
            return run_eagerly(program, x)
    if isinstance(x, jax.Array):  # the common case, without flattening
        return bind(spec, x, **kwargs)
    leaves, treedef = jax.tree.flatten(x)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a single array or scalar
        return bind(spec, leaves[0], **kwargs)
    if not leaves:
        return x
    layouts = [sharded.layout_of(leaf, spec.name) for leaf in leaves]
    laid_out = next((layout for layout in layouts if layout is not None), None)
    if laid_out is not None:
        # A leaf without a layout is replicated over the same devices.
        layouts = [layout or sharded.Layout(laid_out.mesh, (), jnp.ndim(leaf))
                   for leaf, layout in zip(leaves, layouts)]
        return jax.tree.unflatten(treedef, _sharded_leaves(spec, leaves, layouts, **kwargs))
    leaves = _validated_leaves(spec, x, leaves, kwargs)
    if not _compat.at_top_level():  # one program for the tree, its messages in order
        return jax.tree.unflatten(treedef, _traced_leaves(spec, leaves, overlapped_now(), False,
                                                          **kwargs))
    # Eagerly, each message runs like an eager array call: its own cached
    # program, synchronously and without the ordered effect, so JAX dispatches
    # it on its C++ fast path (a program with effects takes its Python path,
    # 1.6 ms instead of 0.45 ms with 100 arrays); completing each before the
    # next keeps the order.  Eager inputs are the caller's arrays: no aliasing.
    program = _fused_program(spec, ordered=False, alias=False, overlapped=False, **kwargs)
    results = [None] * len(leaves)
    after_pending_programs()
    for indices in messages(leaves):
        outs = run_eagerly(program, tuple(leaves[i] for i in indices))
        for i, out in zip(indices, outs):
            results[i] = out
    return jax.tree.unflatten(treedef, results)


def _validated_leaves(spec, x, leaves, kwargs):
    """The leaves as arrays, checked the same on every rank before any MPI call;
    kwargs' comm resolved and op named, in place."""
    leaves = validate.agreed(kwargs["comm"], spec.name, validate.each_leaf, x, leaves,
                             lambda leaf: validate.as_array(leaf, spec.name))
    info = kwargs["comm"] = comm_layer.resolve(kwargs["comm"], spec.name)
    checks = functools.partial(validate.check_leaves, info=info, root=kwargs.get("root", 0),
                               op=kwargs.get("op"))
    validate.agreed(info, spec.name, checks, spec, x, leaves)  # every leaf, before any MPI
    if spec.reduces:
        kwargs["op"] = dtypes.op_name(kwargs["op"], spec.name)
    return leaves


def _traced_leaves(spec, leaves, overlapped, here_once_arrived, **kwargs):
    """Validated leaves' fused messages, traced in order."""
    program = _fused_program(spec, ordered=True, alias=True, overlapped=overlapped,
                             here_once_arrived=here_once_arrived, **kwargs)
    return program(tuple(leaves))


def _sharded_leaves(spec, leaves, layouts, **kwargs):
    """Leaves laid out over a process's devices (sharded.py): one manual region over
    their mesh, in which each device's shards travel fused, as one device's
    leaves do (sharded.tree_region).  Leaves over several meshes, or of a
    collective without a fused form, take a region each."""
    mesh = layouts[0].mesh
    if spec.fused is None or any(layout.mesh != mesh for layout in layouts):
        return [bind(spec, leaf, layout=layout, **kwargs)
                for leaf, layout in zip(leaves, layouts)]
    for leaf, layout in zip(leaves, layouts):
        sharded.check(spec.name, leaf, layout)
    kwargs["comm"] = comm_layer.resolve(kwargs["comm"], spec.name)
    # As for one sharded array (_sharded): no XLA thread waits in MPI for a rank
    # that has not arrived.
    overlapped = _on_cpu(leaves[0])

    def each_device(shards):
        fields = dict(kwargs)
        shards = _validated_leaves(spec, shards, list(shards), fields)
        return _traced_leaves(spec, shards, overlapped, True, **fields)

    def region():
        return sharded.tree_region(spec.name, layouts, each_device, FUSION_LEAF_BYTES)

    if not _compat.at_top_level():
        return region()(tuple(leaves))
    key = (spec.name, tuple(layout.key() for layout in layouts), kwargs["comm"].slot,
           tuple(sorted((name, value) for name, value in kwargs.items() if name != "comm")))
    return _run_sharded_eagerly(key, region, tuple(leaves))


@functools.lru_cache(maxsize=None)
def _fused_program(spec, **kwargs):
    return jax.jit(functools.partial(_fused_leaves, spec, **kwargs))


def messages(leaves):
    """Leaf indices grouped into MPI messages, the same on every rank: a large
    leaf alone, small leaves of one dtype together up to FUSION_BYTES."""
    grouped, open_buckets = [], {}  # open_buckets: dtype -> [indices, bytes]
    for index, leaf in enumerate(leaves):
        nbytes = leaf.size * leaf.dtype.itemsize
        if nbytes > FUSION_LEAF_BYTES:
            grouped.append([index])
            continue
        bucket = open_buckets.get(leaf.dtype)
        if bucket is None or bucket[1] + nbytes > FUSION_BYTES:
            bucket = open_buckets[leaf.dtype] = [[], 0]
            grouped.append(bucket[0])
        bucket[0].append(index)
        bucket[1] += nbytes
    return grouped


def _fused_leaves(spec, leaves, ordered, alias, overlapped, here_once_arrived=False, **kwargs):
    grouped = messages(leaves)
    # Without the ordered effect nothing orders two messages in one program.
    assert ordered or len(grouped) == 1, "an unordered program holds one message"
    results = [None] * len(leaves)
    for indices in grouped:
        if len(indices) == 1:
            results[indices[0]] = bind(spec, leaves[indices[0]], ordered=ordered, alias=alias,
                                       overlapped=overlapped, here_once_arrived=here_once_arrived,
                                       **kwargs)
            continue
        _, params = validate.validated_params(spec, leaves[indices[0]], kwargs["comm"],
                                              kwargs.get("root", 0), kwargs.get("op"), False)
        _mark_overlapped(params, overlapped, here_once_arrived)
        outs = spec.fused.bind(
            *(varying.typed_input(leaves[i], kwargs["comm"]) for i in indices),
            **varying.typed_params(params),
            ordered=ordered, alias=alias)
        for i, out in zip(indices, outs):
            results[i] = out
    return results

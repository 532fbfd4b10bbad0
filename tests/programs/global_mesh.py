"""A global-mesh program on mpicoll's transport:

    python global_mesh.py L REFERENCE.npz --reference R   (one process, R x L devices)
    mpiexec -n R python global_mesh.py L REFERENCE.npz

After mpicoll.distributed.initialize() (the one line that differs from a gloo
program), the bodies of lax_cases.py run inside shard_map over meshes of every
process's devices, with global arrays from make_array_from_process_local_data:
a mesh ("x",) of R x L devices (with L > 1 the axis spans processes and their
devices), and a mesh ("proc", "dev") collecting over ("proc",) and over
("proc", "dev").  The reference is the same program in one process over R x L
devices (JAX's own collectives), run first with --reference.  Values, vjps and
check_vma's types are compared, and the compiled programs are checked to hold no XLA collective
(everything that crossed processes went through mpicoll); the listeners opened since
MPI's own are on loopback in a one-node job and on no wildcard address across hosts.
Prints "ALL OK".
"""

import os
import re
import sys

from _common import fake_cpu_devices, listener_problems, listeners, report_and_exit

LOCAL = int(sys.argv[1])
REFERENCE_FILE = sys.argv[2]
MAKING_REFERENCE = "--reference" in sys.argv
SIZE = int(sys.argv[sys.argv.index("--reference") + 1]) if MAKING_REFERENCE else None
DEVICES_HERE = SIZE * LOCAL if MAKING_REFERENCE else LOCAL
fake_cpu_devices(DEVICES_HERE)
# The large all_gather below in 3 pieces on any machine (by default, only where the
# device threads have cores of their own): a short last piece, and the copies out.
os.environ.setdefault("MPICOLL_GATHER_PIECES", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from lax_cases import CASES, attempt, blocks, check, failures, varying_axes  # noqa: E402

if not MAKING_REFERENCE:
    from mpi4py import MPI  # noqa: E402

    import mpicoll.distributed  # noqa: E402

    MPIS_OWN = listeners()  # MPI_Init's and the launcher's (docs/security.md)
    mpicoll.distributed.initialize(initialization_timeout=60)
    RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    REFERENCE = dict(np.load(REFERENCE_FILE))
else:
    RANK, REFERENCE = 0, {}
jax.config.update("jax_enable_x64", True)
N = SIZE * LOCAL
MINE = slice(RANK * LOCAL, (RANK + 1) * LOCAL) if not MAKING_REFERENCE else slice(0, N)
# (mesh shape, mesh axis names, the axes collected over)
LAYOUTS = [((N,), ("x",), ("x",)),
           ((SIZE, LOCAL), ("proc", "dev"), ("proc",)),
           ((SIZE, LOCAL), ("proc", "dev"), ("proc", "dev")),
           # the participants device-major: the handler's rows reordered around the call
           ((SIZE, LOCAL), ("proc", "dev"), ("dev", "proc")),
           # inside each process: its devices meet with no MPI peer
           ((SIZE, LOCAL), ("proc", "dev"), ("dev",))]
if LOCAL % 2 == 0 and LOCAL > 2:
    # axes that take some of each process's devices: groups of them meet apart,
    # inside each process and across processes
    LAYOUTS += [((SIZE, 2, LOCAL // 2), ("proc", "a", "b"), axes)
                for axes in (("b",), ("proc", "b"), ("b", "proc"))]
XLA_COLLECTIVE = re.compile(r"all-reduce|all-gather|all-to-all|collective-permute|"
                            r"reduce-scatter|collective-broadcast")
NO_VJP = ("pmax", "pmin", "all_to_all untiled")  # JAX has none of its own to compare with


def data(shape, seed):
    return np.random.default_rng(seed).normal(size=(N, *shape))


def local_blocks(everyone):
    return everyone[MINE].reshape((-1, *everyone.shape[2:]))


def mine(global_array):
    """This process's blocks of a global array, in device order."""
    shards = sorted(global_array.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def run_case(key, body, block, shape, names, axes):
    everyone = data(blocks(block, N), sum(map(ord, key)))
    count = int(np.prod([shape[names.index(a)] for a in axes]))
    mesh = jax.make_mesh(shape, names)
    spec = P(names)
    as_global = lambda rows: jax.make_array_from_process_local_data(  # noqa: E731
        NamedSharding(mesh, spec), local_blocks(rows))
    x = as_global(everyone)
    typed = []  # check_vma's type of the body's result: the axes it varies over

    def run(x):
        y = body(x, axes, count)
        typed.append(sorted(varying_axes(jax.typeof(y))))
        return y

    program = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec))
    got = mine(program(x))
    if MAKING_REFERENCE:
        REFERENCE[key] = got
        REFERENCE[key + ": type"] = np.array(typed[0], dtype=str)
    else:
        if typed[0] != list(REFERENCE[key + ": type"]):
            failures.append(f"{key}: typed varying over {typed[0]}, JAX's over "
                            f"{list(REFERENCE[key + ': type'])}")
        text = program.lower(x).compile().as_text()
        if XLA_COLLECTIVE.search(text):
            failures.append(f"{key}: an XLA collective is left: {XLA_COLLECTIVE.search(text)[0]}")
        check(key, got, np.concatenate(np.split(REFERENCE[key], N)[MINE]))
    if key.startswith(NO_VJP):
        return
    out_block = REFERENCE[key].shape[0] // N if not MAKING_REFERENCE else got.shape[0] // N
    cotangents = data((out_block, *got.shape[1:]), 7)
    _, pullback = jax.vjp(program, x)
    grad = mine(pullback(as_global(cotangents))[0])
    if MAKING_REFERENCE:
        REFERENCE[key + ": vjp"] = grad
    else:
        check(key + ": vjp", grad, np.concatenate(np.split(REFERENCE[key + ": vjp"], N)[MINE]))


for shape, names, axes in LAYOUTS:
    if LOCAL == 1 and len(shape) == 2:
        continue  # the same as ("x",) with one device per process
    for name, (body, block) in CASES.items():
        if (tuple(axes) != tuple(sorted(axes, key=names.index))
                and ("ppermute" in name or "mix" in name)
                and hasattr(jax._src.config, "raise_on_ppermute_sort_diff")):
            continue  # a JAX that refuses ppermute's axes out of the mesh's order (0.11+)
        key = f"{name} over {axes} of {shape}"
        attempt(key, lambda: run_case(key, body, block, shape, names, axes))

def pbroadcast_against_numpy(shape, names, axes):
    # JAX has no CPU lowering of its own pbroadcast to compare with: numpy's.  Every
    # participant gets the source's block; the vjp sums every cotangent at the source.
    everyone = data((2, 3), 11)
    count = int(np.prod([shape[names.index(a)] for a in axes]))
    mesh = jax.make_mesh(shape, names)
    spec = P(names)
    as_global = lambda rows: jax.make_array_from_process_local_data(  # noqa: E731
        NamedSharding(mesh, spec), local_blocks(rows))
    program = jax.jit(jax.shard_map(lambda x: jax.lax.pbroadcast(x, axes, source=count - 1),
                                    mesh=mesh, in_specs=spec, out_specs=spec))
    # The participant at axis index count - 1, as a device of the mesh (shape order).
    coords = np.stack(np.unravel_index(np.arange(N), shape), axis=1)
    index = np.ravel_multi_index(tuple(coords[:, [names.index(a) for a in axes]].T),
                                 [shape[names.index(a)] for a in axes])
    groups = [tuple(row) for row in coords[:, [j for j, n in enumerate(names) if n not in axes]]]
    source = {g: d for d, g in enumerate(groups) if index[d] == count - 1}
    expected = np.stack([everyone[source[g]] for g in groups])
    check(f"pbroadcast over {axes} of {shape}", mine(program(as_global(everyone))),
          local_blocks(expected))
    cotangents = data((2, 3), 12)
    _, pullback = jax.vjp(program, as_global(everyone))
    sums = {g: cotangents[[d for d in range(N) if groups[d] == g]].sum(0) for g in set(groups)}
    grad = np.stack([sums[g] if index[d] == count - 1 else np.zeros((2, 3))
                     for d, g in enumerate(groups)])
    check(f"pbroadcast over {axes} of {shape}: vjp",
          mine(pullback(as_global(cotangents))[0]), local_blocks(grad))


def a_mesh_not_process_major_is_refused():
    # Devices listed the other way round: every process refuses it when lowering.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("x",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), np.ones(LOCAL))
    program = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh, in_specs=P("x"),
                                    out_specs=P("x")))
    try:
        program.lower(x)
    except ValueError as error:
        if "process-major" not in str(error):
            failures.append(f"not process-major: another error: {error}")
    else:
        failures.append("a mesh whose devices are not process-major was lowered")


def a_local_axis_alone_meets_in_mpicolls_handler():
    # mpicoll.mesh(local_axis) after jax.distributed: a collective over the local
    # axis alone stays inside this process, on mpicoll's handler rather than gloo.
    import mpicoll
    from jax import lax
    mesh = mpicoll.mesh("d")
    mine = data((3,), 5)[MINE]  # (LOCAL, 3): a row per local device
    ring = [(k, (k + 1) % LOCAL) for k in range(LOCAL)]
    bodies = {"psum": (lambda x: lax.psum(x, "d"), np.tile(mine.sum(0), (LOCAL, 1))),
              "pmax": (lambda x: lax.pmax(x, "d"), np.tile(mine.max(0), (LOCAL, 1))),
              "all_gather": (lambda x: lax.all_gather(x, "d").reshape(1, -1),
                             np.tile(mine.reshape(-1), (LOCAL, 1))),
              "ppermute": (lambda x: lax.ppermute(x, "d", ring), np.roll(mine, 1, axis=0))}
    for name, (body, expected) in bodies.items():
        program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        text = program.lower(mine).compile().as_text()
        if XLA_COLLECTIVE.search(text):
            failures.append(f"{name} over mpicoll.mesh's local axis: an XLA collective is left")
        check(f"{name} over mpicoll.mesh's local axis", program(mine), expected)
    # The vjp of a psum: every device's cotangent summed.
    program = jax.jit(jax.shard_map(lambda x: lax.psum(x, "d"), mesh=mesh, in_specs=P("d"),
                                    out_specs=P("d")))
    _, pullback = jax.vjp(program, mine)
    check("psum over mpicoll.mesh's local axis: vjp", pullback(mine)[0],
          np.tile(mine.sum(0), (LOCAL, 1)))


def a_large_all_gather_lands_in_pieces():
    # A block of over 512 KiB per process is gathered in pieces (3, set above),
    # each copied out by the other devices while MPI moves the next
    # (meeting/meeting.cc); rows of an odd length make the pieces unequal.  numpy's
    # gather is the reference.
    everyone = np.random.default_rng(3).normal(size=(N, 100003)).astype(np.float32)
    for shape, names, axes in [((N,), ("x",), ("x",)),
                               ((SIZE, LOCAL), ("proc", "dev"), ("dev", "proc"))]:
        mesh = jax.make_mesh(shape, names)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(names)),
                                                   local_blocks(everyone))
        program = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, axes, tiled=True),
                                        mesh=mesh, in_specs=P(names), out_specs=P(names)))
        # participants in the order of `axes`: device-major when "dev" comes first
        order = np.arange(N).reshape(shape).transpose(
            [names.index(a) for a in axes]).reshape(-1)
        expected = np.tile(everyone[order].reshape(1, -1), (LOCAL, 1))
        for _ in range(3):  # the meeting's buffers and counters, call after call
            check(f"a large all_gather over {axes}", mine(program(x)).reshape(LOCAL, -1),
                  expected)


def a_large_all_to_all_moves_rows_in_place():
    # Rows of 64 KiB and more go to MPI from the devices' inputs and into their
    # outputs, with no packed buffers (meeting/meeting.cc); 16411 float32 rows,
    # one per participant in each device's block.  numpy's exchange is the reference.
    row = 16411
    everyone = np.random.default_rng(4).normal(size=(N, N * row)).astype(np.float32)
    for shape, names, axes in [((N,), ("x",), ("x",)),
                               ((SIZE, LOCAL), ("proc", "dev"), ("dev", "proc"))]:
        mesh = jax.make_mesh(shape, names)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(names)),
                                                   local_blocks(everyone))
        program = jax.jit(jax.shard_map(
            lambda v: jax.lax.all_to_all(v, axes, 0, 0, tiled=True),
            mesh=mesh, in_specs=P(names), out_specs=P(names)))
        order = np.arange(N).reshape(shape).transpose(
            [names.index(a) for a in axes]).reshape(-1)  # device at each axis position
        place = np.argsort(order)
        pieces = everyone.reshape(N, N, row)  # [device, destination position, ...]
        expected = np.stack([pieces[order, place[d]].reshape(-1) for d in range(N)])
        for _ in range(3):
            check(f"a large all_to_all over {axes}", mine(program(x)).reshape(LOCAL, -1),
                  expected[MINE])
        # ppermute of whole 64 KiB blocks the same way: a ring, every device to the
        # next process's devices in reverse order (several rows between a pair of
        # processes), and a swap of the first and last participants (the others
        # get zeros).  ppermute numbers
        # the participants in the mesh's order of the axes, as JAX does.
        blocks = everyone[:, :row]
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(names)),
                                                   local_blocks(blocks))
        to_next = [(i, (i // LOCAL + 1) % SIZE * LOCAL + LOCAL - 1 - i % LOCAL) for i in range(N)]
        for perm in ([(i, (i + 1) % N) for i in range(N)], to_next, [(0, N - 1), (N - 1, 0)]):
            program = jax.jit(jax.shard_map(lambda v, perm=perm: jax.lax.ppermute(v, axes, perm),
                                            mesh=mesh, in_specs=P(names), out_specs=P(names)))
            expected = np.zeros_like(blocks)
            for source, destination in perm:  # devices, the mesh being process-major
                expected[destination] = blocks[source]
            check(f"a large ppermute {perm[:2]}... over {axes}",
                  mine(program(x)).reshape(LOCAL, -1), expected[MINE])


if not MAKING_REFERENCE and SIZE > 1:
    attempt("a mesh not process-major", a_mesh_not_process_major_is_refused)
    if LOCAL > 1:
        attempt("a large all_gather", a_large_all_gather_lands_in_pieces)
        attempt("a large all_to_all", a_large_all_to_all_moves_rows_in_place)
    if LOCAL > 1:
        attempt("a local axis alone", a_local_axis_alone_meets_in_mpicolls_handler)
    for shape, names, axes in LAYOUTS[1:] if LOCAL > 1 else LAYOUTS[:1]:
        attempt(f"pbroadcast over {axes}",
                lambda: pbroadcast_against_numpy(shape, names, axes))

if MAKING_REFERENCE:
    if failures:
        sys.exit("\n".join(failures))
    np.savez(REFERENCE_FILE, **REFERENCE)
else:
    # JAX's coordination service bound where the ranks reach it, gloo's on loopback
    # on one node: never every interface.
    failures.extend(listener_problems(MPIS_OWN))
    report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices, global mesh)")

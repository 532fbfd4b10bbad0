"""Collectives inside pmap and shard_map, run as `mpiexec -n R python devices.py L`.

Each process fakes R*L CPU devices: mpicoll runs over the first L (the local
devices of this rank), and the one-process reference runs lax collectives over
all R*L devices, i.e. the same program on one axis spanning every participant.
Participant p = rank * L + k holds DATA[p].  Prints "ALL OK" when every check
passes; exits non-zero otherwise.
"""

import sys

from _common import Checker, fake_cpu_devices, report_and_exit

LOCAL = int(sys.argv[1])
from mpi4py import MPI  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
PARTICIPANTS = SIZE * LOCAL
fake_cpu_devices(PARTICIPANTS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import mpicoll  # noqa: E402

jax.config.update("jax_enable_x64", True)
MINE = slice(RANK * LOCAL, (RANK + 1) * LOCAL)  # this rank's participants
LOCAL_DEVICES = jax.devices()[:LOCAL]
LOCAL_MESH = Mesh(np.array(LOCAL_DEVICES), ("i",))
GLOBAL_MESH = Mesh(np.array(jax.devices()), ("i",))
failures = []
check = Checker(failures, rtol=1e-12, atol=1e-12)


def data(shape, seed=0, dtype=np.float64):
    """DATA[p] for every participant; identical on every rank."""
    rng = np.random.default_rng(seed)
    return rng.permutation(PARTICIPANTS * int(np.prod(shape))).reshape(
        (PARTICIPANTS, *shape)).astype(dtype) / 8 + 1


def local_pmap(fn):
    return jax.pmap(fn, axis_name="i", devices=LOCAL_DEVICES)


def reference_pmap(fn):
    return jax.pmap(fn, axis_name="i")


def local_shard_map(fn):
    return jax.jit(jax.shard_map(fn, mesh=LOCAL_MESH, in_specs=P("i"), out_specs=P("i")))


def reference_shard_map(fn):
    return jax.jit(jax.shard_map(fn, mesh=GLOBAL_MESH, in_specs=P("i"), out_specs=P("i")))


def squeeze(fn):
    """Per-shard function of shard_map (leading block of 1) from a per-device one."""
    return lambda v: fn(v[0])[None]


# --- per-device collectives: device k of every rank forms one group ------------
X = data((3,))
groups = X.reshape(SIZE, LOCAL, 3)  # [rank, device]
per_device = {
    "allreduce": (lambda v: mpicoll.allreduce(v), lambda g: g.sum(0)),
    "allreduce-max": (lambda v: mpicoll.allreduce(v, "max"), lambda g: g.max(0)),
    "bcast": (lambda v: mpicoll.bcast(v, SIZE - 1), lambda g: g[SIZE - 1]),
    "allgather": (lambda v: mpicoll.allgather(v), lambda g: g),
    "reduce": (lambda v: mpicoll.reduce(v, "sum", SIZE - 1),
               lambda g: g.sum(0) if RANK == SIZE - 1 else 0 * g[0]),
    "gather": (lambda v: mpicoll.gather(v, 0), lambda g: g if RANK == 0 else 0 * g),
}
for name, (fn, expect) in per_device.items():
    expected = np.stack([expect(groups[:, k]) for k in range(LOCAL)])
    check(f"pmap per-device {name}", local_pmap(fn)(X[MINE]), expected)
    check(f"shard_map per-device {name}", local_shard_map(squeeze(fn))(X[MINE]), expected)
A = data((SIZE, 2))  # scatter/alltoall need a leading axis of the communicator size
ablocks = A.reshape(SIZE, LOCAL, SIZE, 2)  # [rank, device, dest rank, :]
check("pmap per-device alltoall", local_pmap(lambda v: mpicoll.alltoall(v))(A[MINE]),
      np.stack([ablocks[:, k, RANK] for k in range(LOCAL)]))
check("pmap per-device scatter", local_pmap(lambda v: mpicoll.scatter(v, 0))(A[MINE]),
      np.stack([ablocks[0, k, RANK] for k in range(LOCAL)]))
check("pmap per-device reduce_scatter", local_pmap(lambda v: mpicoll.reduce_scatter(v))(A[MINE]),
      np.stack([ablocks[:, k, RANK].sum(0) for k in range(LOCAL)]))
check("shard_map per-device scan", local_shard_map(squeeze(mpicoll.scan))(X[MINE]),
      np.stack([groups[:RANK + 1, k].sum(0) for k in range(LOCAL)]))

# Point-to-point per device: a ring over the ranks on each device's communicator,
# with the status of each device's own receive.
LEFT, RIGHT = (RANK - 1) % SIZE, (RANK + 1) % SIZE
ring = local_pmap(lambda v: mpicoll.sendrecv(v, LEFT, RIGHT, sendtag=5, return_status=True))
moved, sources, tags = ring(X[MINE])
check("pmap per-device sendrecv", moved, groups[LEFT])
check("pmap per-device sendrecv status", np.stack([sources, tags], 1),
      np.tile([LEFT, 5], (LOCAL, 1)))
check("shard_map per-device sendrecv",
      local_shard_map(squeeze(lambda v: mpicoll.sendrecv(v, LEFT, RIGHT)))(X[MINE]), groups[LEFT])

# Pytrees: every device thread packs its own fused message at the same time.
Y = data((2, 2), seed=3)
ygroups = Y.reshape(SIZE, LOCAL, 2, 2)
for attempt in range(10):
    tree = local_pmap(lambda v, w: mpicoll.allgather({"v": v, "w": [w, 2 * w]}))(X[MINE], Y[MINE])
    check(f"pmap per-device pytree allgather {attempt}", tree["v"],
          np.stack([groups[:, k] for k in range(LOCAL)]))
    check(f"pmap per-device pytree allgather {attempt} (2nd leaf)", tree["w"][1],
          np.stack([2 * ygroups[:, k] for k in range(LOCAL)]))

# --- global collectives against lax over one axis of all participants ---------
G = data((4, 3), seed=1)
W = data((4, 3), seed=2)  # per-participant weights make the objectives rank-dependent
lax_ops = {
    "allreduce-sum": (lambda v: mpicoll.allreduce(v, axis_name="i"), lambda v: lax.psum(v, "i")),
    "allreduce-max": (lambda v: mpicoll.allreduce(v, "max", axis_name="i"),
                      lambda v: lax.pmax(v, "i")),
    "allgather": (lambda v: mpicoll.allgather(v, axis_name="i"),
                  lambda v: lax.all_gather(v, "i")),
    # bcast's output is one value on every participant, like psum's.
    "bcast": (lambda v: mpicoll.bcast(v, PARTICIPANTS - 1, axis_name="i"),
              lambda v: lax.psum(jnp.where(lax.axis_index("i") == PARTICIPANTS - 1, v, 0), "i")),
}
for name, (ours, theirs) in lax_ops.items():
    check(f"pmap global {name}", local_pmap(ours)(G[MINE]), reference_pmap(theirs)(G)[MINE])
    check(f"shard_map global {name}", local_shard_map(squeeze(ours))(G[MINE]),
          reference_shard_map(squeeze(theirs))(G)[MINE])
    # vmap inside the map: a batch of 4 rows per participant, one collective for all
    check(f"pmap vmap global {name}", local_pmap(jax.vmap(ours))(G[MINE]),
          reference_pmap(jax.vmap(theirs))(G)[MINE])
B = data((PARTICIPANTS, 2), seed=3)
check("pmap global reduce_scatter",
      local_pmap(lambda v: mpicoll.reduce_scatter(v, axis_name="i"))(B[MINE]),
      reference_pmap(lambda v: lax.psum_scatter(v, "i"))(B)[MINE])
check("shard_map global reduce_scatter",
      local_shard_map(squeeze(lambda v: mpicoll.reduce_scatter(v, axis_name="i")))(B[MINE]),
      reference_shard_map(squeeze(lambda v: lax.psum_scatter(v, "i")))(B)[MINE])
check("pmap global reduce_scatter max",
      local_pmap(lambda v: mpicoll.reduce_scatter(v, "max", axis_name="i"))(B[MINE]),
      reference_pmap(lambda v: lax.pmax(v, "i")[lax.axis_index("i")])(B)[MINE])
check("pmap global alltoall", local_pmap(lambda v: mpicoll.alltoall(v, axis_name="i"))(B[MINE]),
      reference_pmap(lambda v: lax.all_to_all(v, "i", 0, 0))(B)[MINE])
check("shard_map global alltoall",
      local_shard_map(squeeze(lambda v: mpicoll.alltoall(v, axis_name="i")))(B[MINE]),
      reference_shard_map(squeeze(lambda v: lax.all_to_all(v, "i", 0, 0)))(B)[MINE])

# Over the local mesh alone (no mpicoll.RANKS axis) reverse mode needs the
# convention: by default it refuses (a replicated w's gradient came out 6 on
# rank 0 and 46 on rank 1, not 52 on both); mpicoll.mesh() below is checked.
try:
    jax.grad(jax.shard_map(lambda w, v: mpicoll.allreduce(jnp.sum(w * v), axis_name="i"),
                           mesh=LOCAL_MESH, in_specs=(P(), P("i")), out_specs=P()))(
        np.ones(3), np.ones((LOCAL, 3)))
    failures.append("reverse mode over the local mesh alone was not refused")
except TypeError as error:
    if "needs to know which values are the same" not in str(error):
        failures.append(f"unexpected refusal: {error}")
mpicoll.set_autodiff("convention")

# Gradients follow the matching lax collective: pmap's convention in pmap,
# shard_map's (check_vma: an invariant value counts once) in shard_map.  In
# shard_map JAX sees only the local axis, so a result that is invariant (psum,
# bcast) and then used in a participant-dependent way is marked with
# mpicoll.pvary (the documented tool), exactly as for per-device collectives;
# all_gather's result is typed varying already and needs nothing.
def weighted(collective, mark=lambda y: y):
    return lambda v, w: jnp.sum(jnp.sin(mark(collective(v))) * w.sum())


def unweighted(collective):
    return lambda v, w: jnp.sum(jnp.sin(collective(v)) * 2.0)


def shard_grad(objective, mesh):
    per_shard = jax.grad(lambda v, w: objective(v[0], w[0]))
    return jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("i"), P("i")),
                                 out_specs=P("i")))


for name, mark in (("allreduce-sum", mpicoll.pvary), ("allgather", lambda y: y),
                   ("bcast", mpicoll.pvary)):
    ours, theirs = lax_ops[name]
    check(f"pmap grad global {name}",
          local_pmap(jax.grad(weighted(ours)))(G[MINE], W[MINE]),
          reference_pmap(jax.grad(weighted(theirs)))(G, W)[MINE])
    check(f"shard_map grad global {name}, invariant use",
          shard_grad(unweighted(ours), LOCAL_MESH)(G[MINE], W[MINE]),
          shard_grad(unweighted(theirs), GLOBAL_MESH)(G, W)[MINE])
    check(f"shard_map grad global {name}, per-participant use",
          shard_grad(weighted(ours, mark), LOCAL_MESH)(G[MINE], W[MINE]),
          shard_grad(weighted(theirs), GLOBAL_MESH)(G, W)[MINE])

check("pmap grad global reduce_scatter",
      local_pmap(jax.grad(lambda v, w: jnp.sum(jnp.sin(mpicoll.reduce_scatter(v, axis_name="i"))
                                                * w.sum())))(B[MINE], W[MINE, 0]),
      reference_pmap(jax.grad(lambda v, w: jnp.sum(jnp.sin(lax.psum_scatter(v, "i"))
                                                   * w.sum())))(B, W[:, 0])[MINE])
check("shard_map grad global reduce_scatter",
      shard_grad(lambda v, w: jnp.sum(jnp.sin(mpicoll.reduce_scatter(v, axis_name="i")) * w.sum()),
                 LOCAL_MESH)(B[MINE], W[MINE, 0]),
      shard_grad(lambda v, w: jnp.sum(jnp.sin(lax.psum_scatter(v, "i")) * w.sum()),
                 GLOBAL_MESH)(B, W[:, 0])[MINE])

# A parameter replicated over every participant (in_specs P()) used with each
# participant's data: JAX sums the local devices' cotangents; mpicoll.pvary adds
# the ranks', giving the one-process gradient (without it: this rank's share).
def replicated_grad(collective, mesh, mark):
    objective = lambda w, v: collective(jnp.sum(jnp.sin(mark(w) * v[0])))  # noqa: E731
    return jax.jit(jax.grad(jax.shard_map(objective, mesh=mesh, in_specs=(P(), P("i")),
                                          out_specs=P())))


W0 = np.linspace(0.5, 1.5, 3)
check("shard_map grad of a replicated parameter, pvary",
      replicated_grad(lambda y: mpicoll.allreduce(y, axis_name="i"), LOCAL_MESH, mpicoll.pvary)(
          W0, G[MINE]),
      replicated_grad(lambda y: lax.psum(y, "i"), GLOBAL_MESH, lambda w: w)(W0, G))

# The same in mpicoll.mesh("i") (typed over the ranks too): no mark needed, JAX
# inserts pvary and its cotangent is summed over every rank and device.
RANKS_MESH = mpicoll.mesh("i", LOCAL_DEVICES)
typed_grad = jax.jit(jax.grad(jax.shard_map(
    lambda w, v: mpicoll.allreduce(jnp.sum(jnp.sin(w * v)), axis_name="i"), mesh=RANKS_MESH,
    in_specs=(P(), P((mpicoll.RANKS, "i"))), out_specs=P())))
check("typed mesh grad of a replicated parameter, no pvary", typed_grad(W0, G[MINE]),
      replicated_grad(lambda y: lax.psum(y, "i"), GLOBAL_MESH, lambda w: w)(W0, G))

# --- concurrent device threads never mix their collectives ---------------------
repeat = local_shard_map(squeeze(lambda v: mpicoll.allreduce(v) * 1.0))
expected = np.stack([groups[:, k].sum(0) for k in range(LOCAL)])
for attempt in range(50):
    check(f"repetition {attempt}", repeat(X[MINE] * 1.0), expected)

report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices)")

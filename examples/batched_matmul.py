"""An 8 x 4096 x 4096 batched matmul split over every device of every rank, timed.

c[i] = a[i] @ b[i] for i < B (float32, B = 8, n = 4096 by default).  The batch
is cut into size * L slices, one per participant (L local devices on each of
`size` ranks, participant p = rank * L + k; B must be divisible by size * L).
Each participant multiplies its slice inside jax.jit(jax.shard_map(...)) over
its rank's local devices, and mpicoll.allgather(..., axis_name='d') gathers
every slice, so every device ends up with the whole (B, n, n) result.

Timed in the same run, each after a warm-up, median of --repeats, always with
block_until_ready():
  distributed   the above on size ranks x L devices (slowest rank per repeat)
  numpy         np.matmul(a, b) on the full batch, on rank 0
  jax 1 device  jax.jit(jnp.matmul) on the full batch on one device of rank 0
While rank 0 runs the single-process references the other ranks sleep (no
busy-waiting MPI call), so the references have the machine to themselves.

Checked: rank 0's gathered result against numpy and against jnp.matmul on one
device (float32 GEMMs sum in different orders: max |diff| <= TOLERANCE = 2e-7 * n,
entries being about sqrt(n) / 12), and every device of every rank holds
bit-identical data.

Memory: each operand is B * n * n * 4 bytes (512 MiB at the default size);
rank 0 holds about ten of those.  For a quick run:  --n 1024  (or MPICOLL_MATMUL_N).

Run:  mpiexec -n 2 python examples/batched_matmul.py [--batch 8] [--n 4096] [--repeats 3]
Each rank fakes 2 local CPU devices unless XLA_FLAGS already sets a count.
"""

import argparse
import hashlib
import os
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--batch", type=int, default=int(os.environ.get("MPICOLL_MATMUL_BATCH", 8)))
parser.add_argument("--n", type=int, default=int(os.environ.get("MPICOLL_MATMUL_N", 4096)))
parser.add_argument("--repeats", type=int, default=int(os.environ.get("MPICOLL_MATMUL_REPEATS", 3)))
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
L = jax.local_device_count()
participants = size * L
B, n = args.batch, args.n
if B % participants:
    raise SystemExit(f"batched_matmul: --batch {B} must be divisible by size * local devices "
                     f"= {size} * {L}")
per = B // participants  # matrices per participant
# Entries of c are sums of n products of numbers in [-0.5, 0.5): about sqrt(n)/12 in size,
# each accurate to a few float32 ulps times sqrt(n) (orders of summation differ).
TOLERANCE = 2e-7 * n  # max |distributed - numpy|


def matrix(which, i):
    """a[i] (which=0) or b[i] (which=1): deterministic, generated on its own."""
    rng = np.random.default_rng([7, which, i])
    return rng.random((n, n), dtype=np.float32) - np.float32(0.5)


def stack(which, indices):
    return np.stack([matrix(which, i) for i in indices])


def idle_wait():
    """Wait for every rank without busy-polling (MPI_Barrier would spin on a core)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def median_time(fn, repeats, synchronize=lambda: None, combine=lambda t: t):
    fn()  # warm-up (compilation, first touch of the output buffers)
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        times.append(combine(time.perf_counter() - start))
    return float(np.median(times)), times


# --- distributed: size ranks x L devices -----------------------------------------
mesh = jax.make_mesh((L,), ("d",))
sharding = NamedSharding(mesh, P("d"))
mine = range(rank * L * per, (rank + 1) * L * per)  # this rank's L slices, device-major
a_mine = jax.device_put(stack(0, mine), sharding)  # (L * per, n, n), device k: per matrices
b_mine = jax.device_put(stack(1, mine), sharding)


def per_device(a, b):
    c = jnp.matmul(a, b)  # (per, n, n): this participant's slice
    everything = mpicoll.allgather(c, axis_name="d")  # (participants, per, n, n)
    return everything.reshape(1, B, n, n)  # one full copy per device


distributed = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("d"), P("d")),
                                    out_specs=P("d"), check_vma=False))
result = {}


def run_distributed():
    result.pop("c", None)  # free the previous output first (it is L * B * n * n floats)
    result["c"] = distributed(a_mine, b_mine).block_until_ready()


t_dist, dist_times = median_time(run_distributed, args.repeats, synchronize=comm.Barrier,
                                 combine=lambda t: comm.allreduce(t, op=MPI.MAX))
del a_mine, b_mine
c_dist = result.pop("c")  # (L, B, n, n) on this rank

# Every device of every rank holds the same bytes.
digests = [hashlib.sha256(np.asarray(shard.data).tobytes()).hexdigest()
           for shard in c_dist.addressable_shards]
all_digests = comm.allgather(digests)
identical = all(d == all_digests[0][0] for ds in all_digests for d in ds)

# --- single-process references on rank 0 ----------------------------------------
if rank == 0:
    c_dist0 = np.asarray(c_dist.addressable_shards[0].data)[0]  # (B, n, n)
    del c_dist
    a_full, b_full = stack(0, range(B)), stack(1, range(B))
    reference = {}

    def run_numpy():
        reference.pop("numpy", None)
        reference["numpy"] = np.matmul(a_full, b_full)

    t_numpy, numpy_times = median_time(run_numpy, args.repeats)
    c_numpy = reference.pop("numpy")

    device = jax.local_devices()[0]
    a_dev, b_dev = jax.device_put(a_full, device), jax.device_put(b_full, device)
    matmul = jax.jit(jnp.matmul)

    def run_jax():
        reference.pop("jax", None)
        reference["jax"] = matmul(a_dev, b_dev).block_until_ready()

    t_jax, jax_times = median_time(run_jax, args.repeats)
    c_jax = np.asarray(reference.pop("jax"))
    del a_dev, b_dev

    err_numpy = float(np.max(np.abs(c_dist0 - c_numpy)))
    err_jax = float(np.max(np.abs(c_dist0 - c_jax)))
    ok = bool(identical and err_numpy <= TOLERANCE and err_jax <= TOLERANCE)
    idle_wait()
else:
    del c_dist
    idle_wait()
    ok = identical

all_ok = comm.allreduce(ok, op=MPI.LAND)
if rank == 0:
    flops = 2.0 * B * n ** 3

    def row(name, t, times):
        return (f"  {name:<28} {t:9.4f} s  {flops / t / 1e9:8.1f} GFLOP/s   "
                f"repeats: {', '.join(f'{x:.4f}' for x in times)}")

    print(f"batched_matmul: ({B}, {n}, {n}) @ ({B}, {n}, {n}) float32, "
          f"{size} ranks x {L} devices, median of {args.repeats} after a warm-up\n"
          + row(f"distributed ({size}x{L}) + allgather", t_dist, dist_times) + "\n"
          + row("numpy np.matmul (rank 0)", t_numpy, numpy_times) + "\n"
          + row("jax jnp.matmul (1 device)", t_jax, jax_times) + "\n"
          f"  speedup of distributed: {t_numpy / t_dist:.2f}x vs numpy, "
          f"{t_jax / t_dist:.2f}x vs single-device jax\n"
          f"  max |distributed - numpy| = {err_numpy:.3g}, max |distributed - jax| = "
          f"{err_jax:.3g} (tolerance {TOLERANCE:.3g}); identical on every device: {identical}\n"
          f"batched_matmul: results match numpy: " + ("OK" if all_ok else "MISMATCH"), flush=True)
raise SystemExit(0 if all_ok else 1)

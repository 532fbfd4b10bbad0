"""A batch of small convolutions spread over every device of every rank: vmap + jit + pmap.

JAX's vmap example: out[i] = dot(x[i-1:i+2], w) for x = arange(5), w = [2, 3, 4]
gives [11, 20, 29].  Here a batch of such problems (one of them that exact one)
is split over size * L participants (L local devices on each of `size` ranks):
each participant convolves its rows with jit(vmap(convolve)) inside pmap, and
mpicoll.allgather(..., axis_name='i') collects every participant's rows on
every device, ordered by (rank, device).  Every row is checked against numpy.

Run:  mpiexec -n 2 python examples/convolve.py
Each rank fakes 2 local CPU devices unless XLA_FLAGS already sets a count.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
L = jax.local_device_count()
participants = size * L
ROWS = 3  # problems per participant
BATCH = participants * ROWS


def convolve(x, w):
    return jnp.stack([jnp.dot(x[i - 1:i + 2], w) for i in range(1, x.shape[0] - 1)])


# Every rank builds the same batch; row 0 is the docs example.
xs = np.arange(5, dtype=np.float32) + np.arange(BATCH, dtype=np.float32)[:, None]  # (BATCH, 5)
ws = (np.array([2.0, 3.0, 4.0], dtype=np.float32)
      + 0.5 * np.arange(BATCH, dtype=np.float32)[:, None])  # (BATCH, 3)

# This rank's rows: participant p = rank * L + k gets rows p*ROWS .. p*ROWS + ROWS - 1.
mine = slice(rank * L * ROWS, (rank + 1) * L * ROWS)
xs_mine = xs[mine].reshape(L, ROWS, 5)
ws_mine = ws[mine].reshape(L, ROWS, 3)

batched = jax.jit(jax.vmap(convolve))


def per_device(x, w):
    out = batched(x, w)  # (ROWS, 3): this participant's rows
    everyone = mpicoll.allgather(out, axis_name="i")  # (participants, ROWS, 3)
    return out, everyone.reshape(BATCH, 3)


out_mine, out_all = jax.pmap(per_device, axis_name="i")(xs_mine, ws_mine)
out_mine, out_all = np.asarray(out_mine), np.asarray(out_all)

# Reference: convolve computes a correlation, i.e. np.convolve with w reversed ('valid').
reference = np.stack([np.convolve(x, w[::-1], mode="valid") for x, w in zip(xs, ws)])
explicit = np.array([[x[i - 1:i + 2] @ w for i in range(1, 4)] for x, w in zip(xs, ws)])
assert np.array_equal(reference, explicit)

ok_mine = np.array_equal(out_mine.reshape(L * ROWS, 3), reference[mine])
ok_all = all(np.array_equal(out_all[k], reference) for k in range(L))
ok = bool(ok_mine and ok_all)

lines = [f"[rank {rank}/{size}] participant {rank * L + k} rows "
         f"{(rank * L + k) * ROWS}..{(rank * L + k) * ROWS + ROWS - 1}: {out_mine[k].tolist()}"
         for k in range(L)]
lines.append(f"[rank {rank}/{size}] own rows and all {BATCH} gathered rows match numpy: {ok}")
print("\n".join(lines) + "\n", end="", flush=True)

docs_example = out_all[0][0].tolist()  # row 0: x = arange(5), w = [2, 3, 4]
ok = ok and docs_example == [11.0, 20.0, 29.0]
all_ok = comm.allreduce(ok, op=MPI.LAND)
if rank == 0:
    print(f"convolve: x = arange(5), w = [2, 3, 4] -> {docs_example} (expect [11.0, 20.0, 29.0]); "
          f"{BATCH} rows over {size} ranks x {L} devices; " + ("OK" if all_ok else "MISMATCH"),
          flush=True)
raise SystemExit(0 if all_ok else 1)

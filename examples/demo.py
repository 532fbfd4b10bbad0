"""mpicoll in a jitted function: allreduce, bcast and allgather across MPI ranks.

Run with any number of ranks, e.g.  mpiexec -n 2 python examples/demo.py
(`make demo` does that with the project's venv).  Rank 0 prints what each rank
got and whether it matches the same computation done with numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import mpicoll

rank = MPI.COMM_WORLD.Get_rank()
size = MPI.COMM_WORLD.Get_size()


def local_data(r):
    """What rank r contributes: different on every rank."""
    return np.arange(4, dtype=np.float32) + 10 * r


@jax.jit
def step(x):
    total = mpicoll.allreduce(x)              # sum over ranks, on every rank
    from_last = mpicoll.bcast(x * 2, root=size - 1)  # last rank's x*2, on every rank
    everyone = mpicoll.allgather(x)           # (size, 4): row r is rank r's x
    return total, from_last, everyone


total, from_last, everyone = step(jnp.asarray(local_data(rank)))

all_data = np.stack([local_data(r) for r in range(size)])
expected = (all_data.sum(0), all_data[size - 1] * 2, all_data)
ok = all(np.allclose(got, want) for got, want in zip((total, from_last, everyone), expected))

# Rank 0 prints every rank's lines: ranks printing on their own can have their
# lines interleaved mid-line by the launcher.
report = (f"[rank {rank}/{size}] allreduce(sum) = {np.asarray(total)}\n"
          f"[rank {rank}/{size}] bcast(root={size - 1}) = {np.asarray(from_last)}\n"
          f"[rank {rank}/{size}] allgather = {np.asarray(everyone).tolist()}\n"
          f"[rank {rank}/{size}] matches numpy: {ok}\n")
reports = MPI.COMM_WORLD.gather((report, ok), root=0)
if rank == 0:
    print("".join(text for text, _ in reports), end="")
    all_ok = all(verdict for _, verdict in reports)
    print("demo:", "all ranks match numpy" if all_ok else "MISMATCH on some rank", flush=True)
# Every rank agrees on the verdict, so the exit status reflects all of them.
all_ok = MPI.COMM_WORLD.bcast(all_ok if rank == 0 else None, root=0)
raise SystemExit(0 if all_ok else 1)

"""mpicoll at MPI_THREAD_SERIALIZED, run as `mpiexec -n R python serialized.py L`.

tests/test_thread_level.py runs it with MPI4PY_RC_THREAD_LEVEL=serialized (or
with mpi4py.rc.thread_level set to "serialized" by `--rc`).  With L = 1
local device every rank checks, against numpy on every rank's data: jitted
collectives (one, several in a program, in a fori_loop, a pytree, a ring of
sendrecv), eager calls, and the user's own mpi4py calls interleaved with them
right after each dispatch; that each dispatch of a program with collectives
has completed when it returns (what keeps those mpi4py calls from overlapping
mpicoll's); and a rejection that only one rank makes (compared across ranks
under mpicoll's lock).  Prints "ALL OK" when every check passes.  With L = 2
each rank prints the error the first collective raises ("REFUSED: ...").
"""

import sys

from _common import Checker, fake_cpu_devices

LOCAL = int(sys.argv[1])
fake_cpu_devices(LOCAL)
if "--rc" in sys.argv:  # the level chosen in Python, before mpi4py.MPI is imported
    import mpi4py
    mpi4py.rc.thread_level = "serialized"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
failures = []
check = Checker(failures, rtol=0, atol=0)  # exactly


def data(rank, step=0):
    return np.arange(4, dtype=np.float32) + 10 * rank + 100 * step


def main():
    print(f"rank {RANK}: level {MPI.Query_thread()} mode {mpicoll.thread_mode()}", flush=True)
    assert MPI.Query_thread() == MPI.THREAD_SERIALIZED, MPI.Query_thread()
    assert mpicoll.thread_mode() == "serialized"
    if LOCAL > 1:
        try:
            mpicoll.allreduce(jnp.ones(2))
        except RuntimeError as error:
            print(f"REFUSED: {error}", flush=True)
            return
        raise SystemExit(f"rank {RANK}: {LOCAL} local devices were not refused")

    step = jax.jit(lambda x: (mpicoll.allreduce(x), mpicoll.allgather(x * 2), mpicoll.bcast(x, 0)))
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 5, lambda i, v: mpicoll.allreduce(v) / SIZE, x))
    tree = jax.jit(lambda t: mpicoll.allreduce(t))
    ring = jax.jit(lambda x: mpicoll.sendrecv(x, (RANK - 1) % SIZE, (RANK + 1) % SIZE))
    for i in range(20):
        mine = jnp.asarray(data(RANK, i))
        total, gathered, root = step(mine)
        # The dispatch returned after the program's MPI calls: its outputs are ready.
        if not all(out.is_ready() for out in (total, gathered, root)):
            raise SystemExit(f"rank {RANK}: a dispatch returned before its collectives ran")
        # The user's own MPI calls, right away, on the same communicator's group.
        user_sum = WORLD.allreduce(RANK + i)
        buffer = np.empty(1, np.int64)
        WORLD.Allreduce(np.array([i], np.int64), buffer)
        eager = mpicoll.allgather(mine)
        looped = loop(mine)
        summed = tree({"a": mine, "b": [mine * 3, jnp.int32(RANK)]})
        passed = ring(mine)
        stacked = np.stack([data(r, i) for r in range(SIZE)])
        check("allreduce", total, stacked.sum(0))
        check("allgather", gathered, stacked * 2)
        check("bcast", root, stacked[0])
        check("mpi4py allreduce", user_sum, sum(range(SIZE)) + SIZE * i)
        check("mpi4py Allreduce", buffer, [SIZE * i])
        check("eager allgather", eager, stacked)
        # Step 1 averages the ranks' data; later steps average identical values.
        check("fori_loop allreduce", looped, stacked.sum(0) / SIZE)
        check("pytree a", summed["a"], stacked.sum(0))
        check("pytree b0", summed["b"][0], stacked.sum(0) * 3)
        check("pytree b1", summed["b"][1], sum(range(SIZE)))
        check("sendrecv", passed, stacked[(RANK - 1) % SIZE])

    # A rejection on one rank only: the ranks compare it (compare_call, under
    # mpicoll's lock) and every rank raises the same mismatch.
    if SIZE > 1:
        counts = (1,) * SIZE
        rows = 2 if RANK == 1 else 1
        try:
            mpicoll.gatherv(jnp.ones((rows, 2)), counts)
        except (ValueError, jax.errors.JaxRuntimeError) as error:
            print(f"rank {RANK}: rejected: {type(error).__name__}", flush=True)
            if type(error) is not jax.errors.JaxRuntimeError:
                raise SystemExit(f"rank {RANK}: expected the mismatch on every rank: {error}")
        else:
            raise SystemExit(f"rank {RANK}: the one-rank rejection did not raise")
        check("after the rejection", mpicoll.allreduce(jnp.ones(1)), [SIZE])
    if failures:
        raise SystemExit(f"rank {RANK}: " + "\n".join(failures))
    print(f"rank {RANK}: ALL OK", flush=True)


main()

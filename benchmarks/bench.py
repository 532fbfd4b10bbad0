"""Every mpicoll collective against the MPI floor, mpi4py, mpi4jax and JAX's gloo runtime.

Run (what `make bench` does, after building the C floor library):

    mpiexec -n 2 python benchmarks/bench.py [--quick] [--ops allreduce ...] [--sizes 4 1KiB ...]

For bcast, scatter, reduce, allreduce (sum), gather, allgather, alltoall,
sendrecv (a ring), reduce_scatter (sum) and allreduce_rs_ag (an allreduce
written as reduce_scatter + allgather) on float32, at every size (the input buffer of each rank: 4 B, 64 B, 1 KiB, 16 KiB,
256 KiB, 4 MiB, 64 MiB), in one run:

  c-floor        benchmarks/mpi_floor.c, loaded with ctypes: a C loop of the bare MPI
                 call on the same buffers; bcast, reduce and allreduce in place
                 (MPI_IN_PLACE), as mpicoll is when its input is donated
  mpicoll-jit    jax.jit of lax.fori_loop over k dependent calls, input donated
  mpicoll-eager  k eager calls mpicoll.allreduce(x) on a jax array
  mpi4py         comm.Allreduce(x, out) etc. on numpy buffers (buffer methods,
                 out of place; Bcast is in place by definition)
  mpi4jax-jit,   the same two patterns with mpi4jax, if it imports (else "not
  mpi4jax-eager  available" and why)
  jax-gloo       JAX's own multi-process runtime (jax.distributed + gloo), in child
                 processes (benchmarks/jax_gloo.py): psum, all_gather and
                 all_to_all inside jit(shard_map(fori_loop)); the other ops "n/a"

"Dependent" calls: where the output aliases the input (mpicoll's bcast, reduce,
allreduce) the output is the next input, x <- allreduce(x), and MPI works in
place; otherwise one element of the output is written into the input,
x <- x.at[0].set(out[0]), an O(1) update that makes each call depend on the one
before without copying the whole output back into the loop carry.

Timing: for every (op, size, implementation) a warm-up (which compiles), then k
calls per timed run, k chosen so that a run takes about --target-ms (agreed by
every rank; for a jitted loop also >= 10x one dispatch; k = 1 above 16 MiB
for everyone, see Timer.choose_k); each run starts
after a barrier and counts as the slowest rank's time; time per call = median
over runs / k (15 runs up to 1 MiB, 9 at 4 MiB, 5 at 64 MiB).  Everything that
returns a jax array is blocked on (block_until_ready).

Memory: numpy asks the kernel for transparent huge pages on large arrays
(madvise), XLA does not; where huge pages are "madvise" only (the usual default),
MPI on a 64 MiB numpy buffer can be ~2x faster than on a JAX array, and a fresh
buffer costs far fewer page faults.  So that every implementation works on the
same kind of memory, numpy's madvise is turned off (--numpy-hugepages keeps it).
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 in the environment (glibc >= 2.35) gives
huge pages to every malloc'ed buffer, JAX's included; the header line and
bench.json record it.

Every implementation's result is checked once against numpy (a single call on
fresh input; for reduce and gather the root's result).  Scatter and alltoall
take a (ranks, n) input: n = size / 4 B / ranks, at least 1 (so at 4 B with 2
ranks their input is 8 B; the input_bytes column says so).

Also a pytree: 100 leaves x 1 KiB float32, allreduce as one mpicoll call (fused)
vs 100 calls, eager and jitted, with the C floor of both and mpi4py per leaf.

Writes benchmarks/results/bench.csv, bench.json (with machine information) and
bench.png (matplotlib, if installed), and prints one table per collective
(rank 0).  --figure PATH also writes the allreduce figure used in the README.
Exit status 1 if a correctness guard failed.
"""

import argparse
import csv
import ctypes
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

import jax_gloo  # benchmarks/, next to this script

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FLOOR_SOURCE = HERE / "mpi_floor.c"
KIB, MIB = 1024, 1024 * 1024

OPS = ("bcast", "scatter", "reduce", "allreduce", "gather", "allgather", "alltoall", "sendrecv",
       "reduce_scatter", "allreduce_rs_ag")
OP_CODES = {name: i for i, name in enumerate(OPS)}  # benchmarks/mpi_floor.c's numbering
BLOCK_OPS = ("scatter", "alltoall", "reduce_scatter", "allreduce_rs_ag")  # input (ranks, n)
ROOTED_RESULT_OPS = ("reduce", "gather")  # only the root's result is defined everywhere
IMPLS = ("c-floor", "mpicoll-jit", "mpicoll-eager", "mpi4py", "mpi4jax-jit", "mpi4jax-eager",
         "jax-gloo")
GLOO_OPS = ("allreduce", "allgather", "alltoall")  # what JAX has natively across processes
SIZES = (4, 64, KIB, 16 * KIB, 256 * KIB, 4 * MIB, 64 * MIB)
QUICK_SIZES = (4, 64 * KIB)
PYTREE_LEAVES, PYTREE_LEAF_BYTES = 100, KIB
K_MAX = 20000
ONE_CALL_BYTES = 16 * MIB  # above: one call per timed run

# The CSV's status column: measured, no such collective, cannot run here, raised.
STATUS_OK, STATUS_NA, STATUS_UNAVAILABLE, STATUS_FAILED = "ok", "n/a", "not available", "failed"


# ---------------------------------------------------------------------------
# Arguments


def parse_size(text):
    """'4', '64B', '1KiB', '16K', '4MiB', '64M' -> bytes (binary units)."""
    t = text.strip().lower().replace("ib", "").rstrip("b")
    factor = {"k": KIB, "m": MIB, "g": 1024 * MIB}.get(t[-1:], 1)
    value = int(float(t[:-1] if factor != 1 else t) * factor)
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: a multiple of 4 bytes (float32)")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 sizes (4 B, 64 KiB), 5 runs each, short runs: 20-30 s")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP",
                        help=f"collectives to run (default all: {' '.join(OPS)})")
    parser.add_argument("--sizes", nargs="+", type=parse_size, metavar="SIZE",
                        help="per-rank input sizes, e.g. 4 1KiB 4MiB (default "
                             "4 B, 64 B, 1 KiB, 16 KiB, 256 KiB, 4 MiB, 64 MiB)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                        metavar="IMPL", help=f"implementations (default all: {' '.join(IMPLS)})")
    parser.add_argument("--repeats", type=int, help="timed runs per size (default 15, "
                        "9 at 4 MiB, 5 at 64 MiB; --quick: 5)")
    parser.add_argument("--target-ms", type=float,
                        help="duration of one timed run, sets k (default 20; --quick: 5)")
    parser.add_argument("--no-pytree", action="store_true", help="leave out the pytree case")
    parser.add_argument("--floor-lib", type=Path,
                        help="the compiled benchmarks/mpi_floor.c (default: built next to "
                             "this Python's venv with its MPI compiler wrapper if missing)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS,
                        help="where bench.csv, bench.json and bench.png go "
                             "(default benchmarks/results)")
    parser.add_argument("--figure", type=Path,
                        help="also write the allreduce figure (time and bandwidth) here, "
                             "e.g. docs/bench-allreduce.png")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--numpy-hugepages", action="store_true",
                        help="let numpy madvise huge pages for large arrays (its default): "
                             "c-floor and mpi4py buffers then get huge pages where "
                             "transparent huge pages are 'madvise', JAX's only with "
                             "GLIBC_TUNABLES=glibc.malloc.hugetlb=1")
    parser.add_argument("--gloo-timeout", type=float, default=400,
                        help="seconds the jax-gloo workers may take (default 400)")
    # The jax-gloo phase's worker processes (internal).
    jax_gloo.add_worker_arguments(parser)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES if args.quick else SIZES)
    if args.target_ms is None:
        args.target_ms = 5.0 if args.quick else 20.0
    return args


def repeats_for(args, nbytes):
    if args.repeats:
        return args.repeats
    if args.quick:
        return 5
    return 15 if nbytes <= MIB else 9 if nbytes <= 16 * MIB else 5


# ---------------------------------------------------------------------------
# Inputs and expected outputs (float32 values that sum exactly)


def block_count(op, nbytes, size):
    """Elements per MPI block (the count argument of the MPI call)."""
    elements = nbytes // 4
    return max(1, elements // size) if op in BLOCK_OPS else elements


def make_input(op, rank, size, count, salt=0):
    """Rank `rank`'s input: (count,) or, for scatter/alltoall, (size, count)."""
    pattern = (np.arange(count) % 7).astype(np.float32)
    if op in BLOCK_OPS:
        return np.stack([pattern + np.float32(1 + rank * size + j + salt) for j in range(size)])
    return pattern + np.float32(rank + 1 + salt)


def expected(op, rank, size, count, salt=0):
    """Rank `rank`'s correct output (for reduce and gather, the root's; checked on root)."""
    inputs = [make_input(op, r, size, count, salt) for r in range(size)]
    if op == "bcast":
        return inputs[0]
    if op == "scatter":
        return inputs[0][rank]
    if op in ("reduce", "allreduce"):
        return np.sum(inputs, axis=0, dtype=np.float32)
    if op in ("gather", "allgather"):
        return np.stack(inputs)
    if op == "alltoall":
        return np.stack([inputs[j][rank] for j in range(size)])
    if op == "sendrecv":  # a ring: from rank - 1
        return inputs[(rank - 1) % size]
    if op == "reduce_scatter":
        return np.sum([x[rank] for x in inputs], axis=0, dtype=np.float32)
    if op == "allreduce_rs_ag":
        return np.sum(inputs, axis=0, dtype=np.float32)
    raise ValueError(op)


def checks_result(op, rank):
    """Whether this rank's result is compared with numpy (the root's only for reduce/gather)."""
    return op not in ROOTED_RESULT_OPS or rank == 0


def feed(x, out, in_place):
    """The next input of a dependent loop.

    in_place (the collective's output aliases its input: mpicoll's bcast, reduce and
    allreduce): out itself, so MPI works on one buffer as it would in a user's loop.
    Otherwise x with its first element replaced by out's first: an O(1) update in
    place on the loop carry that makes each call depend on the previous one.  (Using
    out itself would add a full copy per call, out -> carry, to collectives that
    write a new buffer, a cost of the loop and not of the collective.)
    """
    if in_place:
        return out
    return x.at[(0,) * x.ndim].set(out[(0,) * out.ndim])


IN_PLACE = {"mpicoll": ("bcast", "reduce", "allreduce")}  # output aliases the input


# ---------------------------------------------------------------------------
# Timing


class Timer:
    """Barrier-started runs timed as the slowest rank's, k chosen for a target duration.

    `run(k)` performs k calls and returns when they are done.  All ranks agree on
    every measurement (MAX over ranks), so they take the same decisions.
    """

    def __init__(self, barrier, slowest, target_s):
        self.barrier, self.slowest, self.target_s = barrier, slowest, target_s

    def measure(self, run, k):
        self.barrier()
        start = time.perf_counter()
        run(k)
        return self.slowest(time.perf_counter() - start)

    def choose_k(self, run, amortize=True, nbytes=0):
        """After a warm-up call: the number k of calls in one timed run.

        Above ONE_CALL_BYTES, k = 1 for every implementation (a call is long enough,
        and each implementation is then timed the same way, fresh output buffers
        included).  Otherwise k grows from below (2x to 16x a step; each step the
        best of two runs, so one run preempted by another process does not stop the
        growth) until a run lasts the goal: the target, or with amortize (a jitted
        loop: one dispatch per run) at least 10 x a one-call run (capped at 5 x the
        target), so that the fixed cost of a run -- the dispatch of a jitted program,
        which JAX does on its Python path when the program has effects -- adds at
        most ~10% to the time per call.
        """
        run(1)
        if nbytes > ONE_CALL_BYTES:
            return 1
        t = self.measure(run, 1)
        if t < 2 * self.target_s:  # else one call is clearly long enough
            t = min(t, self.measure(run, 1), self.measure(run, 1))
        goal = max(self.target_s, min(10 * t, 5 * self.target_s)) if amortize else self.target_s
        k = 1
        while t < goal and k < K_MAX:
            k = int(min(K_MAX, k * min(16.0, max(2.0, goal / max(t, 1e-9)))))
            t = min(self.measure(run, k) for _ in range(2))
        return k

    def times(self, run, repeats, amortize=True, nbytes=0):
        k = self.choose_k(run, amortize, nbytes)
        return k, [self.measure(run, k) for _ in range(repeats)]


# ---------------------------------------------------------------------------
# Implementations.  Each `setup_*` returns (once, run, timed) for one (op, count):
# once() -> this rank's output of one call on fresh input; run(k) -> k calls, done
# when it returns; timed(repeats, timer) -> (k, times), or None to time run() from
# Python.  Unavailable: the implementation cannot run here (the reason).


class Unavailable(Exception):
    pass


class FloorLibrary:
    """benchmarks/mpi_floor.c through ctypes, on a private duplicate of COMM_WORLD."""

    def __init__(self, path, comm):
        self.lib = ctypes.CDLL(str(path))
        self.fn = self.lib.mpi_floor_run
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                            ctypes.POINTER(ctypes.c_double)]
        self.comm = comm
        self.comm_f = comm.py2f()

    def call(self, op, x, out, count, iters, repeats=0):
        times = (ctypes.c_double * max(1, repeats))()
        rc = self.fn(OP_CODES[op], self.comm_f, x.ctypes.data, out.ctypes.data, count, iters,
                     repeats, times)
        if rc != 0:
            raise RuntimeError(f"mpi_floor_run({op}) returned MPI error {rc}")
        return list(times)[:repeats]


def floor_buffers(op, rank, size, count):
    x = make_input(op, rank, size, count)
    out_shape = {"scatter": (count,), "gather": (size, count), "allgather": (size, count),
                 "alltoall": (size, count), "allreduce_rs_ag": (size, count)}.get(op, (count,))
    out = np.zeros(out_shape, np.float32)
    if op in ("bcast", "reduce", "allreduce"):  # in place, like donated mpicoll
        out[...] = x
    return x, out


def setup_floor(ctx, op, count):
    floor = ctx.floor
    if floor is None:
        raise Unavailable(ctx.floor_reason)

    def once():
        x, out = floor_buffers(op, ctx.rank, ctx.size, count)
        floor.call(op, x, out, count, 1)
        return out

    x, out = floor_buffers(op, ctx.rank, ctx.size, count)

    def run(k):
        floor.call(op, x, out, count, k)

    def timed(repeats, timer):
        # k chosen as for everyone else, but each run timed inside C (MPI_Wtime,
        # barrier first, MAX over ranks): no Python in the loop.
        k = timer.choose_k(run, amortize=False, nbytes=x.nbytes)
        return k, floor.call(op, x, out, count, k, repeats)

    return once, run, timed


def setup_mpi4py(ctx, op, count):
    from mpi4py import MPI
    comm, rank, size = ctx.pycomm, ctx.rank, ctx.size
    root = rank == 0

    def buffers():
        x, out = floor_buffers(op, rank, size, count)
        if op in ("bcast",):
            return x, out
        return x, np.zeros_like(out)

    def caller(x, out):
        if op == "bcast":
            return functools.partial(comm.Bcast, out, 0)
        if op == "scatter":
            return functools.partial(comm.Scatter, x if root else None, out, 0)
        if op == "reduce":
            return functools.partial(comm.Reduce, x, out if root else None, MPI.SUM, 0)
        if op == "allreduce":
            return functools.partial(comm.Allreduce, x, out, MPI.SUM)
        if op == "gather":
            return functools.partial(comm.Gather, x, out if root else None, 0)
        if op == "allgather":
            return functools.partial(comm.Allgather, x, out)
        if op == "sendrecv":
            return functools.partial(comm.Sendrecv, x, (rank + 1) % size, 0, out,
                                     (rank - 1) % size, 0)
        if op == "reduce_scatter":
            return functools.partial(comm.Reduce_scatter_block, x, out, MPI.SUM)
        if op == "allreduce_rs_ag":
            def both():
                comm.Reduce_scatter_block(x, out[rank], MPI.SUM)
                comm.Allgather(MPI.IN_PLACE, out)
            return both
        return functools.partial(comm.Alltoall, x, out)

    def once():
        x, out = buffers()
        caller(x, out)()
        return out

    call = caller(*buffers())

    def run(k):
        for _ in range(k):
            call()

    return once, run, None


def jax_ops(library, comm=None):
    """op name -> function of one jax array, for mpicoll or mpi4jax (which lacks some)."""
    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    if library == "mpicoll":
        import mpicoll
        return {"bcast": mpicoll.bcast, "scatter": mpicoll.scatter, "reduce": mpicoll.reduce,
                "allreduce": mpicoll.allreduce, "gather": mpicoll.gather,
                "allgather": mpicoll.allgather, "alltoall": mpicoll.alltoall,
                "sendrecv": lambda x: mpicoll.sendrecv(x, left, right),
                "reduce_scatter": mpicoll.reduce_scatter,
                "allreduce_rs_ag": lambda x: mpicoll.allgather(mpicoll.reduce_scatter(x))}
    import mpi4jax
    return {"sendrecv": lambda x: mpi4jax.sendrecv(x, x, left, right, comm=comm),
            "bcast": lambda x: mpi4jax.bcast(x, 0, comm=comm),
            "scatter": lambda x: mpi4jax.scatter(x, 0, comm=comm),
            "reduce": lambda x: mpi4jax.reduce(x, MPI.SUM, 0, comm=comm),
            "allreduce": lambda x: mpi4jax.allreduce(x, MPI.SUM, comm=comm),
            "gather": lambda x: mpi4jax.gather(x, 0, comm=comm),
            "allgather": lambda x: mpi4jax.allgather(x, comm=comm),
            "alltoall": lambda x: mpi4jax.alltoall(x, comm=comm)}


def jax_input(library, op, rank, size, count, salt=0):
    x = make_input(op, rank, size, count, salt)
    if library == "mpi4jax" and op == "scatter" and rank != 0:
        x = x[0]  # mpi4jax: only the root passes (size, n)
    return x


def setup_jit(ctx, library, op, count):
    import jax
    fn = ctx.jax_ops[library][op]
    in_place = op in IN_PLACE.get(library, ())
    loop = jax.jit(lambda x, k: jax.lax.fori_loop(0, k, lambda i, v: feed(v, fn(v), in_place), x),
                   donate_argnums=0)
    # One call's output: the loop's with k = 1 when it feeds the output back (one
    # compilation less), else the collective on its own.
    single = (lambda x: loop(x, 1)) if in_place else jax.jit(fn)
    state = [jax.numpy.asarray(jax_input(library, op, ctx.rank, ctx.size, count))]

    def once():
        return np.asarray(single(jax.numpy.asarray(
            jax_input(library, op, ctx.rank, ctx.size, count))).block_until_ready())

    def run(k):
        state[0] = loop(state[0], k)
        state[0].block_until_ready()

    return once, run, None


def setup_eager(ctx, library, op, count):
    import jax
    fn = ctx.jax_ops[library][op]
    x = jax.numpy.asarray(jax_input(library, op, ctx.rank, ctx.size, count))

    def once():
        return np.asarray(fn(jax.numpy.asarray(
            jax_input(library, op, ctx.rank, ctx.size, count))).block_until_ready())

    def run(k):
        out = None
        for _ in range(k):
            out = fn(x)
        out.block_until_ready()
        jax.effects_barrier()

    return once, run, None


def setup(ctx, impl, op, count):
    if impl == "c-floor":
        return setup_floor(ctx, op, count)
    if impl == "mpi4py":
        return setup_mpi4py(ctx, op, count)
    library, mode = impl.split("-")
    if library not in ctx.jax_ops:
        raise Unavailable(ctx.mpi4jax_reason)
    if op not in ctx.jax_ops[library]:
        raise Unavailable(f"{library} has no {op}")
    return (setup_jit if mode == "jit" else setup_eager)(ctx, library, op, count)


# ---------------------------------------------------------------------------
# The MPI phase: everything but jax-gloo, in this process.


class Context:
    pass


def load_floor(args, comm):
    """The C floor library: --floor-lib, else build it (rank 0) next to this venv."""
    path = args.floor_lib
    error = None
    if path is None:
        path = Path(sys.prefix) / "mpi_floor.so"
        if comm.Get_rank() == 0:
            stale = not path.exists() or path.stat().st_mtime < FLOOR_SOURCE.stat().st_mtime
            if stale:
                error = build_floor(path)
        error = comm.bcast(error, root=0)
    if error is None and not Path(path).exists():
        error = f"{path} does not exist (make bench builds it)"
    if error is None:
        try:
            return FloorLibrary(path, comm.Dup()), f"{path}"
        except OSError as e:
            error = f"cannot load {path}: {e}"
    return None, error


def find_mpicc():
    """The MPI compiler wrapper of the MPI mpi4py uses: $MPICC, the one the Makefile chose
    for this venv, the venv's own (PyPI MPI wheel), or mpicc on PATH."""
    choice = Path(sys.prefix) / ".mpicc-choice"
    candidates = [os.environ.get("MPICC"),
                  choice.read_text().strip() if choice.exists() else None,
                  str(Path(sys.prefix) / "bin" / "mpicc"), "mpicc"]
    for candidate in candidates:
        if candidate and (Path(shlex.split(candidate)[0]).exists()
                          or subprocess.run(["sh", "-c", f"command -v {shlex.split(candidate)[0]}"],
                                            capture_output=True).returncode == 0):
            return candidate
    return None


def build_floor(path):
    mpicc = find_mpicc()
    if mpicc is None:
        return "no MPI compiler wrapper (set MPICC) to build benchmarks/mpi_floor.c"
    command = [*shlex.split(mpicc), "-O2", "-fPIC", "-shared", str(FLOOR_SOURCE),
               "-o", str(path)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}"
    return None


def set_numpy_hugepages(enabled):
    """numpy's madvise(MADV_HUGEPAGE) for large arrays on or off; None if not available."""
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover
        from numpy.core import multiarray
    try:
        multiarray._set_madvise_hugepage(bool(enabled))
        return bool(enabled)
    except AttributeError:  # pragma: no cover
        return None


def transparent_hugepages():
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return None


def import_mpi4jax():
    """(True, version) or (False, why not)."""
    try:
        import mpi4jax
        return True, mpi4jax.__version__
    except Exception as error:  # ImportError, or mpi4jax's own checks (RuntimeError)
        reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
        if isinstance(error, ModuleNotFoundError) and error.name == "mpi4jax":
            reason = "not installed (make bench installs it)"
        log = Path(sys.prefix) / "mpi4jax-build.log"
        if log.exists():
            lines = [ln for ln in log.read_text(errors="replace").splitlines()
                     if "error" in ln.lower()]
            if lines:
                reason += f"; build failed ({log}): {lines[-1].strip()[:200]}"
        return False, reason


def check(once, op, ctx, count):
    """This rank's result of one call against numpy; True on every rank if all agree."""
    out = np.asarray(once())
    if checks_result(op, ctx.rank):
        want = expected(op, ctx.rank, ctx.size, count)
        ok = out.shape == want.shape and np.array_equal(out, want)
    else:
        ok = True
    return ok


def run_mpi_phase(args, ctx):
    from mpi4py import MPI
    comm = ctx.comm
    timer = Timer(comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX), args.target_ms / 1e3)
    rows = []
    for op in args.ops:
        for nbytes in args.sizes:
            count = block_count(op, nbytes, ctx.size)
            input_elements = count * (ctx.size if op in BLOCK_OPS else 1)
            for impl in args.impls:
                if impl == "jax-gloo":
                    continue
                row = dict(op=op, impl=impl, bytes=nbytes, input_bytes=4 * input_elements,
                           count=count)

                def measure(impl=impl, op=op, count=count, nbytes=nbytes):
                    once, run, timed = setup(ctx, impl, op, count)
                    ok = comm.allreduce(bool(check(once, op, ctx, count)), op=MPI.LAND)
                    repeats = repeats_for(args, nbytes)
                    k, times = (timed(repeats, timer) if timed else
                                timer.times(run, repeats, amortize=impl.endswith("-jit"),
                                            nbytes=nbytes))
                    return ok, k, times

                rows.append(record(row, measure, ctx))
    return rows


def record(row, measure, ctx):
    """Fill row from measure() -> (correct, k, times); a failure is recorded, the run goes on."""
    started = time.perf_counter()
    try:
        ok, k, times = measure()
        row.update(status=STATUS_OK, correct=ok, k=k, times=times)
    except Unavailable as error:
        row.update(status=STATUS_UNAVAILABLE, note=str(error))
    except Exception as error:
        if ctx.rank == 0:
            traceback.print_exc()
        row.update(status=STATUS_FAILED, note=f"{type(error).__name__}: {error}")
    row["seconds"] = time.perf_counter() - started
    ctx.progress(row)
    return row


# ---------------------------------------------------------------------------
# The pytree case: 100 leaves x 1 KiB, one fused allreduce vs 100 calls.


def run_pytree(args, ctx):
    import jax
    import mpicoll
    from mpi4py import MPI
    comm = ctx.comm
    timer = Timer(comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX), args.target_ms / 1e3)
    count = PYTREE_LEAF_BYTES // 4
    leaves_np = [make_input("allreduce", ctx.rank, ctx.size, count, salt=i)
                 for i in range(PYTREE_LEAVES)]
    want = [expected("allreduce", ctx.rank, ctx.size, count, salt=i)
            for i in range(PYTREE_LEAVES)]
    total_bytes = PYTREE_LEAVES * PYTREE_LEAF_BYTES
    fresh = lambda: [jax.numpy.asarray(a) for a in leaves_np]  # noqa: E731
    fused = mpicoll.allreduce
    per_leaf = lambda tree: [mpicoll.allreduce(leaf) for leaf in tree]  # noqa: E731

    def eager_case(fn):
        tree = fresh()

        def run(k):
            out = None
            for _ in range(k):
                out = fn(tree)
            jax.block_until_ready(out)
        return (lambda: fn(fresh())), run, None

    def jit_case(fn):
        loop = jax.jit(lambda t, k: jax.lax.fori_loop(0, k, lambda i, v: fn(v), t),
                       donate_argnums=0)
        state = [fresh()]

        def run(k):
            state[0] = loop(state[0], k)
            jax.block_until_ready(state[0])
        return (lambda: loop(fresh(), 1)), run, None

    def floor_case(leaves):
        if ctx.floor is None:
            raise Unavailable(ctx.floor_reason)
        n = total_bytes // 4 // leaves
        x = np.ones(n, np.float32)

        def once():
            parts = [leaf.copy() for leaf in leaves_np]
            if leaves == 1:
                buf = np.concatenate(parts)
                ctx.floor.call("allreduce", buf, buf, n, 1)
                return np.split(buf, PYTREE_LEAVES)
            for part in parts:
                ctx.floor.call("allreduce", part, part, n, 1)
            return parts

        def run(k):
            ctx.floor.call("allreduce", x, x, n, k * leaves)

        def timed(repeats, timer):
            k = timer.choose_k(run, amortize=False)
            return k, ctx.floor.call("allreduce", x, x, n, k * leaves, repeats)
        return once, run, timed

    def mpi4py_case():
        pairs = [(a.copy(), np.empty_like(a)) for a in leaves_np]
        calls = [functools.partial(ctx.pycomm.Allreduce, a, b, MPI.SUM) for a, b in pairs]

        def once():
            for call in calls:
                call()
            return [b for _, b in pairs]

        def run(k):
            for _ in range(k):
                for call in calls:
                    call()
        return once, run, None

    builders = {"c-floor/fused": lambda: floor_case(1),
                "c-floor/per-leaf": lambda: floor_case(PYTREE_LEAVES),
                "mpi4py/per-leaf": mpi4py_case,
                "mpicoll-eager/fused": lambda: eager_case(fused),
                "mpicoll-eager/per-leaf": lambda: eager_case(per_leaf),
                "mpicoll-jit/fused": lambda: jit_case(fused),
                "mpicoll-jit/per-leaf": lambda: jit_case(per_leaf)}
    rows = []
    for impl, build in builders.items():
        if impl.split("/")[0] not in args.impls:
            continue
        row = dict(op="allreduce_pytree", impl=impl, bytes=total_bytes, input_bytes=total_bytes,
                   count=count)

        def measure(impl=impl, build=build):
            once, run, timed = build()
            out = once()
            ok = all(np.array_equal(np.asarray(o), w) for o, w in zip(out, want)) \
                and len(out) == len(want)
            ok = comm.allreduce(bool(ok), op=MPI.LAND)
            repeats = repeats_for(args, total_bytes)
            k, times = (timed(repeats, timer) if timed else
                        timer.times(run, repeats, amortize="-jit" in impl))
            return ok, k, times

        rows.append(record(row, measure, ctx))
    return rows


# ---------------------------------------------------------------------------
# The jax-gloo phase: child processes (benchmarks/jax_gloo.py)


def gloo_worker(args):
    jax = jax_gloo.initialize(args)
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    plan = json.loads(args.plan)
    rank, size = args.process_id, args.num_processes
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    steps = {"allreduce": lambda v: jax.lax.psum(v, "d"),
             "allgather": lambda v: jax.lax.all_gather(v, "d"),
             "alltoall": lambda v: jax.lax.all_to_all(v, "d", 0, 0, tiled=True)}

    def slowest(t):
        return float(np.max(multihost_utils.process_allgather(np.float64(t))))

    timer = Timer(lambda: multihost_utils.sync_global_devices("bench"), slowest,
                  plan["target_ms"] / 1e3)
    results = []
    for op, nbytes, repeats in plan["cases"]:
        count = block_count(op, nbytes, size)
        entry = dict(op=op, bytes=nbytes)
        try:
            step = steps[op]
            single = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                           check_vma=False))
            looped = lambda x, k: jax.lax.fori_loop(  # noqa: E731
                0, k, lambda i, v: feed(v, step(v), False), x)
            loop = jax.jit(jax.shard_map(looped, mesh=mesh, in_specs=(P("d"), P()),
                                         out_specs=P("d"), check_vma=False), donate_argnums=0)
            local = make_input(op, rank, size, count)
            out = single(jax.make_array_from_process_local_data(sharding, local))
            got = np.asarray(out.addressable_shards[0].data)
            ok = bool(np.array_equal(got, expected(op, rank, size, count)))
            del out
            state = [jax.make_array_from_process_local_data(sharding, local)]

            def run(k):
                state[0] = loop(state[0], k)
                state[0].block_until_ready()

            k, times = timer.times(run, repeats, nbytes=nbytes)
            entry.update(ok=ok, k=k, times=times)
            state.clear()  # frees the device buffer before the next size
        except Exception as error:
            entry.update(error=f"{type(error).__name__}: {str(error)[:300]}")
        results.append(entry)
    multihost_utils.sync_global_devices("done")
    jax_gloo.emit(dict(jax=jax.__version__, results=results))
    jax_gloo.shutdown()


def run_gloo_phase(args, ctx):
    """jax-gloo rows (rank 0) for the ops JAX has natively; the others are n/a."""
    cases = [(op, nbytes, repeats_for(args, nbytes)) for op in args.ops if op in GLOO_OPS
             for nbytes in args.sizes]
    rows, reports, error = [], None, None
    if cases:
        plan = json.dumps(dict(cases=cases, target_ms=args.target_ms))
        started = time.perf_counter()
        reports, error = jax_gloo.run_workers(ctx.comm, __file__, ["--plan", plan], 1,
                                              timeout=args.gloo_timeout, set_device_count=True,
                                              quiet=True)
        ctx.gloo_seconds = time.perf_counter() - started
    if ctx.rank != 0:
        return []
    if reports:
        ctx.gloo_jax = reports[0]["jax"]
    for op in args.ops:
        for nbytes in args.sizes:
            count = block_count(op, nbytes, ctx.size)
            row = dict(op=op, impl="jax-gloo", bytes=nbytes,
                       input_bytes=4 * count * (ctx.size if op in BLOCK_OPS else 1), count=count)
            if op not in GLOO_OPS:
                row.update(status=STATUS_NA, note="no cross-process equivalent in JAX")
            elif reports is None:
                row.update(status=STATUS_FAILED, note=error)
            else:
                entries = [next(e for e in r["results"] if e["op"] == op and e["bytes"] == nbytes)
                           for r in reports]
                errors = [e["error"] for e in entries if "error" in e]
                if errors:
                    row.update(status=STATUS_FAILED, note=errors[0])
                else:
                    row.update(status=STATUS_OK, correct=all(e["ok"] for e in entries),
                               k=entries[0]["k"],
                               times=jax_gloo.slowest_times([e["times"] for e in entries]))
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# Results: derived numbers, table, CSV, JSON, figures


def finish_rows(rows):
    """Median time per call, ratio to the c-floor, bandwidth."""
    floor = {}
    for row in rows:
        if row["status"] == STATUS_OK:
            row["time_per_call_s"] = float(np.median(row["times"])) / row["k"]
            row["min_time_per_call_s"] = float(np.min(row["times"])) / row["k"]
            row["bandwidth_GBps"] = row["input_bytes"] / row["time_per_call_s"] / 1e9
        if row["impl"] in ("c-floor", "c-floor/fused") and row["status"] == STATUS_OK:
            floor[(row["op"], row["bytes"])] = row["time_per_call_s"]
    for row in rows:
        base = floor.get((row["op"], row["bytes"]))
        if row["status"] == STATUS_OK and base:
            row["ratio_to_floor"] = row["time_per_call_s"] / base
    return rows


def fmt_us(seconds):
    us = seconds * 1e6
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def human(nbytes):
    if nbytes >= MIB and nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    if nbytes >= KIB and nbytes % KIB == 0:
        return f"{nbytes // KIB} KiB"
    return f"{nbytes} B"


def cell(row):
    if row is None:
        return "-"
    if row["status"] != STATUS_OK:
        return {"n/a": "n/a", "not available": "unavail.", "failed": "FAILED"}[row["status"]]
    text = fmt_us(row["time_per_call_s"])
    if not row.get("correct", True):
        text += " WRONG"
    if "ratio_to_floor" in row and not row["impl"].startswith("c-floor"):
        text += f" ({row['ratio_to_floor']:.2f}x)"
    return text


OP_TITLES = {"bcast": "bcast (root 0)", "scatter": "scatter (root 0)",
             "reduce": "reduce (sum, root 0)", "allreduce": "allreduce (sum)",
             "gather": "gather (root 0)", "allgather": "allgather", "alltoall": "alltoall",
             "sendrecv": "sendrecv (ring)", "reduce_scatter": "reduce_scatter (sum)",
             "allreduce_rs_ag": "allreduce_rs_ag (reduce_scatter + allgather)"}


def table(rows, args, size):
    by_key = {(r["op"], r["impl"], r["bytes"]): r for r in rows}
    impls = [i for i in IMPLS if i in args.impls]
    lines = [f"time per call in microseconds (ratio to c-floor); float32, {size} ranks; size = "
             "input buffer per rank; median over runs of the slowest rank"]
    for op in [o for o in OPS if o in args.ops]:
        header = [f"{OP_TITLES[op]:<17}"] + [f"{i:>17}" for i in impls]
        lines += ["", " ".join(header), "-" * len(" ".join(header))]
        for nbytes in args.sizes:
            cells = [f"{human(nbytes):>17}"]
            cells += [f"{cell(by_key.get((op, i, nbytes))):>17}" for i in impls]
            lines.append(" ".join(cells))
    return "\n".join(lines)


def pytree_table(rows):
    rows = [r for r in rows if r["op"] == "allreduce_pytree"]
    if not rows:
        return ""
    by_impl = {r["impl"]: r for r in rows}
    lines = ["", f"pytree allreduce: {PYTREE_LEAVES} leaves x {human(PYTREE_LEAF_BYTES)} float32 "
             "(time per pytree in microseconds, ratio to c-floor/fused)"]
    for impl in by_impl:
        lines.append(f"  {impl:<24} {cell(by_impl[impl]):>20}")
    for mode in ("eager", "jit"):
        f, p = by_impl.get(f"mpicoll-{mode}/fused"), by_impl.get(f"mpicoll-{mode}/per-leaf")
        if f and p and f["status"] == p["status"] == STATUS_OK:
            lines.append(f"  mpicoll-{mode}: one call is {p['time_per_call_s'] / f['time_per_call_s']:.1f}x "
                         f"faster than {PYTREE_LEAVES} calls")
    return "\n".join(lines)


def targets(rows):
    """The project's performance targets (issue 5), evaluated on this run."""
    def t(op, impl, nbytes):
        r = next((r for r in rows if r["op"] == op and r["impl"] == impl and r["bytes"] == nbytes
                  and r["status"] == STATUS_OK), None)
        return r["time_per_call_s"] if r else None

    checks = []

    def ratio(label, a, b, limit, le=True):
        if a is None or b is None:
            return
        value = a / b
        met = value <= limit if le else value >= limit
        checks.append(f"  {'ok  ' if met else 'MISS'} {label}: {value:.2f} "
                      f"({'<=' if le else '>='} {limit})")

    small, big = 4, 64 * MIB
    ratio("allreduce 4 B, mpicoll-eager / mpi4py", t("allreduce", "mpicoll-eager", small),
          t("allreduce", "mpi4py", small), 3)
    ratio("allreduce 4 B, mpicoll-jit / c-floor", t("allreduce", "mpicoll-jit", small),
          t("allreduce", "c-floor", small), 2.5)
    ratio("allreduce 4 B, mpicoll-jit / mpi4jax-jit", t("allreduce", "mpicoll-jit", small),
          t("allreduce", "mpi4jax-jit", small), 0.5)
    ratio("allreduce 64 MiB, mpicoll-jit (donated) / c-floor", t("allreduce", "mpicoll-jit", big),
          t("allreduce", "c-floor", big), 1.15)
    sizes = sorted({r["bytes"] for r in rows if r["op"] == "allreduce"})
    gloo = [(n, t("allreduce", "jax-gloo", n), t("allreduce", "mpicoll-jit", n)) for n in sizes]
    gloo = [(n, g / m) for n, g, m in gloo if g and m]
    if gloo:
        worst = min(gloo, key=lambda p: p[1])
        checks.append(f"  {'ok  ' if worst[1] >= 3 else 'MISS'} allreduce, jax-gloo / mpicoll-jit "
                      f"at every size: min {worst[1]:.2f} at {human(worst[0])} (>= 3)")
    for mode in ("eager", "jit"):
        ratio(f"pytree, mpicoll-{mode} 100 calls / one call",
              t("allreduce_pytree", f"mpicoll-{mode}/per-leaf", 100 * KIB),
              t("allreduce_pytree", f"mpicoll-{mode}/fused", 100 * KIB), 5, le=False)
    for op in OPS:
        if op not in ("allreduce", "sendrecv", "reduce_scatter", "allreduce_rs_ag"):
            ratio(f"{op} 64 MiB, mpicoll-jit / c-floor", t(op, "mpicoll-jit", big),
                  t(op, "c-floor", big), 1.3)
    # issue 14
    ratio("sendrecv 4 B, mpicoll-jit / c-floor", t("sendrecv", "mpicoll-jit", small),
          t("sendrecv", "c-floor", small), 2)
    ratio("reduce_scatter 64 MiB, mpicoll-jit / c-floor", t("reduce_scatter", "mpicoll-jit", big),
          t("reduce_scatter", "c-floor", big), 1.2)
    ratio("allreduce as reduce_scatter + allgather 64 MiB / allreduce, mpicoll-jit",
          t("allreduce_rs_ag", "mpicoll-jit", big), t("allreduce", "mpicoll-jit", big), 1.3)
    return ["", "targets (issues 5, 14):"] + checks if checks else []


CSV_FIELDS = ("op", "impl", "bytes", "input_bytes", "count", "status", "correct",
              "time_per_call_s", "min_time_per_call_s", "ratio_to_floor", "bandwidth_GBps",
              "k", "repeats", "note")


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "repeats": len(row.get("times", [])) or ""})


def plot(rows, args, ops, path, size):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"c-floor": ("black", "-", "o"), "mpicoll-jit": ("tab:blue", "-", "s"),
              "mpicoll-eager": ("tab:blue", "--", "^"), "mpi4py": ("tab:green", "-", "D"),
              "mpi4jax-jit": ("tab:orange", "-", "v"), "mpi4jax-eager": ("tab:orange", "--", "<"),
              "jax-gloo": ("tab:red", "-", "x")}
    fig, axes = plt.subplots(len(ops), 2, figsize=(12, 3.4 * len(ops) + 0.8), squeeze=False)
    for (ax_t, ax_b), op in zip(axes, ops):
        for impl in IMPLS:
            pts = sorted((r["bytes"], r["time_per_call_s"], r["bandwidth_GBps"]) for r in rows
                         if r["op"] == op and r["impl"] == impl and r["status"] == STATUS_OK)
            if not pts:
                continue
            color, ls, marker = styles[impl]
            xs = [p[0] for p in pts]
            ax_t.plot(xs, [p[1] * 1e6 for p in pts], ls, color=color, marker=marker,
                      label=impl, ms=4)
            ax_b.plot(xs, [p[2] for p in pts], ls, color=color, marker=marker, label=impl, ms=4)
        for ax in (ax_t, ax_b):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("input buffer per rank (bytes)")
            ax.grid(True, which="both", alpha=0.3)
            ticks = sorted({r["bytes"] for r in rows if r["op"] == op})
            ax.set_xticks(ticks, [human(b) for b in ticks])
        ax_t.set_ylabel("time per call (µs)")
        ax_b.set_ylabel("input bytes per rank / time (GB/s)")
        ax_t.set_title(f"{OP_TITLES[op]}: time per call")
        ax_b.set_title(f"{OP_TITLES[op]}: bandwidth")
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    top = 1 - 0.7 / fig.get_figheight()  # room for the title and the legend
    fig.suptitle(f"float32, {size} ranks on one {os.cpu_count()}-core machine; median time per "
                 "call of the slowest rank", fontsize=11, y=1 - 0.12 / fig.get_figheight())
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.38 / fig.get_figheight()))
    fig.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info(ctx, load_start):
    import jax
    import jaxlib
    import mpi4py
    import mpicoll
    from mpi4py import MPI
    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    return dict(mpi_library=MPI.Get_library_version().splitlines()[0].strip(),
                mpi4py=mpi4py.__version__, jax=jax.__version__, jaxlib=jaxlib.__version__,
                mpicoll=mpicoll.__version__, numpy=np.__version__,
                mpi4jax=ctx.mpi4jax_version if ctx.mpi4jax_ok else None,
                mpi4jax_unavailable_reason=None if ctx.mpi4jax_ok else ctx.mpi4jax_reason,
                jax_gloo_jax=getattr(ctx, "gloo_jax", None),
                c_floor_library=ctx.floor_path, c_floor_unavailable_reason=ctx.floor_reason,
                python=platform.python_version(), machine=platform.machine(), cpu=cpu,
                cores=os.cpu_count(), ranks=ctx.size, hostname=platform.node(),
                load_average_start=list(load_start), load_average_end=list(os.getloadavg()),
                transparent_hugepages=transparent_hugepages(),
                glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
                numpy_madvise_hugepage=ctx.numpy_hugepages,
                date=time.strftime("%Y-%m-%d %H:%M:%S %z"))


# ---------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    if args.gloo_worker:
        return gloo_worker(args)
    load_start = os.getloadavg()
    wall_start = time.time()
    numpy_hugepages = set_numpy_hugepages(args.numpy_hugepages)

    import jax
    from mpi4py import MPI
    import mpicoll  # noqa: F401  (fails here, clearly, if mpicoll is not built)

    ctx = Context()
    ctx.comm = MPI.COMM_WORLD
    ctx.rank, ctx.size = ctx.comm.Get_rank(), ctx.comm.Get_size()
    ctx.pycomm = ctx.comm.Dup()
    ctx.numpy_hugepages = numpy_hugepages
    ctx.floor, ctx.floor_reason = load_floor(args, ctx.comm)
    ctx.floor_path, ctx.floor_reason = ((ctx.floor_reason, None) if ctx.floor
                                        else (None, ctx.floor_reason))
    ctx.jax_ops = {"mpicoll": jax_ops("mpicoll")}
    ctx.mpi4jax_ok, info = False, "not requested"
    if any(i.startswith("mpi4jax") for i in args.impls):
        ctx.mpi4jax_ok, info = import_mpi4jax()
        # Every rank must agree, or they would call different collectives.
        ctx.mpi4jax_ok = ctx.comm.allreduce(ctx.mpi4jax_ok, op=MPI.LAND)
    ctx.mpi4jax_version = info if ctx.mpi4jax_ok else None
    ctx.mpi4jax_reason = None if ctx.mpi4jax_ok else info
    if ctx.mpi4jax_ok:
        ctx.jax_ops["mpi4jax"] = jax_ops("mpi4jax", ctx.comm.Dup())

    def progress(row):
        if ctx.rank == 0:
            what = (f"{fmt_us(np.median(row['times']) / row['k'])} us/call, k={row['k']}"
                    if row["status"] == STATUS_OK else row["status"])
            print(f"  {row['op']:>16} {human(row['bytes']):>8} {row['impl']:<24} {what}"
                  f"{'' if row.get('correct', True) else '  WRONG RESULT'}"
                  f"  [{row['seconds']:.1f} s]", flush=True)
    ctx.progress = progress

    if ctx.rank == 0:
        print(f"mpicoll benchmark: {ctx.size} ranks, {os.cpu_count()} cores, load average "
              f"{load_start[0]:.2f}; {MPI.Get_library_version().splitlines()[0].strip()}; "
              f"jax {jax.__version__}; mpi4jax: "
              f"{ctx.mpi4jax_version if ctx.mpi4jax_ok else 'not available: ' + ctx.mpi4jax_reason}"
              f"; c-floor: {ctx.floor_path or 'not available: ' + ctx.floor_reason}"
              f"; transparent huge pages: {transparent_hugepages()}"
              f"; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}", flush=True)
    rows = run_mpi_phase(args, ctx)
    if not args.no_pytree:
        rows += run_pytree(args, ctx)
    ctx.gloo_seconds = 0.0
    if "jax-gloo" in args.impls:
        gloo_rows = run_gloo_phase(args, ctx)
        rows += gloo_rows
        if ctx.rank == 0:
            for row in gloo_rows:
                row["seconds"] = 0.0
                if row["status"] != STATUS_NA:
                    progress(row)
    if ctx.rank != 0:
        return 0

    rows = finish_rows(rows)
    rows.sort(key=lambda r: ((OPS + ("allreduce_pytree",)).index(r["op"]), r["bytes"],
                             IMPLS.index(r["impl"].split("/")[0])))
    text = table([r for r in rows if r["op"] != "allreduce_pytree"], args, ctx.size)
    text += "\n" + pytree_table(rows)
    text += "\n".join(targets(rows))
    bad = [r for r in rows if r["status"] == STATUS_OK and not r["correct"]]
    failed = [r for r in rows if r["status"] == STATUS_FAILED]
    text += (f"\n\ncorrectness guards: {'all passed' if not bad else 'FAILED: ' + ', '.join(r['op'] + '/' + r['impl'] + '/' + human(r['bytes']) for r in bad)}"
             f"; failed measurements: {len(failed)}"
             + (f" ({failed[0]['impl']}: {failed[0]['note']})" if failed else ""))
    if not ctx.mpi4jax_ok and any(i.startswith("mpi4jax") for i in args.impls):
        text += f"\nmpi4jax not available: {ctx.mpi4jax_reason}"
    print("\n" + text, flush=True)

    out_dir = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "bench.csv", rows)
    info = machine_info(ctx, load_start)
    report = dict(benchmark="mpicoll collectives", dtype="float32", reduction="sum", root=0,
                  size_meaning="input buffer per rank, bytes (scatter/alltoall: (ranks, n) "
                               "with n >= 1; see input_bytes)",
                  time_meaning="seconds per call: median over timed runs of the slowest rank's "
                               "time for k calls, divided by k",
                  command=" ".join(["mpiexec", "-n", str(ctx.size), "python"] + sys.argv),
                  args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                        if not k.startswith(("gloo_worker", "port", "process_id", "num_processes",
                                             "local_devices", "plan"))},
                  machine=info, wall_time_s=time.time() - wall_start,
                  gloo_phase_s=ctx.gloo_seconds, all_correct=not bad, rows=rows)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    written = [out_dir / "bench.csv", out_dir / "bench.json"]
    if not args.no_plot:
        try:
            plot(rows, args, [o for o in OPS if o in args.ops], out_dir / "bench.png", ctx.size)
            written.append(out_dir / "bench.png")
            if args.figure and "allreduce" in args.ops:
                plot(rows, args, ["allreduce"], args.figure, ctx.size)
                written.append(args.figure)
        except ImportError as error:
            print(f"no figure: {error} (make bench installs matplotlib)", flush=True)
    print(f"wrote {', '.join(map(str, written))} in {time.time() - wall_start:.0f} s "
          f"(load average at start {load_start[0]:.2f}, now {os.getloadavg()[0]:.2f})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

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
for everyone, see timing.Timer.choose_k); each run starts
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

The pieces: cases.py (inputs, expected results), registry.py (the
implementations: a setup per library, in one table), timing.py (warm-up, k,
repeats, agreement across ranks), report.py (tables, CSV, JSON, figures),
mpi_floor.py (the C floor through ctypes).
"""

import argparse
import json
import os
import time
from pathlib import Path

import jax_gloo  # benchmarks/, next to this script
import report
from cases import (OPS, PYTREE_LEAF_BYTES, PYTREE_LEAVES, QUICK_SIZES, SIZES, block_count,
                   input_bytes, is_correct, parse_size, pytree_expected)
from mpi_floor import load_floor
from registry import (GLOO_OPS, IMPLEMENTATIONS, IMPLS, PYTREE_IMPLEMENTATIONS, Context,
                      gloo_worker, import_mpi4jax, jax_ops)
from timing import STATUS_FAILED, STATUS_NA, STATUS_OK, measure, mpi_timer, record, repeats_for

RESULTS = Path(__file__).resolve().parent / "results"


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



def make_context(args, numpy_hugepages):
    """What the setups share (registry.Context); every rank agrees on mpi4jax's availability."""
    from mpi4py import MPI
    ctx = Context()
    ctx.comm = MPI.COMM_WORLD
    ctx.rank, ctx.size = ctx.comm.Get_rank(), ctx.comm.Get_size()
    ctx.pycomm = ctx.comm.Dup()
    ctx.numpy_hugepages = numpy_hugepages
    ctx.floor, found = load_floor(args.floor_lib, ctx.comm)
    ctx.floor_path, ctx.floor_reason = (found, None) if ctx.floor else (None, found)
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
    ctx.gloo_seconds = 0.0

    def progress(row):
        if ctx.rank == 0:
            print(report.progress_line(row), flush=True)
    ctx.progress = progress
    return ctx


# ---------------------------------------------------------------------------
# The phases: each returns its rows (dicts; see report.CSV_FIELDS)


def run_mpi_phase(args, ctx):
    """Every (op, size, implementation) but jax-gloo, in this process."""
    timer = mpi_timer(ctx.comm, args.target_ms / 1e3)
    rows = []
    for op in args.ops:
        for nbytes in args.sizes:
            count = block_count(op, nbytes, ctx.size)
            for impl in args.impls:
                if impl not in IMPLEMENTATIONS:
                    continue
                row = dict(op=op, impl=impl, bytes=nbytes,
                           input_bytes=input_bytes(op, count, ctx.size), count=count)

                def measure_row(impl=impl, op=op, count=count, nbytes=nbytes):
                    return measure(IMPLEMENTATIONS[impl](ctx, op, count),
                                   lambda out: is_correct(out, op, ctx.rank, ctx.size, count),
                                   ctx.comm, timer, repeats_for(args, nbytes),
                                   amortize=impl.endswith("-jit"), nbytes=nbytes)

                rows.append(record(row, measure_row, ctx.rank, ctx.progress))
    return rows


def run_pytree(args, ctx):
    """The pytree case: one fused allreduce vs a call per leaf (registry.PYTREE_IMPLEMENTATIONS)."""
    import numpy as np
    timer = mpi_timer(ctx.comm, args.target_ms / 1e3)
    want = pytree_expected(ctx.rank, ctx.size)
    total_bytes = PYTREE_LEAVES * PYTREE_LEAF_BYTES

    def correct(out):
        return all(np.array_equal(np.asarray(o), w) for o, w in zip(out, want)) \
            and len(out) == len(want)

    rows = []
    for impl, setup in PYTREE_IMPLEMENTATIONS.items():
        if impl.split("/")[0] not in args.impls:
            continue
        row = dict(op="allreduce_pytree", impl=impl, bytes=total_bytes, input_bytes=total_bytes,
                   count=PYTREE_LEAF_BYTES // 4)

        def measure_row(impl=impl, setup=setup):
            return measure(setup(ctx), correct, ctx.comm, timer,
                           repeats_for(args, total_bytes), amortize="-jit" in impl)

        rows.append(record(row, measure_row, ctx.rank, ctx.progress))
    return rows


def run_gloo_phase(args, ctx):
    """jax-gloo rows (rank 0) for the ops JAX has natively, from child processes; the others n/a."""
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
                       input_bytes=input_bytes(op, count, ctx.size), count=count)
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


def main(argv=None):
    args = parse_args(argv)
    if args.gloo_worker:
        return gloo_worker(args)
    load_start = os.getloadavg()
    wall_start = time.time()
    numpy_hugepages = set_numpy_hugepages(args.numpy_hugepages)

    import mpicoll  # noqa: F401  (fails here, clearly, if mpicoll is not built)

    ctx = make_context(args, numpy_hugepages)
    if ctx.rank == 0:
        print(report.header(ctx, load_start), flush=True)
    rows = run_mpi_phase(args, ctx)
    if not args.no_pytree:
        rows += run_pytree(args, ctx)
    if "jax-gloo" in args.impls:
        gloo_rows = run_gloo_phase(args, ctx)
        rows += gloo_rows
        if ctx.rank == 0:
            for row in gloo_rows:
                row["seconds"] = 0.0
                if row["status"] != STATUS_NA:
                    ctx.progress(row)
    if ctx.rank != 0:
        return 0

    rows = report.sort_rows(report.finish_rows(rows))
    text, bad = report.summary(rows, args, ctx)
    print("\n" + text, flush=True)
    written = report.write_results(rows, args, ctx, load_start, wall_start, all_correct=not bad)
    print(f"wrote {', '.join(map(str, written))} in {time.time() - wall_start:.0f} s "
          f"(load average at start {load_start[0]:.2f}, now {os.getloadavg()[0]:.2f})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

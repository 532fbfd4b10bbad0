"""mpicoll on GPU arrays against mpi4jax (built with CUDA) and the staging floor.

Run on a GPU node (what `tools/gpu_suite.sh bench` does):

    mpiexec -n 2 python benchmarks/gpu_bench.py --floor-lib mpi_floor.so [--out DIR]

Every implementation works on float32 arrays on the GPU, in the same run, with
the same call pattern (bench.py's cases, registry setups and timing.Timer):

  staging-floor    what host staging cannot beat without pipelining: per call,
                   a pinned copy from the GPU (CuPy, synchronized), the bare C
                   MPI call on the pinned host buffers (benchmarks/mpi_floor.c),
                   and a pinned copy back to the GPU (synchronized)
  mpicoll-loop     jax.jit of lax.fori_loop over k dependent calls, input donated
  mpicoll-python   a Python loop of k calls of one jitted collective (the training-
                   loop pattern), each output fed to the next call
  mpicoll-eager    k eager calls mpicoll.allreduce(x)
  mpicoll-loop-unpipelined  mpicoll-loop with the staging pipeline off
                   (MPICOLL_GPU_CHUNK_BYTES=0), at the largest size
  mpi4jax-loop, mpi4jax-python   the same patterns with mpi4jax

Time per call: median over runs of (slowest rank's time for k calls) / k, with k
chosen for about --target-ms a run at every size (bench.py runs one call per run
above 16 MiB; here a jitted loop then still amortizes its dispatch, which JAX
does on its Python path for a program with effects, ~0.5-0.8 ms on a GPU).
Writes gpu_bench-<ranks>.json to --out and prints a table per collective (rank 0).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases  # noqa: E402  (benchmarks/: inputs and expected results)
import registry  # noqa: E402  (the jax patterns)
import timing  # noqa: E402
from mpi_floor import FloorLibrary  # noqa: E402

MIB = 1 << 20


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor-lib", required=True, help="benchmarks/mpi_floor.c built as .so")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--allreduce-sizes", nargs="+", default=["4", "16KiB", "4MiB", "64MiB"])
    parser.add_argument("--other-sizes", nargs="+", default=["4MiB", "64MiB"])
    parser.add_argument("--ops", nargs="+", default=list(cases.OPS))
    parser.add_argument("--target-ms", type=float, default=30.0)
    return parser.parse_args()


def setup_python_loop(ctx, library, op, count):
    """k calls of one jitted collective from Python, each output feeding the next call."""
    import jax
    fn = ctx.jax_ops[library][op]
    in_place = op in registry.IN_PLACE.get(library, ())
    step = jax.jit(lambda x: cases.feed(x, fn(x), in_place))
    state = [jax.numpy.asarray(registry.jax_input(library, op, ctx.rank, ctx.size, count))]

    def once():
        return np.asarray(jax.jit(fn)(jax.numpy.asarray(
            registry.jax_input(library, op, ctx.rank, ctx.size, count))).block_until_ready())

    def run(k):
        x = state[0]
        for _ in range(k):
            x = step(x)
        state[0] = x.block_until_ready()

    return once, run, None


def setup_staging_floor(ctx, op, count):
    """Pinned copy-out + C MPI on the pinned buffers + pinned copy-in, per call."""
    import cupy
    import cupyx

    x_host, out_host = cases.floor_buffers(op, ctx.rank, ctx.size, count)
    pinned_in = cupyx.empty_pinned(x_host.shape, np.float32)
    pinned_out = cupyx.empty_pinned(out_host.shape, np.float32)
    device_in, device_out = cupy.asarray(x_host), cupy.asarray(out_host)
    in_place = op in ("bcast", "reduce", "allreduce")  # the floor works on `out` alone
    stream = cupy.cuda.Stream(non_blocking=True)
    memcpy = cupy.cuda.runtime.memcpyAsync
    to_host, to_device = cupy.cuda.runtime.memcpyDeviceToHost, cupy.cuda.runtime.memcpyHostToDevice

    def one_call():
        source, staged = (device_out, pinned_out) if in_place else (device_in, pinned_in)
        memcpy(staged.ctypes.data, source.data.ptr, staged.nbytes, to_host, stream.ptr)
        stream.synchronize()
        ctx.floor.call(op, pinned_in, pinned_out, count, 1)
        memcpy(device_out.data.ptr, pinned_out.ctypes.data, pinned_out.nbytes, to_device,
               stream.ptr)
        stream.synchronize()

    def once():
        device_in.set(x_host)
        device_out.set(x_host if in_place else out_host)
        one_call()
        return device_out.get()

    def run(k):
        for _ in range(k):
            one_call()

    return once, run, None


def setup_with_chunk(chunk_bytes):
    """mpicoll-loop with the staging pipeline's chunk set to chunk_bytes (0: no pipeline)."""
    def setup(ctx, op, count):
        once, run, _ = registry.setup_jit(ctx, "mpicoll", op, count)
        from mpicoll._src.runtime import native

        def with_chunk(fn):
            def wrapped(*args):
                native.extension.set_gpu_transport(False, chunk_bytes)
                try:
                    return fn(*args)
                finally:
                    native.extension.set_gpu_transport(native.GPU_TRANSPORT == "cuda-aware",
                                                       native.GPU_CHUNK_BYTES)
            return wrapped

        return with_chunk(once), with_chunk(run), None
    return setup


def implementations(ctx, op, nbytes, largest):
    impls = {"staging-floor": setup_staging_floor,
             "mpicoll-loop": lambda c, o, n: registry.setup_jit(c, "mpicoll", o, n),
             "mpicoll-python": lambda c, o, n: setup_python_loop(c, "mpicoll", o, n),
             "mpicoll-eager": lambda c, o, n: registry.setup_eager(c, "mpicoll", o, n)}
    if nbytes == largest:
        impls["mpicoll-loop-unpipelined"] = setup_with_chunk(0)
        if op == "allreduce":  # the chunk size's effect
            for chunk in (1 * MIB, 16 * MIB):
                impls[f"mpicoll-loop-chunk-{chunk // MIB}MiB"] = setup_with_chunk(chunk)
    if "mpi4jax" in ctx.jax_ops:
        impls["mpi4jax-loop"] = lambda c, o, n: registry.setup_jit(c, "mpi4jax", o, n)
        impls["mpi4jax-python"] = lambda c, o, n: setup_python_loop(c, "mpi4jax", o, n)
    return impls


def main():
    args = parse_args()
    import jax
    from mpi4py import MPI

    import mpicoll
    from mpicoll._src.runtime import native

    comm = MPI.COMM_WORLD
    ctx = registry.Context()
    ctx.rank, ctx.size = comm.Get_rank(), comm.Get_size()
    ctx.floor = FloorLibrary(args.floor_lib, comm.Dup())
    ctx.jax_ops = {"mpicoll": registry.jax_ops("mpicoll")}
    has_mpi4jax, mpi4jax_info = registry.import_mpi4jax()
    if has_mpi4jax:
        ctx.jax_ops["mpi4jax"] = registry.jax_ops("mpi4jax", comm.Dup())
    assert jax.default_backend() == "gpu", f"not on a GPU: {jax.default_backend()}"
    timer = timing.mpi_timer(comm, args.target_ms / 1000,
                             one_call_bytes=1 << 40)  # see the module docstring
    header = {"ranks": ctx.size, "device": str(jax.devices()[0].device_kind),
              "jax": jax.__version__, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
              "transport": native.GPU_TRANSPORT, "chunk_bytes": native.GPU_CHUNK_BYTES,
              "mpi4jax": mpi4jax_info, "mpicoll": mpicoll.__version__}
    rows = []
    for op in args.ops:
        sizes = args.allreduce_sizes if op == "allreduce" else args.other_sizes
        sizes = [cases.parse_size(s) for s in sizes]
        for nbytes in sizes:
            count = cases.block_count(op, nbytes, ctx.size)
            for impl, setup in implementations(ctx, op, nbytes, max(sizes)).items():
                row = {"op": op, "bytes": nbytes, "impl": impl}
                try:
                    once, run, _ = setup(ctx, op, count)
                    ok = cases.is_correct(once(), op, ctx.rank, ctx.size, count)
                    row["correct"] = all(comm.allgather(ok))
                    repeats = 9 if nbytes <= 16 * MIB else 5
                    k, times = timer.times(run, repeats, amortize="-loop" in impl,
                                           nbytes=nbytes)
                    row.update(k=k, us_per_call=float(np.median(times)) / k * 1e6)
                except Exception as error:  # recorded, every rank reaches the next row
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                errors = comm.allgather(row.get("error"))
                if any(errors) and "error" not in row:
                    row["error"] = next(e for e in errors if e)
                rows.append(row)
                if ctx.rank == 0:
                    shown = (f"{row['us_per_call']:12.1f} us" if "us_per_call" in row
                             else row["error"])
                    print(f"{op:10s} {nbytes:>10d} B  {impl:26s} {shown}"
                          f"{'' if row.get('correct', True) else '  WRONG RESULT'}", flush=True)
    if ctx.rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"gpu_bench-{ctx.size}.json"
        path.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
        print_table(header, rows)
    return 0 if all(r.get("correct", True) for r in rows) else 1


def print_table(header, rows):
    print(f"\nGPU benchmark, {header['ranks']} rank(s): {header['device']}, {header['mpi']}, "
          f"jax {header['jax']}, transport {header['transport']} (chunk "
          f"{header['chunk_bytes']} B), mpi4jax {header['mpi4jax']}")
    print("| op | size | impl | us/call | / staging floor | mpicoll / mpi4jax (same pattern) |")
    print("|---|---|---|---|---|---|")
    time_of = {(r["op"], r["bytes"], r["impl"]): r.get("us_per_call") for r in rows}
    for r in rows:
        t = r.get("us_per_call")
        floor = time_of.get((r["op"], r["bytes"], "staging-floor"))
        vs_floor = f"{t / floor:.2f}" if t and floor else ""
        vs_mpi4jax = ""
        if r["impl"].startswith("mpicoll-") and r["impl"] != "mpicoll-eager":
            other = time_of.get((r["op"], r["bytes"], "mpi4jax-" + r["impl"].split("-")[1]))
            vs_mpi4jax = f"{t / other:.2f}" if t and other else ""
        shown = f"{t:.1f}" if t else r.get("error", "")
        print(f"| {r['op']} | {r['bytes']} | {r['impl']} | {shown} | {vs_floor} | {vs_mpi4jax} |")


if __name__ == "__main__":
    sys.exit(main())

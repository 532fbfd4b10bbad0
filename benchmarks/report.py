"""benchmarks/bench.py's results: derived numbers, the printed tables and targets, bench.csv, bench.json, figures."""

import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from cases import KIB, MIB, OPS, PYTREE_LEAF_BYTES, PYTREE_LEAVES
from registry import IMPLS
from timing import STATUS_FAILED, STATUS_OK


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
    """The project's performance targets, evaluated on this run."""
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
    # sendrecv's, reduce_scatter's and the RS+AG allreduce's own targets
    ratio("sendrecv 4 B, mpicoll-jit / c-floor", t("sendrecv", "mpicoll-jit", small),
          t("sendrecv", "c-floor", small), 2)
    ratio("reduce_scatter 64 MiB, mpicoll-jit / c-floor", t("reduce_scatter", "mpicoll-jit", big),
          t("reduce_scatter", "c-floor", big), 1.2)
    ratio("allreduce as reduce_scatter + allgather 64 MiB / allreduce, mpicoll-jit",
          t("allreduce_rs_ag", "mpicoll-jit", big), t("allreduce", "mpicoll-jit", big), 1.3)
    return ["", "targets:"] + checks if checks else []


CSV_FIELDS = ("op", "impl", "bytes", "input_bytes", "count", "status", "correct",
              "time_per_call_s", "min_time_per_call_s", "ratio_to_floor", "bandwidth_GBps",
              "k", "repeats", "note")


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "repeats": len(row.get("times", [])) or ""})


def plot(rows, args, ops, path, size, cores=None):
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
    fig.suptitle(f"float32, {size} ranks on one {cores or os.cpu_count()}-core machine; median "
                 "time per call of the slowest rank", fontsize=11,
                 y=1 - 0.12 / fig.get_figheight())
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



def transparent_hugepages():
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return None



# ---------------------------------------------------------------------------
# What rank 0 prints while it runs, and at the end


def header(ctx, load_start):
    """The first line: ranks, cores, load, MPI, jax, mpi4jax, the C floor, huge pages."""
    from mpi4py import MPI
    import jax
    return (f"mpicoll benchmark: {ctx.size} ranks, {os.cpu_count()} cores, load average "
            f"{load_start[0]:.2f}; {MPI.Get_library_version().splitlines()[0].strip()}; "
            f"jax {jax.__version__}; mpi4jax: "
            f"{ctx.mpi4jax_version if ctx.mpi4jax_ok else 'not available: ' + ctx.mpi4jax_reason}"
            f"; c-floor: {ctx.floor_path or 'not available: ' + ctx.floor_reason}"
            f"; transparent huge pages: {transparent_hugepages()}"
            f"; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}")


def progress_line(row):
    """One measured row, as it is done."""
    what = (f"{fmt_us(np.median(row['times']) / row['k'])} us/call, k={row['k']}"
            if row["status"] == STATUS_OK else row["status"])
    return (f"  {row['op']:>16} {human(row['bytes']):>8} {row['impl']:<24} {what}"
            f"{'' if row.get('correct', True) else '  WRONG RESULT'}"
            f"  [{row['seconds']:.1f} s]")


def summary(rows, args, ctx):
    """(the tables, targets and guards as printed, the rows whose result was wrong)."""
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
    return text, bad


def sort_rows(rows):
    """Collective, then size, then implementation, in the tables' order."""
    rows.sort(key=lambda r: ((OPS + ("allreduce_pytree",)).index(r["op"]), r["bytes"],
                             IMPLS.index(r["impl"].split("/")[0])))
    return rows


def write_results(rows, args, ctx, load_start, wall_start, all_correct):
    """bench.csv, bench.json and the figures in args.output_dir; the paths written."""
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
                  gloo_phase_s=ctx.gloo_seconds, all_correct=all_correct, rows=rows)
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
    return written


def redraw(argv=None):
    """Redraw a figure from a bench.json (bench.py's, or its copy docs/cpu_bench-2.json):

        python benchmarks/report.py docs/cpu_bench-2.json docs/bench-allreduce.png [--ops allreduce]
    """
    import argparse
    parser = argparse.ArgumentParser(description=redraw.__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="bench.json written by bench.py")
    parser.add_argument("figure", type=Path, help="the PNG to write")
    parser.add_argument("--ops", nargs="+", default=["allreduce"], choices=OPS, metavar="OP",
                        help="collectives, one row of plots each (default allreduce)")
    args = parser.parse_args(argv)
    data = json.loads(args.results.read_text())
    plot(data["rows"], None, args.ops, args.figure, data["machine"]["ranks"],
         data["machine"]["cores"])
    print(f"wrote {args.figure} from {args.results}")


if __name__ == "__main__":
    redraw()

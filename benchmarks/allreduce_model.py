"""An alpha-beta cost model of mpicoll's allreduce over nodes x devices, fitted and projected.

    python benchmarks/allreduce_model.py      (after benchmarks/multihost_allreduce.sh)

Reads benchmarks/results/multihost-{flat,devices}-{H}h[-{L}d].json and fits, by least
squares on time = alpha + bytes * beta:
  shm       ping-pong within a host (MPI shared memory)
  tcp       ping-pong between hosts (MPI over TCP; here the namespace's loopback)
and, for each device count L measured (their runs' core sharing divided out):
  psum      the device-only psum over L local devices (XLA)
  rs+ag     the device-only psum_scatter + all_gather
  combine   mpicoll's local combine alone (the device threads meet in its handler,
            one reduces the L arrays; over MPI.COMM_SELF, so no traffic)

Model, for an n-byte array on each of L devices of each of N nodes (one rank per
node), with the MPI allreduce of m bytes over N ranks taken as the better of
recursive doubling and reduce-scatter + allgather (Rabenseifner):
    ar(m, N)  = ceil(log2 N) * alpha_tcp + min(ceil(log2 N) * m, 2 (N-1)/N * m) * beta_tcp
  combine = combine(n) + ar(n, N), one stream per node: n bytes on the link
  small   = psum(n)  + ar(n, N) with L device streams sharing the node's link: the
            bandwidth term counts L * n bytes (every device allreduces the whole array)
  split   = rs+ag(n) + ar(n/L, N) per device, L of them sharing the link: L * n/L bytes
  flat    = one rank per device, N*L ranks: ar over N*L ranks, the intra-node steps at
            shm cost, the inter-node ones at tcp cost with L ranks sharing the link
The choices it informs: on CPU mpicoll takes `combine` up to local_combine_bytes(L) =
LOCAL_COMBINE_BYTES / (L - 1) per device; otherwise (GPUs, mpicoll.overlap(), or
above it) `split` above
split_allreduce_bytes(L) = SPLIT_ALLREDUCE_BYTES / (L - 1), else `small`.

Checked against the measurements at every host count (relative error per point;
the simulated hosts share the machine's cores, see `sharing`),
then projected to 1,000 nodes x 8 devices with the fitted loopback parameters and,
clearly labelled as assumptions, typical InfiniBand HDR and 25 GbE parameters.
Prints the tables (markdown) and writes docs/allreduce-model.svg.
"""

import json
import math
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FIGURE = HERE.parent / "docs" / "allreduce-model.svg"
KIB, MIB = 1024, 1024 * 1024

# Projections: network parameters that are NOT measured here (typical published
# figures for MPI point-to-point; assumptions for the projection only).
NETWORKS = {
    "InfiniBand HDR (assumed: 1.5 us, 12 GB/s)": (1.5e-6, 1 / 12e9),
    "25 GbE TCP (assumed: 25 us, 2.5 GB/s)": (25e-6, 1 / 2.5e9),
}


def fit(rows):
    """(alpha, beta) of time = alpha + bytes * beta, least squares weighted by 1/time
    (relative error: small and large messages count alike)."""
    n = np.array([r[0] for r in rows], float)
    t = np.array([r[1] for r in rows], float)
    a = np.stack([np.ones_like(n), n], 1) / t[:, None]
    alpha, beta = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
    return max(alpha, 0.0), max(beta, 0.0)


def load():
    runs = {}
    for path in sorted(RESULTS.glob("multihost-*-*h*.json")):
        report = json.loads(path.read_text())
        runs[(report["mode"], report["hosts"], report.get("local_devices", 2))] = report
    if not runs:
        raise SystemExit(f"no measurements in {RESULTS}: run benchmarks/multihost_allreduce.sh")
    return runs


DEVICE_COMPONENTS = {"psum": "local_psum", "rs+ag": "local_split", "combine": "local_combine"}


def parameters(runs):
    """Fit every component on all host counts' measurements together; the device
    components per device count, as per-core costs (each run's sharing divided out)."""
    pooled = {"pingpong_intra": [], "pingpong_inter": []}
    per_device = {}
    for (mode, hosts, local), report in runs.items():
        for key in pooled:
            pooled[key] += report.get(key, [])
        if mode != "devices":
            continue
        stretch = sharing(hosts, local, report["cores"])
        for name, key in DEVICE_COMPONENTS.items():
            per_device.setdefault(name, {}).setdefault(local, []).extend(
                [n, t / stretch] for n, t in report.get(key, []))
    p = {"shm": fit(pooled["pingpong_intra"]), "tcp": fit(pooled["pingpong_inter"])}
    for name, by_local in per_device.items():
        p[name] = {local: fit(rows) for local, rows in by_local.items() if rows}
    return p


def device_cost(p, name, local, n):
    """A device component at `local` devices: fitted there, else from the nearest
    device count fitted, its byte term scaled by the data the devices move (psum and
    rs+ag run on all devices in parallel: per-device work ~ n; the combine's one
    thread reduces L arrays: ~ (L - 1) n)."""
    fitted = p[name]
    if local in fitted:
        alpha, beta = fitted[local]
        return alpha + beta * n
    nearest = min(fitted, key=lambda l: abs(l - local))
    alpha, beta = fitted[nearest]
    scale = (local - 1) / (nearest - 1) if name == "combine" else 1.0
    return alpha + beta * scale * n


def mpi_allreduce(m, ranks, alpha, beta, streams=1):
    steps = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    moved = min(steps * m, 2 * (ranks - 1) / ranks * m)
    return steps * alpha + streams * moved * beta


PATHS = ("combine", "small", "split", "flat")


def model(path, n, nodes, local, p):
    a_tcp, b_tcp = p["tcp"]
    if path == "combine":
        return device_cost(p, "combine", local, n) + mpi_allreduce(n, nodes, a_tcp, b_tcp)
    if path == "small":
        return (device_cost(p, "psum", local, n)
                + mpi_allreduce(n, nodes, a_tcp, b_tcp, streams=local))
    if path == "split":
        return (device_cost(p, "rs+ag", local, n)
                + mpi_allreduce(n / local, nodes, a_tcp, b_tcp, streams=local))
    if path == "flat":  # ranks = devices: log2 L steps in shared memory, log2 N over tcp
        a_shm, b_shm = p["shm"]
        return (mpi_allreduce(n, local, a_shm, b_shm)
                + mpi_allreduce(n, nodes, a_tcp, b_tcp, streams=local))
    raise ValueError(path)


GRID = np.logspace(2, 30, 400, base=2)


def crossover(nodes, local, p, lower="small", upper="split"):
    """Bytes per device above which `upper` beats `lower` (inf: never; 0: always)."""
    better = [n for n in GRID if model(upper, n, nodes, local, p) < model(lower, n, nodes, local, p)]
    if not better:
        return math.inf
    return float(better[0]) if better[0] > GRID[0] else 0.0


def thresholds(runs):
    """mpicoll's thresholds per device count, as the measured build computed them
    (ranks_devices.local_combine_bytes / split_allreduce_bytes): {L: (combine, split)}."""
    limits = {local: (report["local_combine_bytes"], report["split_allreduce_bytes"])
              for (mode, _, local), report in runs.items() if mode == "devices"}
    if not limits:
        raise SystemExit("rerun benchmarks/multihost_allreduce.sh: no device runs in the results")
    return limits


def mpicoll_choice(n, local, limits, cpu=True):
    """The path mpicoll's global allreduce takes for n bytes per device."""
    combine_bytes, split_bytes = limits[local]
    if cpu and n <= combine_bytes:
        return "combine"
    return "split" if n >= split_bytes else "small"


def human(nbytes):
    if nbytes == math.inf:
        return "never"
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.3g} B"


def us(seconds):
    return f"{seconds * 1e6:,.0f}" if seconds >= 1e-4 else f"{seconds * 1e6:.1f}"


def sharing(hosts, local, cores):
    """How many busy threads share each core of the simulation (1 on a real cluster).

    The simulated hosts share this machine's cores: N hosts x L devices (flat: L
    ranks; devices: L XLA threads) all busy in an allreduce, against the 2 of a
    ping-pong the parameters were fitted on.  Every term of the model stretches by it.
    """
    return max(1.0, hosts * local / cores)


def check(runs, p):
    """Measured vs model at every host and device count and size: rows, and the
    median and largest |error|."""
    rows, errors = [], []
    for (mode, hosts, local), report in sorted(runs.items()):
        paths = {"flat": [("flat", "flat_allreduce")],
                 "devices": [("combine", "global_combine"), ("small", "global_small"),
                             ("split", "global_split")]}[mode]
        local = 2 if mode == "flat" else local  # flat: 2 ranks per host
        stretch = sharing(hosts, local, report["cores"])
        for path, key in paths:
            for n, measured in report.get(key, []):
                predicted = stretch * model(path, n, hosts, local, p)
                error = (predicted - measured) / measured
                errors.append(abs(error))
                rows.append((hosts, local, path, n, measured, predicted, error))
    return rows, float(np.median(errors)), float(np.max(errors))


def choices(runs, limits):
    """Per measured device run and size: the fastest path measured, mpicoll's path,
    and what mpicoll's choice costs against the fastest (1.00: it chose the fastest).
    With the combine off (GPUs, mpicoll.overlap()) the choice is small or split."""
    rows = []
    for (mode, hosts, local), report in sorted(runs.items()):
        if mode != "devices" or "global_combine" not in report:
            continue
        measured = {path: dict(report[f"global_{path}"]) for path in ("combine", "small", "split")}
        for n in sorted(measured["small"]):
            times = {path: measured[path][n] for path in measured}
            best = min(times, key=times.get)
            chosen = mpicoll_choice(n, local, limits)
            best_off = min(("small", "split"), key=times.get)
            chosen_off = mpicoll_choice(n, local, limits, cpu=False)
            rows.append((hosts, local, n, best, chosen, times[chosen] / times[best],
                         best_off, chosen_off, times[chosen_off] / times[best_off]))
    return rows


def svg_plot(series, title, path):
    """A log-log line plot as SVG (no plotting library needed)."""
    width, height, left, right, top, bottom = 760, 440, 70, 250, 40, 50
    xs = [x for _, pts, _ in series for x, _ in pts]
    ys = [y for _, pts, _ in series for _, y in pts]
    lx0, lx1 = math.log10(min(xs)), math.log10(max(xs))
    ly0, ly1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))

    def px(x):
        return left + (math.log10(x) - lx0) / (lx1 - lx0) * (width - left - right)

    def py(y):
        return height - bottom - (math.log10(y) - ly0) / (ly1 - ly0) * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="13">{title}</text>']
    for e in range(ly0, ly1 + 1):
        y = py(10 ** e)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{human_time(10 ** e)}</text>')
    for e in range(int(math.ceil(lx0 / math.log10(4))), int(lx1 / math.log10(4)) + 1):
        x = px(4 ** e)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{height - bottom + 15}" text-anchor="middle">'
                   f'{human(4 ** e).replace(" ", "")}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">'
               'bytes per device</text>')
    for i, (label, pts, style) in enumerate(series):
        color, dash = style
        d = " ".join(f"{'M' if j == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for j, (x, y) in enumerate(pts))
        out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.8"'
                   f'{f" stroke-dasharray={chr(34)}{dash}{chr(34)}" if dash else ""}/>')
        ly = top + 14 + 16 * i
        out.append(f'<line x1="{width - right + 10}" x2="{width - right + 34}" y1="{ly - 4}" '
                   f'y2="{ly - 4}" stroke="{color}" stroke-width="1.8"'
                   f'{f" stroke-dasharray={chr(34)}{dash}{chr(34)}" if dash else ""}/>')
        out.append(f'<text x="{width - right + 40}" y="{ly}">{label}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def human_time(seconds):
    if seconds >= 1:
        return f"{seconds:g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g} ms"
    return f"{seconds * 1e6:g} us"


def best_path(n, nodes, local, p, paths):
    return min(paths, key=lambda path: model(path, n, nodes, local, p))


def main():
    runs = load()
    p = parameters(runs)
    limits = thresholds(runs)
    print("## Fitted parameters (time = alpha + bytes x beta; device components per core)\n")
    print("| component | alpha | beta | bandwidth 1/beta |")
    print("|---|---|---|---|")
    components = [(name, p[name]) for name in ("shm", "tcp")]
    components += [(f"{name}, {local} devices", p[name][local])
                   for name in DEVICE_COMPONENTS for local in sorted(p[name])]
    for name, (alpha, beta) in components:
        print(f"| {name} | {us(alpha)} us | {beta * 1e9:.3f} ns/B | "
              f"{(1 / beta / 1e9 if beta else math.inf):.2f} GB/s |")

    rows, median_error, max_error = check(runs, p)
    print(f"\n## Model vs measurement (median |error| {median_error:.0%}, max {max_error:.0%})\n")
    print("| hosts | devices | path | bytes/device | measured us | model us | error |")
    print("|---|---|---|---|---|---|---|")
    for hosts, local, path, n, measured, predicted, error in rows:
        print(f"| {hosts} | {local} | {path} | {human(n)} | {us(measured)} | {us(predicted)} "
              f"| {error:+.0%} |")

    print("\n## mpicoll's choice against the fastest path measured "
          "(time of mpicoll's path / the fastest)\n")
    print("| hosts | devices | bytes/device | CPU: fastest | mpicoll | cost "
          "| combine off: fastest | mpicoll | cost |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hosts, local, n, best, chosen, cost, best_off, chosen_off, cost_off in choices(runs, limits):
        print(f"| {hosts} | {local} | {human(n)} | {best} | {chosen} | {cost:.2f} "
              f"| {best_off} | {chosen_off} | {cost_off:.2f} |")

    nodes, local = 1000, 8
    sizes = [KIB, 16 * KIB, 256 * KIB, 4 * MIB, 64 * MIB]
    settings = {"loopback TCP (fitted here)": p}
    for label, tcp in NETWORKS.items():
        settings[label] = dict(p, tcp=tcp)
    print(f"\n## Projection: {nodes} nodes x {local} devices, time per allreduce (us)\n")
    print("| network | path | " + " | ".join(human(n) for n in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    series = []
    colors = {"combine": "#9467bd", "small": "#1f77b4", "split": "#d62728", "flat": "#2ca02c"}
    dashes = ["", "6,3", "2,3"]
    grid = np.logspace(8, 27, 60, base=2)
    for (label, params), dash in zip(settings.items(), dashes):
        for path in PATHS:
            times = [model(path, n, nodes, local, params) for n in sizes]
            print(f"| {label} | {path} | " + " | ".join(us(t) for t in times) + " |")
            series.append((f"{path}, {label.split(' (')[0]}",
                           [(n, model(path, n, nodes, local, params)) for n in grid],
                           (colors[path], dash)))
        print("| | best (mpicoll) | " + " | ".join(
            f"{best_path(n, nodes, local, params, PATHS[:3])} ({mpicoll_choice(n, local, limits)})"
            for n in sizes) + " |")
    print("\n## Crossovers (bytes per device above which the second path is faster)\n")
    print("| network | nodes x devices | small -> split (mpicoll: split from) "
          "| combine -> split (mpicoll: combine up to) |")
    print("|---|---|---|---|")
    for label, params in settings.items():
        for n, l in ((2, 2), (4, 2), (2, 8), (1000, 2), (1000, 4), (1000, 8)):
            print(f"| {label.split(' (')[0]} | {n} x {l} | {human(crossover(n, l, params))} "
                  f"({human(limits[l][1])}) | "
                  f"{human(crossover(n, l, params, 'combine', 'split'))} "
                  f"({human(limits[l][0])}) |")
    FIGURE.parent.mkdir(exist_ok=True)
    svg_plot(series, f"allreduce model, {nodes} nodes x {local} devices (CPU device "
                     "costs fitted here; networks as labelled)", FIGURE)
    print(f"\nwrote {FIGURE}")


if __name__ == "__main__":
    main()

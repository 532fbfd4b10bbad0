"""An alpha-beta cost model of mpicoll's allreduce over nodes x devices, fitted and projected.

    python benchmarks/allreduce_model.py      (after benchmarks/multihost_allreduce.sh)

Reads benchmarks/results/multihost-{flat,devices}-{H}h.json and fits, by least
squares on time = alpha + bytes * beta:
  shm       ping-pong within a host (MPI shared memory)
  tcp       ping-pong between hosts (MPI over TCP; here the namespace's loopback)
  psum      the device-only psum over L local devices (XLA)
  rs+ag     the device-only psum_scatter + all_gather

Model, for an n-byte array on each of L devices of each of N nodes (one rank per
node), with the MPI allreduce of m bytes over N ranks taken as the better of
recursive doubling and reduce-scatter + allgather (Rabenseifner):
    ar(m, N)  = ceil(log2 N) * alpha_tcp + min(ceil(log2 N) * m, 2 (N-1)/N * m) * beta_tcp
  small  = psum(n)  + ar(n, N) with L device streams sharing the node's link: the
           bandwidth term counts L * n bytes (every device allreduces the whole array)
  split  = rs+ag(n) + ar(n/L, N) per device, L of them sharing the link: L * n/L bytes
  flat   = one rank per device, N*L ranks: ar over N*L ranks, the intra-node steps at
           shm cost, the inter-node ones at tcp cost with L ranks sharing the link
The choice it informs: mpicoll takes `split` above SPLIT_ALLREDUCE_BYTES per device.

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
    for path in sorted(RESULTS.glob("multihost-*-*h.json")):
        report = json.loads(path.read_text())
        runs[(report["mode"], report["hosts"])] = report
    if not runs:
        raise SystemExit(f"no measurements in {RESULTS}: run benchmarks/multihost_allreduce.sh")
    return runs


def parameters(runs):
    """Fit every component on all host counts' measurements together."""
    pooled = {key: [] for key in ("pingpong_intra", "pingpong_inter", "local_psum", "local_split")}
    for report in runs.values():
        for key in pooled:
            pooled[key] += report.get(key, [])
    return {"shm": fit(pooled["pingpong_intra"]), "tcp": fit(pooled["pingpong_inter"]),
            "psum": fit(pooled["local_psum"]), "rs+ag": fit(pooled["local_split"])}


def mpi_allreduce(m, ranks, alpha, beta, streams=1):
    steps = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    moved = min(steps * m, 2 * (ranks - 1) / ranks * m)
    return steps * alpha + streams * moved * beta


def model(path, n, nodes, local, p):
    a_tcp, b_tcp = p["tcp"]
    if path == "small":
        a, b = p["psum"]
        return a + b * n + mpi_allreduce(n, nodes, a_tcp, b_tcp, streams=local)
    if path == "split":
        a, b = p["rs+ag"]
        return a + b * n + mpi_allreduce(n / local, nodes, a_tcp, b_tcp, streams=local)
    if path == "flat":  # ranks = devices: log2 L steps in shared memory, log2 N over tcp
        a_shm, b_shm = p["shm"]
        return (mpi_allreduce(n, local, a_shm, b_shm)
                + mpi_allreduce(n, nodes, a_tcp, b_tcp, streams=local))
    raise ValueError(path)


def crossover(nodes, local, p):
    """Bytes per device above which split beats small (inf: never; 0: always)."""
    grid = np.logspace(2, 30, 400, base=2)
    better = [n for n in grid if model("split", n, nodes, local, p) < model("small", n, nodes, local, p)]
    if not better:
        return math.inf
    return float(better[0]) if better[0] > grid[0] else 0.0


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
    """Measured vs model at every host count and size: rows, and the median |error|."""
    rows, errors = [], []
    for (mode, hosts), report in sorted(runs.items()):
        paths = {"flat": [("flat", "flat_allreduce")],
                 "devices": [("small", "global_small"), ("split", "global_split")]}[mode]
        local = 2
        stretch = sharing(hosts, local, report["cores"])
        for path, key in paths:
            for n, measured in report[key]:
                predicted = stretch * model(path, n, hosts, local, p)
                error = (predicted - measured) / measured
                errors.append(abs(error))
                rows.append((hosts, path, n, measured, predicted, error))
    return rows, float(np.median(errors)), float(np.max(errors))


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


def main():
    runs = load()
    p = parameters(runs)
    print("## Fitted parameters (time = alpha + bytes x beta)\n")
    print("| component | alpha | beta | bandwidth 1/beta |")
    print("|---|---|---|---|")
    for name, (alpha, beta) in p.items():
        print(f"| {name} | {us(alpha)} us | {beta * 1e9:.3f} ns/B | "
              f"{(1 / beta / 1e9 if beta else math.inf):.2f} GB/s |")

    rows, median_error, max_error = check(runs, p)
    print(f"\n## Model vs measurement (median |error| {median_error:.0%}, max {max_error:.0%})\n")
    print("| hosts | path | bytes/device | measured us | model us | error |")
    print("|---|---|---|---|---|---|")
    for hosts, path, n, measured, predicted, error in rows:
        print(f"| {hosts} | {path} | {human(n)} | {us(measured)} | {us(predicted)} | {error:+.0%} |")

    nodes, local = 1000, 8
    sizes = [KIB, 16 * KIB, 256 * KIB, 4 * MIB, 64 * MIB]
    settings = {"loopback TCP (fitted here)": p}
    for label, tcp in NETWORKS.items():
        settings[label] = dict(p, tcp=tcp)
    print(f"\n## Projection: {nodes} nodes x {local} devices, time per allreduce (us)\n")
    print("| network | path | " + " | ".join(human(n) for n in sizes) + " | split wins above |")
    print("|---|---|" + "---|" * len(sizes) + "---|")
    series = []
    colors = {"small": "#1f77b4", "split": "#d62728", "flat": "#2ca02c"}
    dashes = ["", "6,3", "2,3"]
    grid = np.logspace(8, 27, 60, base=2)
    for (label, params), dash in zip(settings.items(), dashes):
        for path in ("small", "split", "flat"):
            times = [model(path, n, nodes, local, params) for n in sizes]
            cross = human(crossover(nodes, local, params)) if path == "split" else ""
            print(f"| {label} | {path} | " + " | ".join(us(t) for t in times) + f" | {cross} |")
            series.append((f"{path}, {label.split(' (')[0]}",
                           [(n, model(path, n, nodes, local, params)) for n in grid],
                           (colors[path], dash)))
    for label, params in settings.items():
        print(f"\ncrossover small->split, {label}: " + ", ".join(
            f"{n} nodes x {l} dev: {human(crossover(n, l, params))}"
            for n, l in ((2, 2), (4, 2), (1000, 8))))
    FIGURE.parent.mkdir(exist_ok=True)
    svg_plot(series, f"allreduce model, {nodes} nodes x {local} devices (CPU device "
                     "costs fitted here; networks as labelled)", FIGURE)
    print(f"\nwrote {FIGURE}")


if __name__ == "__main__":
    main()

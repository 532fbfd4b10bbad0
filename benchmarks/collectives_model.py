"""Bytes and an alpha-beta time for the collectives over processes x devices.

    python benchmarks/collectives_model.py [--processes 64] [--local 8] [--mib 4]

For N processes (nodes) of L devices, D bytes per process (D / L per device), what
each node sends over the network per call of each jax.lax collective over every
participant, by three algorithms:

  best      the least any algorithm sends: each byte a node needs from another node
            crosses once (the node-aware lower bound)
  mpicoll   the local devices meet and their process runs ONE MPI collective on the
            packed data (csrc/meeting/meeting.cc): allgather / reduce-scatter /
            alltoall / alltoallv of the pairs / bcast, with the usual algorithms
            (ring allgather, pairwise reduce-scatter and alltoall)
  placed    what mpicoll did before: a sum (allreduce, reduce-scatter +
            allgather) of a buffer with one place per participant, N*L times the
            data; ppermute an alltoall with one non-zero row per participant

Time = steps * alpha + bytes * beta on the node's link, with the network
parameters of benchmarks/allreduce_model.py (assumed, not measured here).  The
model counts bytes on the node's link only: the local packing (a copy of the
node's data in memory) is measured, not modelled
(benchmarks/global_mesh_collectives.py).  Prints a markdown table.
"""

import argparse
import math

from allreduce_model import NETWORKS, human  # benchmarks/, next to this script


def sent(name, algorithm, nodes, local, data):
    """(bytes a node sends, latency steps) for one call; data: bytes per node (each of its
    L devices holds data / L)."""
    n, d, s = nodes, data, data / local  # s: a device's block
    log = math.ceil(math.log2(n)) if n > 1 else 0
    allreduce = lambda nbytes: (2 * (n - 1) / n * nbytes, 2 * (n - 1))  # noqa: E731
    if name == "all_gather":  # every node needs every other node's d
        best = ((n - 1) * d, log)
        return {"best": best, "mpicoll": ((n - 1) * d, n - 1),
                "placed": allreduce(n * d)}[algorithm]  # a place per participant
    if name == "psum_scatter":  # the node's L blocks summed, then N-way reduce-scatter
        best = ((n - 1) / n * s, n - 1)
        return {"best": best, "mpicoll": best, "placed": allreduce(s)}[algorithm]
    if name == "all_to_all":  # a device's block cut into N*L pieces, one per participant
        best = ((n - 1) / n * d, n - 1)
        return {"best": best, "mpicoll": best, "placed": allreduce(n * d)}[algorithm]
    if name == "ppermute (ring)":  # one block leaves each node
        # placed: an alltoall of one row per participant, itself a placed sum
        return {"best": (s, 1), "mpicoll": (s, 1),
                "placed": allreduce((n * local) ** 2 * s)}[algorithm]
    if name == "pbroadcast":  # the source's block to every node
        return {"best": (s, log), "mpicoll": (s, log), "placed": allreduce(s)}[algorithm]
    raise ValueError(name)


NAMES = ("all_gather", "psum_scatter", "all_to_all", "ppermute (ring)", "pbroadcast")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=64)
    parser.add_argument("--local", type=int, default=8)
    parser.add_argument("--mib", type=float, default=4.0)
    args = parser.parse_args()
    data = args.mib * 2**20
    (network, (alpha, beta)), *_ = NETWORKS.items()
    print(f"{args.processes} nodes x {args.local} devices, {args.mib:g} MiB per node; "
          f"time on {network}\n")
    print("| collective | best: bytes/node | mpicoll | placed (before) | mpicoll / best "
          "| time mpicoll | time placed |")
    print("|---|---|---|---|---|---|---|")
    for name in NAMES:
        rows = {a: sent(name, a, args.processes, args.local, data)
                for a in ("best", "mpicoll", "placed")}
        time = {a: steps * alpha + nbytes * beta for a, (nbytes, steps) in rows.items()}
        print(f"| {name} | {human(rows['best'][0])} | {human(rows['mpicoll'][0])} | "
              f"{human(rows['placed'][0])} | {rows['mpicoll'][0] / rows['best'][0]:.2f} | "
              f"{time['mpicoll'] * 1e3:.2f} ms | {time['placed'] * 1e3:.2f} ms |")


if __name__ == "__main__":
    main()

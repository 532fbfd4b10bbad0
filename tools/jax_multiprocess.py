"""JAX's own multi-process tests under mpiexec, with JAX's CPU collectives on
mpicoll's MPI and on gloo, side by side.

    python tools/jax_multiprocess.py JAX_TESTS [--ranks 2] [--local 2] [FILE ...]

JAX_TESTS: the tests/multiprocess folder of a jax checkout at the installed
version (`git show jax-vX.Y.Z:tests/multiprocess/...`; they are JAX's, not shipped
in its wheels, and not copied here).  FILE: test files in it (default: all_gather,
all_reduce, all_to_all, array, multihost_utils, pjit).  They need absl-py
(`pip install absl-py`, or PYTHONPATH to a folder holding it).

Each file runs as one job of --ranks processes with --local CPU devices each,
launched by this venv's mpiexec instead of JAX's own launcher: every process runs
the file's tests with jax._src.test_multiprocess's worker flags, and its call of
jax.distributed.initialize is mpicoll.distributed.initialize().  Once with
MPICOLL_JAX_COLLECTIVES unset (mpicoll's MPI) and once with =gloo.  Prints, per
file, the tests that pass on each, and every test that passes on gloo but not on
MPI; exits 1 if there is one.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

FILES = ("all_gather_test.py", "all_reduce_test.py", "all_to_all_test.py", "array_test.py",
         "multihost_utils_test.py", "pjit_test.py")


def worker(test_file, xml_dir, timeout, left_out):
    """One process of the job: JAX's worker branch, on mpicoll's initialize."""
    import unittest

    from mpi4py import MPI

    import mpicoll.distributed
    from jax._src import test_multiprocess

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

    def initialize(*args, **kwargs):  # JAX's coordinator address is not used
        mpicoll.distributed.initialize(initialization_timeout=timeout)

    test_multiprocess.distributed.initialize = initialize
    run = unittest.TestCase.run

    def run_unless_left_out(self, result=None):  # (--leave-out: on every process alike)
        if any(name and name in self.id() for name in left_out):
            result.startTest(self)
            result.addSkip(self, "left out (--leave-out)")
            result.stopTest(self)
            return result
        return run(self, result)

    unittest.TestCase.run = run_unless_left_out
    sys.argv = [test_file, f"--num_processes={size}", f"--multiprocess_test_worker_id={rank}",
                "--multiprocess_test_controller_address=localhost:1",
                f"--xml_output_file={xml_dir}/rank{rank}.xml"]
    sys.path.insert(0, str(Path(test_file).parent))
    import runpy

    runpy.run_path(test_file, run_name="__main__")


def results(xml_file):
    """{test id: "passed" | "failed" | "skipped"} from absltest's XML."""
    outcome = {}
    try:
        root = ElementTree.parse(xml_file).getroot()
    except (OSError, ElementTree.ParseError):  # not written: the job did not finish
        return outcome
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome[name] = "failed"
        elif case.find("skipped") is not None or case.get("result") == "suppressed":
            outcome[name] = "skipped"
        else:
            outcome[name] = "passed"
    return outcome


def run_file(path, ranks, local, transport, timeout, left_out):
    mpiexec = os.environ.get("MPICOLL_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    env = {k: v for k, v in os.environ.items() if k != "MPICOLL_JAX_COLLECTIVES"}
    if transport == "gloo":
        env["MPICOLL_JAX_COLLECTIVES"] = "gloo"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local}"
    with tempfile.TemporaryDirectory() as xml_dir:
        command = ["timeout", "-s", "KILL", str(timeout), mpiexec, "-n", str(ranks),
                   sys.executable, __file__, "--worker", str(path), xml_dir, ",".join(left_out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        per_rank = [results(Path(xml_dir) / f"rank{r}.xml") for r in range(ranks)]
    tests = set().union(*per_rank)
    # A test passes where it passed on every rank.
    outcome = {t: ("passed" if all(r.get(t) == "passed" for r in per_rank) else
                   "skipped" if all(r.get(t) == "skipped" for r in per_rank) else "failed")
               for t in tests}
    return outcome, done


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], 120, sys.argv[4].split(","))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", type=Path)
    parser.add_argument("files", nargs="*", default=FILES)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--local", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per job")
    parser.add_argument("--leave-out", action="append", default=[], metavar="NAME",
                        help="tests whose id holds NAME are skipped on both (a test that "
                        "hangs would take its file's results with it)")
    args = parser.parse_args()
    worse = []
    print(f"JAX's tests/multiprocess at {args.ranks} processes x {args.local} CPU devices")
    print(f"{'file':28}{'tests':>7}{'pass, MPI':>11}{'pass, gloo':>12}{'skipped':>9}")
    for name in args.files:
        on = {}
        for transport in ("mpi", "gloo"):
            on[transport], done = run_file(args.tests / name, args.ranks, args.local, transport,
                                           args.timeout, args.leave_out)
            if not on[transport]:
                print(f"{name}: no results on {transport} (exit {done.returncode}):\n"
                      f"{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
        tests = set(on["mpi"]) | set(on["gloo"])
        passed = {t: {k for k, v in on[t].items() if v == "passed"} for t in on}
        skipped = {k for k, v in on["gloo"].items() if v == "skipped"}
        print(f"{name:28}{len(tests):>7}{len(passed['mpi']):>11}{len(passed['gloo']):>12}"
              f"{len(skipped):>9}")
        worse += [f"{name}: {t}" for t in sorted(passed["gloo"] - passed["mpi"])]
        for t in sorted(passed["mpi"] - passed["gloo"]):
            print(f"  passes on MPI only: {t}")
    for line in worse:
        print(f"  passes on gloo, not on MPI: {line}")
    print("every test that passes on gloo passes on mpicoll's MPI" if not worse else
          f"{len(worse)} tests pass on gloo and not on mpicoll's MPI")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())

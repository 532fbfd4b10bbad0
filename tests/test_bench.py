"""benchmarks/bench.py in quick mode under `mpiexec -n 2`: every row it should report.

The driver starts MPI jobs of its own (and JAX+gloo child processes), so only the
serial suite runs it.  It must work without `make bench`'s extras: without
mpi4jax its rows say "not available" with the reason, and without matplotlib no
figure is written (--no-plot here in any case).  It builds the C floor library
itself when `make bench` has not.  Timings are not judged here (a loaded 2-core
machine), only that each is there, positive and finite, and that every
implementation's result matched numpy.
"""

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from conftest import run_mpiexec, serial_only

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"
TIMEOUT = 300  # s; ~30 s on a lightly loaded 2-core machine, more when it is shared
OPS = ("bcast", "scatter", "reduce", "allreduce", "gather", "allgather", "alltoall", "sendrecv",
       "reduce_scatter", "allreduce_rs_ag")
ALWAYS = ("c-floor", "mpicoll-jit", "mpicoll-eager", "mpi4py")
OPTIONAL = ("mpi4jax-jit", "mpi4jax-eager")  # ok, or "not available" with a reason
GLOO_OPS = ("allreduce", "allgather", "alltoall")
QUICK_SIZES = (4, 64 * 1024)
PYTREE = ("c-floor/fused", "c-floor/per-leaf", "mpi4py/per-leaf", "mpicoll-eager/fused",
          "mpicoll-eager/per-leaf", "mpicoll-jit/fused", "mpicoll-jit/per-leaf")

pytestmark = serial_only


def run_quick_benchmark(output_dir):
    """benchmarks/bench.py --quick under mpiexec -n 2 (conftest.run_mpiexec: bounded, killed whole)."""
    result = run_mpiexec(2, [sys.executable, BENCH, "--quick", "--no-plot",
                             "--output-dir", output_dir], timeout=TIMEOUT)
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("bench")
    returncode, stdout, stderr = run_quick_benchmark(output_dir)
    summary = f"exit {returncode}\n--- stdout:\n{stdout[-6000:]}\n--- stderr:\n{stderr[-6000:]}"
    assert returncode == 0, summary
    with open(output_dir / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    report = json.loads((output_dir / "bench.json").read_text())
    return dict(rows={(r["op"], r["impl"], int(r["bytes"])): r for r in rows}, report=report,
                stdout=stdout, summary=summary)


def assert_measured(row, what):
    assert row["status"] == "ok", (what, row)
    assert row["correct"] == "True", (what, "correctness guard failed", row)
    t = float(row["time_per_call_s"])
    assert math.isfinite(t) and t > 0, (what, row)
    assert int(row["k"]) >= 1 and int(row["repeats"]) >= 5, (what, row)


def test_every_collective_and_implementation_is_reported(quick_run):
    rows = quick_run["rows"]
    for op in OPS:
        for nbytes in QUICK_SIZES:
            for impl in ALWAYS:
                assert_measured(rows[(op, impl, nbytes)], (op, impl, nbytes))
            for impl in OPTIONAL:
                row = rows[(op, impl, nbytes)]
                if row["status"] == "not available":
                    assert row["note"], row  # says why
                else:
                    assert_measured(row, (op, impl, nbytes))
            gloo = rows[(op, "jax-gloo", nbytes)]
            if op in GLOO_OPS:
                assert_measured(gloo, (op, "jax-gloo", nbytes))
            else:
                assert gloo["status"] == "n/a", gloo
            assert float(rows[(op, "mpicoll-jit", nbytes)]["ratio_to_floor"]) > 0


def test_pytree_case(quick_run):
    rows = quick_run["rows"]
    for impl in PYTREE:
        assert_measured(rows[("allreduce_pytree", impl, 100 * 1024)], impl)


def test_sizes_are_per_rank_input_buffers(quick_run):
    rows = quick_run["rows"]
    # scatter/alltoall take (ranks, n) with n >= 1: at 4 B and 2 ranks, 8 B
    assert int(rows[("alltoall", "mpicoll-jit", 4)]["input_bytes"]) == 8
    assert int(rows[("alltoall", "mpicoll-jit", 65536)]["input_bytes"]) == 65536
    assert int(rows[("allreduce", "mpicoll-jit", 4)]["input_bytes"]) == 4


def test_report_and_table(quick_run):
    report, stdout = quick_run["report"], quick_run["stdout"]
    assert report["all_correct"] is True
    machine = report["machine"]
    for key in ("mpi_library", "jax", "cores", "load_average_start", "mpi4py"):
        assert machine[key], key
    assert machine["mpi4jax"] or machine["mpi4jax_unavailable_reason"]
    for op in OPS:  # one block per collective
        assert any(line.startswith(op) for line in stdout.splitlines()), op
    assert "correctness guards: all passed" in stdout

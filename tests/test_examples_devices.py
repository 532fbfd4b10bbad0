"""The multi-device examples run under `mpiexec -n 2` and report correct results.

examples/normalize.py, convolve.py, vdot.py and batched_matmul.py each run on
2 ranks x 2 fake local CPU devices (the examples set XLA_FLAGS themselves) and
print a verdict line checked here; vdot and batched_matmul get small sizes.

Only in the serial (1-rank) pytest run: these tests launch their own mpiexec,
and a subprocess of an mpiexec-launched rank would inherit that rank's launcher
environment.  (Skipping depends on the rank count, which every rank shares.)
"""

import re
import sys

import pytest

from conftest import REPO, run_mpiexec, serial_only

pytestmark = serial_only

EXAMPLES = REPO / "examples"
TIMEOUT = 300  # seconds per example run


def run_example(name, *args, ranks=2):
    """Run examples/<name> under mpiexec -n ranks; return (returncode, stdout + stderr)."""
    result = run_mpiexec(ranks, [sys.executable, EXAMPLES / name, *args], timeout=TIMEOUT)
    return result.returncode, result.output


def verdict(output, prefix):
    """The single line rank 0 prints starting with prefix."""
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, output
    return lines[0]


def test_normalize():
    rc, output = run_example("normalize.py")
    assert rc == 0, output
    line = verdict(output, "normalize: ")
    assert line.endswith("over 2 ranks x 2 devices; OK"), output
    assert abs(float(re.search(r"global sum = (\S+)", line).group(1)) - 1.0) < 1e-6, output
    assert output.count("matches numpy: True") == 2, output  # both ranks


def test_convolve():
    rc, output = run_example("convolve.py")
    assert rc == 0, output
    line = verdict(output, "convolve: ")
    assert "w = [2, 3, 4] -> [11.0, 20.0, 29.0]" in line, output
    assert line.endswith("over 2 ranks x 2 devices; OK"), output
    for participant in range(4):  # every participant reported its own rows
        assert f"participant {participant} rows" in output, output
    assert output.count("gathered rows match numpy: True") == 2, output


@pytest.mark.parametrize("rows", [100_000, 1001])  # 1001: the last piece is zero-padded
def test_vdot(rows):
    rc, output = run_example("vdot.py", "--n", str(rows))
    assert rc == 0, output
    line = verdict(output, "vdot: ")
    assert line.startswith(f"vdot: ({rows}, 3) float32 over 2 ranks x 2 devices"), output
    assert line.endswith("OK"), output
    distributed = float(re.search(r"devices = (\S+),", line).group(1))
    single = float(re.search(r"jnp.vdot = (\S+),", line).group(1))
    exact = float(re.search(r"float64 numpy = (\S+);", line).group(1))
    assert abs(distributed - single) <= 1e-6 * abs(exact), output
    assert output.count("(tolerance 1e-06): True") == 2, output


def test_batched_matmul():
    rc, output = run_example("batched_matmul.py", "--n", "256", "--repeats", "2")
    assert rc == 0, output
    assert "(8, 256, 256) @ (8, 256, 256) float32, 2 ranks x 2 devices" in output, output
    for name in ("distributed (2x2) + allgather", "numpy np.matmul", "jax jnp.matmul"):
        assert re.search(re.escape(name) + r".*\d+\.\d+ s", output), output
    assert re.search(r"speedup of distributed: \d+\.\d+x vs numpy, \d+\.\d+x vs single", output)
    assert "identical on every device: True" in output, output
    assert verdict(output, "batched_matmul: results") == "batched_matmul: results match numpy: OK"


def test_batched_matmul_rejects_an_uneven_batch():
    rc, output = run_example("batched_matmul.py", "--batch", "6", "--n", "64")
    assert rc != 0
    assert "--batch 6 must be divisible by size * local devices = 2 * 2" in output, output

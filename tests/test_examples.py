"""Every example in examples/ runs under `mpiexec -n 2` and prints what it promises.

Each example checks its own result (against numpy or a single-process run) and
exits non-zero if it is wrong; these tests also read its output.  They run the
examples as separate MPI jobs (conftest.run_mpiexec: the venv's mpiexec, with
what the MPI needs here), so only the serial run (plain pytest) runs them.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_mpiexec, serial_only

EXAMPLES = REPO / "examples"
RANKS = 2
TIMEOUT = 300  # s; two ranks compiling on a 2-core CI machine


def check_demo(out):
    assert "demo: all ranks match numpy" in out
    assert out.count("matches numpy: True") == RANKS


def check_data_parallel_mlp(out):
    losses = [float(x) for x in re.findall(r"^epoch +\d+/\d+ +loss ([\d.]+)$", out, re.M)]
    assert len(losses) == 20, out  # one line per epoch, from rank 0 only
    assert losses[-1] < 0.5 * losses[0], losses
    assert f"on {RANKS} rank(s): decreased" in out
    assert "parameters identical on every rank: True" in out
    difference = float(re.search(r"single-process training: ([\d.e+-]+)", out).group(1))
    assert difference < 1e-4
    assert "data_parallel_mlp: ok" in out


def check_heat_equation(out):
    assert f"{RANKS} rank(s) x {96 // RANKS} rows" in out
    error = float(re.search(r"max error vs single-process numpy: ([\d.e+-]+)", out).group(1))
    assert error < 1e-12
    assert "heat_equation: ok" in out


def check_mpi4jax_port(out):
    assert f"mpi4jax_port: {RANKS} rank(s) x 32 points" in out
    error = float(re.search(r"max error vs one process ([\d.e+-]+)", out).group(1))
    assert error < 1e-5
    assert "mpi4jax_port: ok" in out


def check_overlap_training(out):
    assert f"overlap_training: {RANKS} rank(s)" in out
    for name in ("overlapped", "synchronous", "no communication"):
        assert re.search(rf"step +{name}: +[\d.]+ ms", out), out
    assert "overlapped and synchronous parameters equal: True; identical on every rank: True" \
        in out
    difference = float(re.search(r"single-process training: ([\d.e+-]+)", out).group(1))
    assert difference < 1e-4
    assert "overlap_training: ok" in out


def check_train_sharded_optax(out, devices=1, way="ranks"):
    assert f"train_sharded_optax: {RANKS} rank(s) x {devices} device(s), way {way}" in out, out
    # The flax nnx variant runs wherever flax is importable (it is optional: CI has optax only).
    models = ["optax"] + (["flax nnx"] if importlib.util.find_spec("flax") else [])
    if len(models) == 1:
        assert "flax nnx: skipped (flax is not installed" in out, out
    for model in models:
        first, last = map(float, re.search(
            rf"^{model}: loss ([\d.]+) -> ([\d.]+) over 200 steps", out, re.M).groups())
        assert last < 0.5 * first, out
        assert f"{model}: parameters identical on every rank: True" in out, out
        # Rank 0's one-process reference: the same optax (or nnx) training on whole batches,
        # plain JAX on one device; float32 sums in another order, over 200 Adam steps.
        parameters, losses = map(float, re.search(
            rf"^{model}: max \|difference\| from one-process training: ([\d.e+-]+) "
            r"\(parameters and optimizer state\), ([\d.e+-]+) \(losses\)", out, re.M).groups())
        assert parameters < 1e-5 and losses < 1e-5, out
    assert "train_sharded_optax: OK" in out, out


def test_mpi4jax_port_differs_from_an_mpi4jax_program_by_its_import_only():
    code = (EXAMPLES / "mpi4jax_port.py").read_text().split('"""', 2)[2]  # after the docstring
    assert [line for line in code.splitlines() if "mpicoll" in line] == [
        "import mpicoll.mpi4jax as mpi4jax  # was: import mpi4jax"]


# The examples run here and the check of each one's output.  A new example needs
# an entry here or a test elsewhere in tests/ that names it
# (test_every_example_is_tested fails until it has one).
CHECKS = {
    "demo.py": check_demo,
    "data_parallel_mlp.py": check_data_parallel_mlp,
    "heat_equation.py": check_heat_equation,
    "mpi4jax_port.py": check_mpi4jax_port,
    "overlap_training.py": check_overlap_training,
    "train_sharded_optax.py": check_train_sharded_optax,  # its default: --way ranks, 1 device
}


def test_every_example_is_tested():
    others = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py")
                     if p.name != Path(__file__).name)
    untested = [p.name for p in EXAMPLES.glob("*.py")
                if p.name not in CHECKS and f'"{p.name}"' not in others]
    assert not untested, f"examples without a test: {untested}"


@serial_only
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_example_under_mpiexec(name):
    result = run_mpiexec(RANKS, [sys.executable, EXAMPLES / name], timeout=TIMEOUT)
    print(result.stdout, result.stderr, sep="\n")
    assert result.returncode == 0, result.summary()
    CHECKS[name](result.stdout)


@serial_only
def test_train_sharded_optax_on_a_global_mesh_of_two_devices_per_rank():
    # The other way to place the collective (the sharded jit's own all-reduce after
    # mpicoll.distributed.initialize()), at 2 ranks x 2 devices: one job for both.
    result = run_mpiexec(RANKS, [sys.executable, EXAMPLES / "train_sharded_optax.py",
                                 "--way", "global", "--devices", "2"], timeout=TIMEOUT)
    print(result.stdout, result.stderr, sep="\n")
    assert result.returncode == 0, result.summary()
    check_train_sharded_optax(result.stdout, devices=2, way="global")

"""Every example in examples/ runs under `mpiexec -n 2` and prints what it promises.

Each example checks its own result (against numpy or a single-process run) and
exits non-zero if it is wrong; these tests also read its output.  They run the
examples as separate MPI jobs, so only the serial run (plain pytest) runs them.
The mpiexec is the one next to this Python (the venv's), through
launch/mpirun.sh, which adds what the MPI needs here (running as root,
oversubscription).
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RANKS = 2
TIMEOUT = 300  # s; two ranks compiling on a 2-core CI machine


def run_mpi(args, ranks=RANKS, timeout=TIMEOUT, env_extra=None):
    """Run `python args...` on `ranks` ranks; returns the CompletedProcess (output as text).

    Its own process group, so that a timeout takes down mpiexec and every rank.
    """
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("runs MPI jobs of its own: only from the serial suite")
    # Nothing of this process's own MPI (singleton) or of a launcher around the
    # test run leaks into the job's launcher.
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI4PY_", "OMPI_COMM_WORLD_"))}
    env.update(MPICOLL_VENV=sys.prefix, **(env_extra or {}))
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if mpiexec.exists():
        env["MPICOLL_MPIEXEC"] = str(mpiexec)
    command = [str(ROOT / "launch" / "mpirun.sh"), "-n", str(ranks), sys.executable, *args]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish in {timeout} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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


# The examples run here and the check of each one's output.  A new example needs
# an entry here or a test elsewhere in tests/ that names it
# (test_every_example_is_tested fails until it has one).
CHECKS = {
    "demo.py": check_demo,
    "data_parallel_mlp.py": check_data_parallel_mlp,
    "heat_equation.py": check_heat_equation,
}


def test_every_example_is_tested():
    others = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py")
                     if p.name != Path(__file__).name)
    untested = [p.name for p in EXAMPLES.glob("*.py")
                if p.name not in CHECKS and f'"{p.name}"' not in others]
    assert not untested, f"examples without a test: {untested}"


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_example_under_mpiexec(name):
    result = run_mpi([str(EXAMPLES / name)])
    print(result.stdout, result.stderr, sep="\n")
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    CHECKS[name](result.stdout)

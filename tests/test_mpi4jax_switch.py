"""MPICOLL_AS_MPI4JAX: mpi4jax applications run unchanged, those of the token era too.

With the variable on, `import mpi4jax` in any Python process of the venv gives
mpicoll.mpi4jax (the .pth file the install puts in site-packages); off, nothing
changes and an installed mpi4jax is what Python finds.  A program written for
mpi4jax <= 0.7 (tests/programs/mpi4jax_tokens.py) runs through a plain
`import mpi4jax` at 2 ranks (launched by launch/mpirun.sh --as-mpi4jax) and 3
(the variable in the environment), against numpy.
"""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import _mpicoll_as_mpi4jax as switch
from conftest import MPIEXEC, REPO, environment_outside_the_job, run_mpiexec, serial_only
from mpicoll._src.runtime import settings

PROGRAM = REPO / "tests" / "programs" / "mpi4jax_tokens.py"
MPIRUN = REPO / "launch" / "mpirun.sh"


def _require_pth():
    """The switch works through the .pth file `make install` puts in site-packages."""
    pth = Path(sysconfig.get_paths()["purelib"]) / switch.PTH
    assert pth.is_file(), f"{pth} is missing: run `make install` (setup.py installs it)"


def _env(**extra):
    """This environment without a launcher's variables or the switch, plus `extra`."""
    env = environment_outside_the_job(standalone=True)
    env.pop(switch.VARIABLE, None)
    env.update(extra)
    return env


@pytest.mark.parametrize("raw", ["", "0", "1", "yes", "off", " False ", "on"])
def test_the_switch_reads_the_variable_as_settings_do(raw):
    values, _ = settings.from_environment({switch.VARIABLE: raw})
    assert switch.enabled({switch.VARIABLE: raw}) is values.as_mpi4jax


def test_a_value_that_is_neither_on_nor_off_stops_the_import():
    # The .pth file cannot raise at start-up (it would break every Python of the
    # venv); `import mpicoll` refuses the value with the settings' rule.
    with pytest.raises(ValueError, match="MPICOLL_AS_MPI4JAX='2' must be on"):
        settings.from_environment({switch.VARIABLE: "2"})


@serial_only
def test_token_era_program_at_3_ranks_through_import_mpi4jax():
    _require_pth()
    run = run_mpiexec(3, [sys.executable, PROGRAM], env={switch.VARIABLE: "1"}, timeout=240)
    assert run.returncode == 0, run.summary()
    assert "mpi4jax_tokens: ok at 3 ranks" in run.stdout, run.summary()
    assert run.stdout.count("last token _Token, 0 mismatch(es)") == 3, run.summary()


@serial_only
def test_token_era_program_at_2_ranks_launched_with_as_mpi4jax():
    _require_pth()
    if MPIEXEC is None:
        pytest.skip("no mpiexec to launch with")
    env = _env(MPICOLL_VENV=sys.prefix, MPICOLL_MPIEXEC=str(MPIEXEC),
               MPICOLL_LAUNCH_TIMEOUT="200")
    result = subprocess.run([str(MPIRUN), "--as-mpi4jax", "-n", "2", sys.executable, PROGRAM],
                            capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mpi4jax_tokens: ok at 2 ranks" in result.stdout, result.stdout + result.stderr


@serial_only
def test_the_switch_is_off_by_default_and_leaves_an_installed_mpi4jax_alone(tmp_path):
    """A fake mpi4jax on PYTHONPATH stands for an installed one: found when the switch
    is off (unset or 0), never started by it; mpicoll's wins when it is on."""
    _require_pth()
    fake = tmp_path / "mpi4jax"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "fake"\n')
    probe = ("import sys; started = [m for m in ('jax', 'mpicoll', '_mpicoll_as_mpi4jax') "
             "if m in sys.modules]; import mpi4jax; "
             "print(mpi4jax.__version__, mpi4jax.__name__, started)")

    def probe_with(**extra):
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=_env(PYTHONPATH=str(tmp_path), **extra))

    for off in ({}, {switch.VARIABLE: "0"}):
        result = probe_with(**off)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["fake", "mpi4jax", "[]"], (off, result.stdout)
    on = probe_with(**{switch.VARIABLE: "1"})
    assert on.returncode == 0, on.stderr
    # On: only the small finder module is imported at start-up, mpicoll when mpi4jax is.
    assert on.stdout.split() == ["0.9.1", "mpicoll.mpi4jax", "['_mpicoll_as_mpi4jax']"], on.stdout


@serial_only
def test_import_mpi4jax_gives_the_module_itself_and_info_says_so():
    _require_pth()
    # find_spec before the import, as a library asking whether mpi4jax is there does.
    check = ("import importlib.util; "
             "assert importlib.util.find_spec('mpi4jax').origin == 'mpicoll.mpi4jax'; "
             "import mpi4jax, mpicoll.mpi4jax; "
             "assert mpi4jax is mpicoll.mpi4jax; assert mpi4jax.has_sycl_support() is False; "
             "assert isinstance(mpi4jax.has_cuda_support(), bool); "
             "print(mpi4jax.__version__, sorted(mpi4jax.__all__) == sorted(set(mpi4jax.__all__)))")
    on = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                        timeout=120, cwd=REPO, env=_env(**{switch.VARIABLE: "1"}))
    assert on.returncode == 0 and on.stdout.split() == ["0.9.1", "True"], on.stdout + on.stderr
    info = subprocess.run([sys.executable, "-m", "mpicoll", "info"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=_env(**{switch.VARIABLE: "1"}))
    assert info.returncode == 0, info.stdout + info.stderr
    line = next(line for line in info.stdout.splitlines() if "as_mpi4jax" in line)
    assert "True" in line and "import mpi4jax gives mpicoll.mpi4jax" in line, line


@serial_only
def test_mpirun_sh_as_mpi4jax_sets_the_variable_and_forwards_it_for_open_mpi(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "$FAKE_VERSION"; exit 0; fi\n'
                    'echo "args: $*"\necho "switch: ${MPICOLL_AS_MPI4JAX:-unset}"\n')
    fake.chmod(0o755)

    def launch(version, *args):
        env = _env(MPICOLL_VENV=sys.prefix, MPICOLL_MPIEXEC=str(fake), FAKE_VERSION=version)
        return subprocess.run([str(MPIRUN), *args], capture_output=True, text=True, timeout=60,
                              env=env).stdout

    ompi = launch("mpiexec (Open MPI) 5.0.11", "--as-mpi4jax", "-n", "1", "python", "app.py")
    assert "args: -x MPICOLL_AS_MPI4JAX -n 1 python app.py" in ompi, ompi
    assert "switch: 1" in ompi, ompi
    mpich = launch("HYDRA build details:", "--as-mpi4jax", "-n", "1", "python", "app.py")
    assert "args: -n 1 python app.py" in mpich and "switch: 1" in mpich, mpich
    plain = launch("HYDRA build details:", "-n", "1", "python", "app.py")
    assert "switch: unset" in plain, plain


@serial_only
def test_token_cost_benchmark_runs_and_reports_the_ratios(tmp_path):
    """benchmarks/token_cost.py (make bench) at 2 ranks, briefly: every row, a ratio for
    each, the verdict on the 1.2x limit (the timings themselves are make bench's)."""
    output = tmp_path / "token_cost.json"
    run = run_mpiexec(2, [sys.executable, REPO / "benchmarks" / "token_cost.py", "--runs", "1",
                          "--calls", "50", "--output", output], timeout=240)
    assert run.returncode == 0, run.summary()
    report = json.loads(output.read_text())
    assert set(report["rows"]) == {
        "kernel", "kernel + mpicoll's token", "kernel + empty bool array", "kernel + JAX token",
        "sendrecv kernel", "sendrecv kernel + mpicoll's token", "sendrecv kernel + JAX token"}
    assert all(row["us_per_call"] > 0 for row in report["rows"].values())
    assert "mpicoll's token: at most" in run.stdout and "limit 1.2x" in run.stdout, run.summary()

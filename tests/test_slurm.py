"""launch/slurm.sbatch on a real SLURM: a one-node cluster on localhost, jobs submitted with sbatch.

The session fixture brings up munged, slurmctld and slurmd (launch/local_slurm.sh,
Debian's slurm-wlm with 2 CPUs; about 2 s), the tests submit the batch template
unchanged and check the job's output file, and the daemons are torn down at the
end.  Where SLURM is not installed and cannot be (not root, no apt), the tests
skip and say why (`pytest -rs` prints it).

Only the serial run (plain pytest) runs these: under mpiexec every rank would
start its own cluster.
"""

import os
import shutil
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
JOB_TIMEOUT = 300  # s for one job, queueing included (compiling on 2 busy cores is slow)
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


# The daemons are in /usr/sbin, which is not on every PATH; the scripts add it too.
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"


def _missing_tools():
    return [tool for tool in TOOLS if shutil.which(tool, path=SEARCH_PATH) is None]


def _skip(reason):
    print(f"test_slurm: SKIPPED: {reason}", file=sys.stderr, flush=True)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm():
    """A running one-node SLURM: yields the environment its clients and jobs need."""
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("SLURM test runs from the serial suite")
    if os.geteuid() != 0:
        _skip("needs root: slurmd runs as root to start jobs")
    if _missing_tools():
        # launch/install_slurm.sh is what CI runs; here it tries once more, and
        # exits 0 with a reason when it cannot install.
        result = subprocess.run([str(LAUNCH / "install_slurm.sh")], capture_output=True,
                                text=True, timeout=900)
        if _missing_tools():
            _skip(f"SLURM is not installed ({', '.join(_missing_tools())} missing) and "
                  f"could not be: {(result.stdout + result.stderr).strip()[-500:]}")

    # Not under pytest's private temp dir: the munge user must reach its socket.
    workdir = Path(tempfile.mkdtemp(prefix="mpicoll-slurm-", dir="/tmp"))
    started = time.monotonic()
    try:
        # Our pid: should this process be killed before the teardown, the cluster
        # stops by itself.
        start = subprocess.run([str(LAUNCH / "local_slurm.sh"), "start", str(workdir),
                                str(os.getpid())],
                               capture_output=True, text=True, timeout=120)
        assert start.returncode == 0, f"local SLURM did not start:\n{start.stdout}{start.stderr}"
        print(f"local SLURM up in {time.monotonic() - started:.1f} s in {workdir}", flush=True)
        env = dict(os.environ, SLURM_CONF=str(workdir / "slurm.conf"),
                   MPICOLL_VENV=sys.prefix,      # the jobs use the venv running these tests
                   PATH=f"{Path(sys.executable).parent}:{SEARCH_PATH}")
        # A SLURM job of our own around the tests (e.g. CI inside an allocation)
        # would be inherited by sbatch and confuse it.
        for name in list(env):
            if name.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and name != "SLURM_CONF":
                del env[name]
        yield {"env": env, "dir": workdir}
    finally:
        subprocess.run([str(LAUNCH / "local_slurm.sh"), "stop", str(workdir)],
                       capture_output=True, timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)


def _job_field(job_id, env, field):
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True, env=env, timeout=30).stdout
    for item in out.split():
        if item.startswith(field + "="):
            return item.split("=", 1)[1]
    return None


def submit(slurm, *args, env=None):
    """sbatch launch/slurm.sbatch args on 2 tasks, wait (bounded): (state, exit code, output)."""
    output = slurm["dir"] / "job-%j.out"
    env = dict(slurm["env"], **(env or {}))
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
         f"--output={output}", str(LAUNCH / "slurm.sbatch"), *args],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    state = None
    while time.monotonic() < deadline:
        state = _job_field(job_id, env, "JobState")
        if state in TERMINAL_STATES:
            break
        time.sleep(0.5)
    else:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
        pytest.fail(f"job {job_id} not finished after {JOB_TIMEOUT} s (state {state})")
    text = Path(str(output).replace("%j", job_id)).read_text()
    print(f"--- job {job_id} ({' '.join(args) or 'default'}): {state}, output:\n{text}", flush=True)
    return state, _job_field(job_id, env, "ExitCode"), text


def _mpi_is_open_mpi():
    return MPI.get_vendor()[0] == "Open MPI"


def test_template_runs_the_mlp_example_on_two_tasks(slurm):
    """The template as written, default command: the data-parallel example, 2 ranks."""
    state, exit_code, text = submit(slurm)
    assert state == "COMPLETED" and exit_code == "0:0", text
    assert "2 task(s)" in text
    assert "on 2 rank(s): decreased" in text
    assert text.count("loss") >= 20  # every epoch printed
    assert "data_parallel_mlp: ok" in text


def test_template_ranks_agree_with_slurm(slurm):
    """python -m mpicoll info in the job: 2 ranks on one node, SLURM's and PMI's variables agree."""
    state, exit_code, text = submit(slurm, "-m", "mpicoll", "info")
    assert state == "COMPLETED" and exit_code == "0:0", text
    assert "ranks:         2 on 1 node(s)" in text
    assert "PROBLEMS" not in text
    assert "allreduce over 2 rank(s) inside jax.jit: ok" in text
    if not _mpi_is_open_mpi():  # launched by srun: SLURM's task variables are the ranks
        assert "launcher srun" in text
        assert "SLURM_PROCID" in text and "PMI_RANK" in text


def test_template_with_mpiexec_inside_the_allocation(slurm):
    """MPICOLL_SLURM_LAUNCHER=mpiexec: the venv's mpiexec takes the allocation from SLURM."""
    state, exit_code, text = submit(slurm, "examples/heat_equation.py",
                                    env={"MPICOLL_SLURM_LAUNCHER": "mpiexec"})
    assert state == "COMPLETED" and exit_code == "0:0", text
    assert "launcher mpiexec" in text
    assert "2 rank(s) x 48 rows" in text
    assert "heat_equation: ok" in text


def test_a_global_mesh_program_in_a_batch_job(slurm):
    """mpicoll.distributed.initialize() under srun: a global-mesh program on mpicoll."""
    state, exit_code, text = submit(slurm, "examples/jax_vocabulary.py", "global")
    assert state == "COMPLETED" and exit_code == "0:0", text
    assert "global: matches numpy: True" in text


def test_a_job_past_its_launch_timeout_says_where_every_rank_is(slurm):
    """MPICOLL_LAUNCH_TIMEOUT: rank 1 sleeps while rank 0 waits in an allreduce; at the
    limit every rank is asked where it is (launch/time_limit.sh), then the job ends."""
    state, exit_code, text = submit(slurm, "tests/programs/stall.py", "late", "300",
                                    env={"MPICOLL_LAUNCH_TIMEOUT": "15",
                                         "MPICOLL_STALL_REPORT": "0"})
    assert state == "FAILED" and exit_code == "124:0", text
    assert "MPICOLL_LAUNCH_TIMEOUT=15 s reached; where the ranks are:" in text, text
    assert re.search(r"  rank 0 \(.*\): in allreduce\(float32\[4\], op=sum\) on MPI_COMM_WORLD",
                     text), text
    assert re.search(r"  rank 1 \(.*\): not in an mpicoll collective for [\d.]+ s\n"
                     r"    Python, main thread \(innermost first\):\n"
                     r"      .*stall\.py:\d+ in <module>: time\.sleep\(SLEEP\)", text), text


def test_plain_srun_is_caught(slurm):
    """srun without --mpi=pmi2 starts independent 1-rank jobs; `mpicoll info` says so and fails."""
    if _mpi_is_open_mpi():
        pytest.skip("the PMI-2 mistake concerns MPICH; Open MPI is launched with mpiexec")
    result = subprocess.run(["srun", "--ntasks=2", "--mpi=none", sys.executable, "-m", "mpicoll",
                             "info"], cwd=ROOT, capture_output=True, text=True,
                            env=slurm["env"], timeout=JOB_TIMEOUT)
    print(result.stdout, result.stderr, flush=True)
    assert result.returncode != 0
    assert result.stdout.count("srun started 2 tasks, but MPI sees a single rank") == 2

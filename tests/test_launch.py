"""mpicoll.topology, `python -m mpicoll info` and launch/mpirun.sh.

The topology tests run in every suite (serial and under mpiexec with any rank
count): they compare MPI's view with the hostnames of all ranks and with the
variables of whatever launcher started the test run.  The launcher tests start
MPI jobs or fake mpiexecs of their own, so they run from the serial suite only.
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mpicoll import topology
from mpicoll.__main__ import main
from conftest import MPIEXEC, RANK, serial_only

ROOT = Path(__file__).resolve().parent.parent
MPIRUN = ROOT / "launch" / "mpirun.sh"
WORLD = MPI.COMM_WORLD


# ---------------------------------------------------------------------------
# topology: every suite.

def test_topology_matches_mpi_and_hostnames():
    t = topology.topology()
    hosts = WORLD.allgather(MPI.Get_processor_name())
    assert (t.rank, t.size) == (WORLD.Get_rank(), WORLD.Get_size())
    same_host = [r for r, h in enumerate(hosts) if h == hosts[t.rank]]
    assert t.local_size == len(same_host)
    assert t.local_rank == same_host.index(t.rank)
    assert t.node_count == len(set(hosts))
    assert 0 <= t.node < t.node_count
    assert t.hostname == hosts[t.rank]


def test_topology_of_a_subcommunicator():
    sub = WORLD.Split(WORLD.Get_rank() % 2, WORLD.Get_rank())
    try:
        t = topology.topology(sub)
        hosts = sub.allgather(MPI.Get_processor_name())
        assert (t.rank, t.size) == (sub.Get_rank(), sub.Get_size())
        assert t.local_size == hosts.count(hosts[t.rank])
        assert t.node_count == len(set(hosts))
    finally:
        sub.Free()


def test_world_topology_is_cached_and_agrees_with_this_launcher():
    assert topology.world() is topology.world()
    check = topology.cross_check()
    assert check.ok, check.problems
    if WORLD.Get_size() > 1:  # every launcher we run under sets something comparable
        assert check.compared


# ---------------------------------------------------------------------------
# cross_check with launchers' variables as they set them (no MPI traffic).

def _topo(rank=0, size=2, local_rank=0, local_size=2, node=0, node_count=1):
    return topology.Topology(rank, size, local_rank, local_size, node, node_count, "host")


def test_cross_check_hydra_consistent():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    check = topology.cross_check(_topo(rank=1, local_rank=1), env)
    assert check.ok and set(check.compared) == set(env)


def test_cross_check_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    # Open MPI may order a node's ranks otherwise than MPI's rank order: fine.
    check = topology.cross_check(_topo(rank=3, size=4, local_rank=0, local_size=2), env)
    assert check.ok, check.problems
    assert check.local_ranks == (("OMPI_COMM_WORLD_LOCAL_RANK", 1),)
    # A rank or a node size that differs is not.
    check = topology.cross_check(_topo(rank=2, size=4, local_rank=0, local_size=3), env)
    assert check.problems == ("OMPI_COMM_WORLD_RANK=3 (Open MPI's mpirun) but MPI says 2",
                              "OMPI_COMM_WORLD_LOCAL_SIZE=2 (Open MPI's mpirun) but MPI says 3")
    check = topology.cross_check(_topo(rank=3, size=4, local_rank=0, local_size=1), env)
    assert len(check.problems) == 2 and "MPI sees 1 rank(s) on this node" in check.problems[0]


def test_info_catches_duplicate_local_ranks():
    from mpicoll._info_report import duplicate_local_ranks
    reports = [{"topology": _topo(rank=r, local_rank=r), "local_ranks": (("MPI_LOCALRANKID", v),)}
               for r, v in ((0, 0), (1, 0))]
    assert duplicate_local_ranks(reports) == [
        "node 0: MPI_LOCALRANKID values [0, 0] are not distinct"]
    reports[1]["local_ranks"] = (("MPI_LOCALRANKID", 1),)
    assert duplicate_local_ranks(reports) == []


def test_info_reports_settings_that_differ_between_ranks():
    from mpicoll._info_report import settings_lines
    settings = [("check", "first-run", "default"), ("timeout", 0.0, "default")]
    reports = [{"topology": _topo(rank=r, local_rank=r), "settings": list(settings)}
               for r in range(3)]
    lines, problems = settings_lines(reports)
    assert problems == [] and lines[1].split() == ["check", "first-run", "default"]
    reports[2]["settings"][0] = ("check", "off", "MPICOLL_CHECK=0")
    _, problems = settings_lines(reports)
    assert problems == ["setting check differs from rank 0's (first-run) on rank(s) 2: ranks "
                        "that disagree on it can hang or fail"]


def test_cross_check_foreign_mpiexec():
    """An mpiexec of another MPI: N processes, each a singleton."""
    check = topology.cross_check(_topo(size=1, local_size=1), {"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert len(check.problems) == 1
    assert "different MPI" in check.problems[0] and "launch/mpirun.sh" in check.problems[0]


def test_cross_check_srun_without_pmi2():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1"}
    check = topology.cross_check(_topo(size=1, local_size=1), env)
    assert len(check.problems) == 1 and "srun --mpi=pmi2" in check.problems[0]


def test_cross_check_srun_consistent():
    env = {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
           "PMI_RANK": "3", "PMI_SIZE": "4"}
    check = topology.cross_check(_topo(rank=3, size=4, local_rank=1, node=1, node_count=2), env)
    assert check.ok, check.problems
    assert {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_NODES",
            "SLURM_STEP_TASKS_PER_NODE[1]"} <= set(check.compared)


def test_cross_check_mpiexec_inside_allocation():
    """hydra started by srun, one proxy per node: SLURM_PROCID is the proxy's, not compared."""
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0",
           "PMI_RANK": "1", "PMI_SIZE": "2"}
    check = topology.cross_check(_topo(rank=1, local_rank=1), env)
    assert check.ok and "SLURM_PROCID" not in check.compared
    assert check.notes and "not compared" in check.notes[0]


def test_expand_tasks_per_node():
    assert topology._expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert topology._expand_tasks_per_node("4") == [4]


# ---------------------------------------------------------------------------
# python -m mpicoll

def test_main_dispatch(capsys):
    # Usage and a wrong command are the job's messages: rank 0 prints them, once.
    assert main([]) == 2 and ("usage" in capsys.readouterr().out) == (RANK == 0)
    assert main(["--help"]) == 0
    assert main(["no-such-command"]) == 2
    assert ("unknown command" in capsys.readouterr().err) == (RANK == 0)


@serial_only
def test_info_serial():
    result = subprocess.run([sys.executable, "-m", "mpicoll", "info"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "MPI_THREAD_MULTIPLE" in result.stdout
    assert "ranks:         1 on 1 node(s)" in result.stdout
    assert "jax " in result.stdout and "cpu" in result.stdout
    # The MPI builds: mpicoll's extension, mpi4py's library, CUDA-awareness.
    from mpicoll._src.runtime.native import extension
    built = extension.build_info()
    vendor, version = MPI.get_vendor()
    assert (f"built with:    {built['mpi_vendor']} "
            f"{'.'.join(map(str, built['mpi_version']))} (mpicoll's extension)") in result.stdout
    assert f"mpi4py loads:  {vendor} {'.'.join(map(str, version))} (" in result.stdout
    cuda = {True: "yes", False: "no", None: "unknown"}[extension.cuda_aware_mpi()]
    assert f"CUDA-aware:    {cuda}" in result.stdout


@serial_only
def test_info_shows_every_setting_and_where_it_came_from():
    env = {**os.environ, "MPICOLL_CHECK": "1", "MPICOLL_SPLIT_ALLREDUCE_BYTES": "4KiB",
           "MPICOLL_DISPATCH": "", "MPICOLL_TIMEOUT": "", "MPICOLL_STALL_REPORT": "2min",
           "MPICOLL_TIMOUT": "10"}
    result = subprocess.run([sys.executable, "-m", "mpicoll", "info"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    settings_and_changes = result.stdout.split("settings:", 1)[1].split("per rank:")[0]
    lines = settings_and_changes.split("changes:", 1)[0].splitlines()[1:]
    # then what mpicoll changed at import (_src/install.py; tests/test_install.py)
    changes = settings_and_changes.split("changes:", 1)[1].splitlines()[1:]
    assert [line.split()[0] for line in changes[::2]][:2] == ["xla-cpu-pool", "ffi-targets"], changes
    # A variable nothing reads: the import warned, and info names it under the settings.
    assert lines[-1] == "  MPICOLL_TIMOUT is set but mpicoll reads no such variable; did you " \
        "mean MPICOLL_TIMEOUT?", lines
    assert "MPICOLL_TIMOUT is not a variable mpicoll reads" in result.stderr
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in lines[:-1]}
    import dataclasses
    from mpicoll._src.runtime import settings
    assert set(rows) == {f.name for f in dataclasses.fields(settings.Settings)}
    assert rows["check"] == ["every-call", "MPICOLL_CHECK=1"]
    assert rows["split_allreduce_bytes"] == ["4096", "MPICOLL_SPLIT_ALLREDUCE_BYTES=4KiB"]
    assert rows["timeout"] == ["600.0", "default"]
    assert rows["stall_report"] == ["120.0", "MPICOLL_STALL_REPORT=2min"]
    assert rows["dispatch"][0] in ("device-order", "tokens")
    # Where the job's files go (docs/security.md): this user's private folder.
    files = result.stdout.split("files:", 1)[1].split("per rank:")[0]
    root = os.path.join(tempfile.gettempdir(), f"mpicoll-{os.geteuid()}")
    assert f"private folder: {root} (this user's, 0700" in files, files
    assert f"stacks report:  {root}/stacks-<pid>.txt" in files, files


def test_cuda_aware_mpi_is_known_for_mpich_4_and_open_mpi():
    """MPICH >= 4 (MPIX_GPU_query_support) and Open MPI (mpi-ext.h) can say; a bool, then."""
    from mpicoll._src.runtime.native import extension
    answer = extension.cuda_aware_mpi()
    vendor, version = MPI.get_vendor()
    if vendor == "Open MPI" or (vendor == "MPICH" and version >= (4, 0)):
        assert isinstance(answer, bool), answer
    else:
        assert answer in (True, False, None), answer


# ---------------------------------------------------------------------------
# launch/mpirun.sh, for real and with a fake mpiexec that reports what it got.

def _launch_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "MPIR_CVAR_", "SLURM_", "MPICOLL_", "PMI"))}
    env["MPICOLL_VENV"] = sys.prefix
    if MPIEXEC is not None:
        env["MPICOLL_MPIEXEC"] = str(MPIEXEC)
    env.update(extra)
    return env


@serial_only
def test_mpirun_sh_runs_info_on_two_ranks():
    result = subprocess.run([str(MPIRUN), "-n", "2", sys.executable, "-m", "mpicoll", "info"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=_launch_env(MPICOLL_LAUNCH_TIMEOUT="280"))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "ranks:         2 on 1 node(s)" in out
    assert f"  {MPI.Get_processor_name()}: 2 rank(s) [0-1]" in out
    assert "all agree with MPI" in out and "PROBLEMS" not in out
    assert "allreduce over 2 rank(s) inside jax.jit: ok" in out
    assert len(re.findall(r"^  rank \d+ .* jax ", out, re.MULTILINE)) == 2  # one line per rank


FAKE_MPIEXEC = """#!/bin/sh
if [ "$1" = --version ]; then echo "$FAKE_VERSION"; exit 0; fi
echo "args: $*"
echo "root: ${OMPI_ALLOW_RUN_AS_ROOT:-}/${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-}"
echo "yield: ${MPIR_CVAR_ENABLE_HEAVY_YIELD:-}"
[ -n "${FAKE_SLEEP:-}" ] && exec sleep "$FAKE_SLEEP"
exit 0
"""
OPEN_MPI = "mpiexec (Open MPI) 5.0.11"
MPICH = "HYDRA build details:\n    Version: 5.0.2"


@pytest.fixture
def fake_mpiexec(tmp_path):
    path = tmp_path / "mpiexec"
    path.write_text(FAKE_MPIEXEC)
    path.chmod(0o755)
    return path


def _fake_run(fake, version, *args, **extra):
    env = _launch_env(MPICOLL_MPIEXEC=str(fake), FAKE_VERSION=version, **extra)
    return subprocess.run([str(MPIRUN), *args], capture_output=True, text=True, timeout=60,
                          env=env)


CORES = len(os.sched_getaffinity(0))


@serial_only
def test_mpirun_sh_open_mpi_flags(fake_mpiexec):
    over = _fake_run(fake_mpiexec, OPEN_MPI, "-n", str(CORES + 1), "python", "x.py")
    assert over.returncode == 0, over.stderr
    assert f"args: --oversubscribe -n {CORES + 1} python x.py" in over.stdout
    if os.geteuid() == 0:
        assert "root: 1/1" in over.stdout
    fits = _fake_run(fake_mpiexec, OPEN_MPI, "-np", "1", "python", "x.py")
    assert "args: -np 1 python x.py" in fits.stdout
    # Inside an allocation the scheduler decides the slots: no --oversubscribe.
    slurm = _fake_run(fake_mpiexec, OPEN_MPI, "-n", str(CORES + 1), "python", SLURM_JOB_ID="7")
    assert "--oversubscribe" not in slurm.stdout


@serial_only
def test_mpirun_sh_mpich_flags(fake_mpiexec):
    over = _fake_run(fake_mpiexec, MPICH, "-n", str(CORES + 1), "python", "x.py")
    assert f"args: -n {CORES + 1} python x.py" in over.stdout
    assert "yield: 1" in over.stdout and "root: /" in over.stdout
    fits = _fake_run(fake_mpiexec, MPICH, "-n", "1", "python", "x.py")
    assert "yield: \n" in fits.stdout


@serial_only
def test_mpirun_sh_tags_output_on_request(fake_mpiexec):
    mpich = _fake_run(fake_mpiexec, MPICH, "-n", "1", "python", MPICOLL_LAUNCH_TAG_OUTPUT="1")
    assert "args: -prepend-rank -n 1 python" in mpich.stdout, mpich.stdout
    ompi = _fake_run(fake_mpiexec, OPEN_MPI, "-n", "1", "python", MPICOLL_LAUNCH_TAG_OUTPUT="1")
    assert "args: --tag-output -n 1 python" in ompi.stdout, ompi.stdout
    plain = _fake_run(fake_mpiexec, MPICH, "-n", "1", "python")
    assert "args: -n 1 python" in plain.stdout, plain.stdout


@serial_only
def test_mpirun_sh_timeout(fake_mpiexec):
    start = time.monotonic()
    result = _fake_run(fake_mpiexec, MPICH, "-n", "1", "python", MPICOLL_LAUNCH_TIMEOUT="1",
                       FAKE_SLEEP="30")
    assert result.returncode == 124
    assert "ended by MPICOLL_LAUNCH_TIMEOUT=1 s" in result.stderr
    assert time.monotonic() - start < 15


@serial_only
def test_a_job_that_ends_within_its_launch_limit_prints_nothing_of_the_limit():
    # The limit's watcher is ended quietly (launch/time_limit.sh): its sleep ended
    # in the foreground made bash print "Terminated" after 9 of 15 good runs.
    for _ in range(12):
        done = subprocess.run([str(ROOT / "launch" / "time_limit.sh"), "30", sys.executable,
                               "sleep", "0.1"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout + done.stderr == "", done


@serial_only
def test_a_launch_that_times_out_says_where_every_rank_is_first():
    # Rank 1 sleeps in Python while rank 0 waits in an allreduce for it, past the
    # launch's limit: before ending the job the launcher asks one of its ranks
    # where every rank is (python -m mpicoll stacks on mpiexec's process).
    program = ROOT / "tests" / "programs" / "stall.py"
    start = time.monotonic()
    result = subprocess.run([str(MPIRUN), "-n", "2", sys.executable, str(program), "late", "120"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env=_launch_env(MPICOLL_LAUNCH_TIMEOUT="8", MPICOLL_STALL_REPORT="0"))
    out = result.stdout + result.stderr
    assert result.returncode == 124 and time.monotonic() - start < 60, out
    assert "MPICOLL_LAUNCH_TIMEOUT=8 s reached; where the ranks are:" in out, out
    assert re.search(r"  rank 0 \(.*\): in allreduce\(float32\[4\], op=sum\) on MPI_COMM_WORLD, "
                     r"sequence 2, called at .*stall\.py:\d+", out), out
    assert re.search(r"  rank 1 \(.*\): not in an mpicoll collective for [\d.]+ s\n"
                     r"    Python, main thread \(innermost first\):\n"
                     r"      .*stall\.py:\d+ in <module>: time\.sleep\(SLEEP\)", out), out
    assert "ended by MPICOLL_LAUNCH_TIMEOUT=8 s" in out, out


@serial_only
def test_mpirun_sh_without_venv(tmp_path):
    env = _launch_env(MPICOLL_VENV=str(tmp_path / "missing"))
    result = subprocess.run([str(MPIRUN), "-n", "1", "true"], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 2 and "no venv" in result.stderr

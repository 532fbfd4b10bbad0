#!/usr/bin/env python3
"""A simulated multi-node MPI job on one machine, with Linux namespaces.

    launch/simcluster.py run --hosts 3 --ranks-per-host 2 -- python examples/demo.py
    launch/simcluster.py run --ranks-per-host 2,1,2 --timeout 120 -- python prog.py
    launch/simcluster.py check                 # can this machine make the namespaces?
    launch/simcluster.py kill-host --state DIR simhost1   # kill a host of a running job
    launch/simcluster.py freeze-host --state DIR simhost1 # stop (SIGSTOP) a host of a job

The cluster: one private network namespace for the whole run (only its loopback,
brought up; nothing reaches outside it), with its own PID namespace, so that
nothing of the run can outlive it.  mpiexec runs there on a login node
"simlogin" and starts its daemon on every host "simhost0", "simhost1", ...
through its own remote launcher, as it would with ssh: the launcher program is
launch/simcluster-agent.sh, which makes the host -- a UTS namespace (own
hostname), a mount namespace (own /dev/shm) and a PID namespace -- instead of
logging in.  /etc/hosts (bind-mounted in the cluster's mount namespace) maps
every name to its own loopback address, 127.0.2.x.

So MPI sees several nodes: ranks of one host share memory, ranks of different
hosts talk TCP over the namespace's loopback (Open MPI's TCP transports skip
the loopback interface unless told to use it; this script tells them).
Supported launchers: MPICH's hydra (PyPI wheel, Debian) and Open MPI 4's orterun.

Without namespaces (a container that refuses unshare) `check` exits 77 with
the reason, which is what the tests skip on.  Everything is bounded: mpiexec is
terminated after --timeout seconds (exit 124), and whatever is left of the
cluster dies with its PID namespace when this script ends.  Only the Python
standard library and util-linux (unshare, mount) are needed.
"""

import argparse
import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
AGENT = HERE / "simcluster-agent.sh"
LOGIN = "simlogin"
SKIP = 77  # exit status of `check` when namespaces are refused (automake's "skipped")
# Namespaces of the cluster (network, hostname, mounts, processes) and of each host.
CLUSTER_NAMESPACES = ["--net", "--uts", "--mount", "--pid", "--fork", "--kill-child",
                      "--mount-proc", "--propagation", "private"]
HOST_NAMESPACES = ["--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                   "--propagation", "private"]


def hostname(index):
    return f"simhost{index}"


def address(index):
    """Loopback address of host `index` (the login node is 127.0.2.250).

    Not 127.0.1.x: Debian gives 127.0.1.1 to the machine's own name, and MPICH's
    hydra (5.0) then takes that host for the local one and starts its ranks
    without the launcher, on the login node.
    """
    return f"127.0.2.{index + 1}"


# ---------------------------------------------------------------------------
# check

def namespaces_refused():
    """None if this process can make the cluster's and a host's namespaces, else why not."""
    if not sys.platform.startswith("linux"):
        return f"Linux namespaces are needed (this is {sys.platform})"
    missing = [tool for tool in ("unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"util-linux's {' and '.join(missing)} not found on PATH"
    # The real thing, once: a cluster namespace set, loopback up, a host inside it.
    probe = (f"hostname {LOGIN} && unshare {' '.join(HOST_NAMESPACES)} "
             "sh -c 'hostname probe && mount -t tmpfs probe /dev/shm && hostname'")
    try:
        result = subprocess.run(["unshare", *CLUSTER_NAMESPACES, "sh", "-c", probe],
                                capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "unshare did not finish in 30 s"
    if result.returncode != 0 or result.stdout.strip() != "probe":
        why = (result.stderr.strip() or result.stdout.strip()).splitlines()
        return (f"this machine refuses the namespaces (unshare {' '.join(CLUSTER_NAMESPACES)}, "
                f"then {' '.join(HOST_NAMESPACES)}: exit {result.returncode}: "
                f"{why[-1] if why else 'no message'}); they need root or user namespaces")
    return None


def cmd_check(args):
    reason = namespaces_refused()
    if reason:
        print(f"simcluster: cannot simulate a cluster here: {reason}")
        return SKIP
    print("simcluster: namespaces available")
    return 0


# ---------------------------------------------------------------------------
# Which MPI, and how to tell it about the hosts

def mpi_flavor(mpiexec):
    """'mpich' (hydra), 'openmpi' (Open MPI 4's orterun) or raise, from `mpiexec --version`."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SystemExit(f"simcluster: cannot run {mpiexec} --version: {error}")
    if "HYDRA" in out:
        return "mpich"
    if "OpenRTE" in out or "Open RTE" in out:
        return "openmpi"
    first = out.strip().splitlines()[0] if out.strip() else "(no output)"
    raise SystemExit(f"simcluster: {mpiexec} is neither MPICH's hydra nor Open MPI 4's orterun "
                     f"({first}); Open MPI 5 (prterun) is not supported yet")


def mpiexec_command(flavor, mpiexec, ranks_per_host, command):
    """The mpiexec command line, and environment additions, for these hosts."""
    hosts = ",".join(f"{hostname(i)}:{n}" for i, n in enumerate(ranks_per_host))
    total = str(sum(ranks_per_host))
    if flavor == "mpich":
        # Between hosts: libfabric's tcp provider on the loopback.  (The PyPI wheel's
        # default netmod, UCX, finds loopback addresses of another host
        # "unreachable": MPI_Init fails.)  HEAVY_YIELD: more ranks than cores, see
        # the Makefile.  What the caller set wins.
        env = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo",
               "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
        env = {key: os.environ.get(key, value) for key, value in env.items()}
        argv = [mpiexec, "-hosts", hosts, "-n", total,
                "-launcher", "ssh", "-launcher-exec", str(AGENT), *command]
        return argv, env
    mca = {
        "plm_rsh_agent": str(AGENT),
        # Every daemon from the login node: a daemon inside a host must not start others.
        "plm_rsh_no_tree_spawn": "1",
        # orted stays the agent's child (not --daemonize), so it lives in the host.
        "orte_leave_session_attached": "1",
        # TCP over the loopback, which both TCP components exclude by default.
        "oob_tcp_if_include": "lo",
        "btl_tcp_if_include": "lo",
        "btl": "self,vader,tcp",
    }
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    argv = [mpiexec, "--host", hosts, "-np", total, "--bind-to", "none"]
    for key, value in mca.items():
        argv += ["--mca", key, value]
    return argv + list(command), env


# ---------------------------------------------------------------------------
# run: outside (make the state, enter the namespaces) and inside (the login node)

def parse_ranks_per_host(args):
    if "," in args.ranks_per_host:
        counts = [int(n) for n in args.ranks_per_host.split(",")]
    else:
        counts = [int(args.ranks_per_host)] * args.hosts
    if not counts or min(counts) < 1 or len(counts) > 200:
        raise SystemExit(f"simcluster: bad --ranks-per-host {args.ranks_per_host!r}")
    return counts


def write_state(state, counts):
    names = [hostname(i) for i in range(len(counts))]
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"127.0.2.250\t{LOGIN}"]
    lines += [f"{address(i)}\t{name}" for i, name in enumerate(names)]
    (state / "hosts").write_text("\n".join(lines) + "\n")
    (state / "hostnames").write_text("\n".join(names) + "\n")


def cmd_run(args):
    if not args.command:
        raise SystemExit("simcluster: no command (put it after --)")
    counts = parse_ranks_per_host(args)
    reason = namespaces_refused()
    if reason:
        print(f"simcluster: cannot simulate a cluster here: {reason}", file=sys.stderr)
        return SKIP
    mpiexec = args.mpiexec or os.environ.get("MPICOLL_MPIEXEC") or default_mpiexec()
    flavor = mpi_flavor(mpiexec)
    own_state = args.state is None
    state = Path(tempfile.mkdtemp(prefix="simcluster-")) if own_state else Path(args.state)
    state.mkdir(parents=True, exist_ok=True)
    write_state(state, counts)
    inner = [sys.executable, __file__, "_inside", "--flavor", flavor, "--mpiexec", mpiexec,
             "--ranks-per-host", ",".join(map(str, counts)), "--timeout", str(args.timeout),
             "--", *args.command]
    env = {**os.environ, "SIMCLUSTER_STATE": str(state)}
    if args.verbose:
        print(f"simcluster: {len(counts)} host(s) x {counts} rank(s), {flavor} ({mpiexec}), "
              f"state in {state}", file=sys.stderr, flush=True)
    cluster = subprocess.Popen(["unshare", *CLUSTER_NAMESPACES, *inner], env=env)

    def end_cluster(signum, frame):
        # SIGKILL to unshare: --kill-child then kills the cluster's PID 1, and with
        # it every process of the run.  (unshare itself blocks SIGTERM and SIGINT.)
        cluster.kill()
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, end_cluster)
    try:
        # The inside ends mpiexec at --timeout and itself 20 s later; this is the backstop.
        return cluster.wait(timeout=args.timeout + 60)
    except subprocess.TimeoutExpired:
        cluster.kill()
        print("simcluster: the cluster did not end after its timeout; killed", file=sys.stderr)
        return 124
    finally:
        cluster.kill() if cluster.poll() is None else None
        if own_state:
            shutil.rmtree(state, ignore_errors=True)


def default_mpiexec():
    """The mpiexec beside this Python (a venv with an MPI wheel), else mpiexec on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if not found:
        raise SystemExit("simcluster: no mpiexec (give --mpiexec or set MPICOLL_MPIEXEC)")
    return found


def bring_up_loopback():
    """`ip link set lo up` without iproute2: SIOCGIFFLAGS / SIOCSIFFLAGS on lo."""
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack_from("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, request + bytes(22)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP) + bytes(22))


def cmd_inside(args):
    """PID 1 of the cluster: the login node.  Runs mpiexec with a timeout."""
    state = Path(os.environ["SIMCLUSTER_STATE"])
    bring_up_loopback()
    socket.sethostname(LOGIN)
    subprocess.run(["mount", "--bind", str(state / "hosts"), "/etc/hosts"], check=True)
    (state / "cluster.netns").write_text(os.readlink("/proc/self/ns/net") + "\n")
    counts = [int(n) for n in args.ranks_per_host.split(",")]
    argv, extra_env = mpiexec_command(args.flavor, args.mpiexec, counts, args.command)
    env = {**os.environ, **extra_env}
    job = subprocess.Popen(argv, env=env)
    # As PID 1 this process ignores signals it has no handler for: give TERM one,
    # which passes it on to mpiexec (it ends its ranks).
    signal.signal(signal.SIGTERM, lambda signum, frame: job.terminate())
    try:
        status = job.wait(timeout=args.timeout)
        killed = sorted(path.stem for path in state.glob("*.killed"))
        if killed:  # say what happened to the job, beside what mpiexec said
            print(f"simcluster: host(s) {', '.join(killed)} killed during the job (kill-host); "
                  f"mpiexec exited with status {status}", file=sys.stderr, flush=True)
        return status
    except subprocess.TimeoutExpired:
        print(f"simcluster: the job did not finish in {args.timeout:g} s; terminating it "
              f"(a hang?): {' '.join(args.command)}", file=sys.stderr, flush=True)
        job.terminate()
        try:
            job.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass  # returning ends the PID namespace, and every process in it
        return 124


# ---------------------------------------------------------------------------
# kill-host

def host_processes(uts):
    """Pids (this /proc's view) of every process in the UTS namespace `uts`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/uts") == uts:
                    pids.append(int(entry))
            except OSError:
                pass  # gone meanwhile, or not ours to see
    return sorted(pids)


def cmd_kill_host(args):
    """SIGKILL every process of one simulated host: the host is gone, all at once."""
    record = Path(args.state) / f"{args.host}.uts"
    if not record.exists():
        raise SystemExit(f"simcluster: no host {args.host} has started in {args.state}")
    uts = record.read_text().strip()
    (Path(args.state) / f"{args.host}.killed").touch()  # for the agent: see there
    pids = host_processes(uts)
    if not pids:
        raise SystemExit(f"simcluster: host {args.host} has no processes left")
    for pid in pids:  # the host's PID 1 is among them: the kernel ends the rest too
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while host_processes(uts) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = host_processes(uts)
    print(f"simcluster: killed host {args.host}: {len(pids)} process(es)"
          + (f", {len(left)} still there: {left}" if left else ""), flush=True)
    return 1 if left else 0


def cmd_freeze_host(args):
    """SIGSTOP every process of one simulated host: a frozen node (its sockets stay
    open, so the launcher does not notice; only the job's own watchdog can)."""
    record = Path(args.state) / f"{args.host}.uts"
    if not record.exists():
        raise SystemExit(f"simcluster: no host {args.host} has started in {args.state}")
    pids = host_processes(record.read_text().strip())
    if not pids:
        raise SystemExit(f"simcluster: host {args.host} has no processes left")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    print(f"simcluster: froze host {args.host}: {len(pids)} process(es)", flush=True)
    return 0


# ---------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="what", required=True)
    run = commands.add_parser("run", help="run COMMAND on every rank of a simulated cluster")
    run.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    run.add_argument("--ranks-per-host", default="1",
                     help="ranks on every host (default 1), or one count per host: 2,1,2")
    run.add_argument("--mpiexec", help="default: $MPICOLL_MPIEXEC, the venv's, or on PATH")
    run.add_argument("--timeout", type=float, default=300,
                     help="seconds before mpiexec is terminated (exit 124; default 300)")
    run.add_argument("--state", help="directory for the cluster's files (kill-host needs it; "
                                     "default: a temporary one, removed afterwards)")
    run.add_argument("--verbose", action="store_true")
    run.add_argument("command", nargs=argparse.REMAINDER)
    commands.add_parser("check", help="exit 0 if namespaces work here, else 77 and why")
    kill = commands.add_parser("kill-host", help="SIGKILL every process of a simulated host")
    kill.add_argument("--state", required=True)
    kill.add_argument("host")
    freeze = commands.add_parser("freeze-host", help="SIGSTOP every process of a simulated "
                                                     "host (kill-host ends it)")
    freeze.add_argument("--state", required=True)
    freeze.add_argument("host")
    inside = commands.add_parser("_inside")  # internal: PID 1 of the cluster
    inside.add_argument("--flavor", required=True)
    inside.add_argument("--mpiexec", required=True)
    inside.add_argument("--ranks-per-host", required=True)
    inside.add_argument("--timeout", type=float, required=True)
    inside.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if getattr(args, "command", None) and args.command[0] == "--":
        args.command = args.command[1:]
    return {"run": cmd_run, "check": cmd_check, "kill-host": cmd_kill_host,
            "freeze-host": cmd_freeze_host, "_inside": cmd_inside}[args.what](args)


if __name__ == "__main__":
    raise SystemExit(main())

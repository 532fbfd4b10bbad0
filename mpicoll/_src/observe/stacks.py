"""`python -m mpicoll stacks [PID]`: where every rank of a live job is.

It sends SIGUSR2 to one rank's process on this host; that rank's watchdog asks
every rank over the watchdogs' side channel (watch/watchdog.h,
WriteStacksReport) for its state and its Python stack, prints the report to the
job's stderr and writes it to stacks-<pid>.txt in its user's private folder of its
temporary directory (<tmp>/mpicoll-<uid>, runtime/own_files.py), which this command
reads (a regular file of that user's, not through a link, at most REPORT_BYTES),
prints and removes.  The stacks are read without the
GIL (watch/python_stacks.h), so a rank busy in a C extension answers too.
"""

import os
import signal
import tempfile
import time

from ..runtime import own_files

# The launchers' variables that give a process its rank (MPICH/Hydra, Open MPI, PMIx, SLURM).
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_EXTENSION_MARK = "_mpicoll_ffi_"  # the extension's file name, in a process's memory map
ANSWER_WITHIN = 15.0  # s: the asked rank waits up to 3 s for each rank's answer
REPORT_BYTES = 16 << 20  # a line per rank and its stack: far beyond any job's report


def _environment(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def _rank(environment):
    for name in _RANK_VARIABLES:
        if environment.get(name, "").isdigit():
            return int(environment[name])
    return None


def has_mpicoll(pid):
    """Whether process `pid` has mpicoll's extension loaded (False where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return _EXTENSION_MARK in f.read()
    except OSError:
        return False


def mpicoll_processes():
    """[(pid, rank or None)] of the processes on this host that have mpicoll loaded."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and has_mpicoll(entry):
            found.append((int(entry), _rank(_environment(entry))))
    return sorted(found, key=lambda p: (p[1] is None, p[1] if p[1] is not None else 0, p[0]))


def _parents():
    """{pid: its parent's pid} for every process on this host."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:  # pid (comm) state ppid ...
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def ranks_of_launcher(pid):
    """[(pid, rank or None)] of the ranks that launcher `pid` (mpiexec, srun) started on
    this host: the mpicoll processes among its descendants, or, for srun (whose tasks
    are slurmstepd's children), those of its SLURM job."""
    children = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    descendants, todo = set(), [pid]
    while todo:
        below = children.get(todo.pop(), [])
        descendants.update(below)
        todo.extend(below)
    ranks = mpicoll_processes()
    launched = [(p, rank) for p, rank in ranks if p in descendants]
    job = _environment(pid).get("SLURM_JOB_ID")
    if not launched and job:
        launched = [(p, rank) for p, rank in ranks if _environment(p).get("SLURM_JOB_ID") == job]
    return launched


def choose_process(processes):
    """The process to ask: the one rank 0 of a job on this host, else the lowest rank."""
    if not processes:
        raise LookupError("no process on this host has mpicoll loaded (give the PID of a rank "
                          "on the host where it runs)")
    first_ranks = [pid for pid, rank in processes if rank == 0]
    if len(first_ranks) > 1:
        raise LookupError("several jobs run mpicoll on this host (rank 0 processes "
                          f"{', '.join(map(str, first_ranks))}): give one PID")
    return first_ranks[0] if first_ranks else processes[0][0]


def _temporary_directory(environment):
    for name in ("TMPDIR", "TEMP", "TMP"):
        if environment.get(name):
            return environment[name]
    return tempfile.gettempdir() if not environment else "/tmp"


def report_path(pid):
    """Where process `pid` writes its stacks report, and its user's uid."""
    uid = os.stat(f"/proc/{pid}").st_uid
    root = own_files.private_root(_temporary_directory(_environment(pid)), uid)
    return os.path.join(root, f"stacks-{pid}.txt"), uid


def _report_folder_problem(root, uid):
    """Why the rank of user `uid` would not write its report in `root` (own_files.h's
    private rule), or None."""
    import stat

    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return None  # the rank makes it when it writes
    if not stat.S_ISDIR(info.st_mode):
        return f"{root} is not a folder"
    if info.st_uid != uid:
        return f"{root} belongs to uid {info.st_uid}, not to the rank's user (uid {uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{root} is writable by other users"
    return None


def ask(pid, within=ANSWER_WITHIN):
    """Signal process `pid` and return its report of where every rank is."""
    if not has_mpicoll(pid):  # never signal a process that is not an mpicoll rank
        raise LookupError(f"process {pid} is not running mpicoll on this host")
    report, uid = report_path(pid)
    unusable = _report_folder_problem(os.path.dirname(report), uid)
    if unusable:
        os.kill(pid, signal.SIGUSR2)  # the report still goes to the job's stderr
        raise LookupError(f"{unusable}: the rank does not write its report there; it printed "
                          "it to the job's stderr")
    try:
        os.remove(report)
    except FileNotFoundError:
        pass
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            text = own_files.read_file(report, REPORT_BYTES, owner=uid)
        except FileNotFoundError:
            time.sleep(0.05)
            continue
        os.remove(report)
        return text.decode(errors="replace")
    raise TimeoutError(f"process {pid} did not answer within {within:.0f} s (is it an mpicoll "
                       "rank whose watchdog runs? A program that sets its own SIGUSR2 handler "
                       "replaces mpicoll's)")

"""A shared node: nothing another user prepared is trusted (docs/security.md).

The other user is simulated by files chowned to an unused uid (the suite runs as
root in CI, where ownership, not permission, is what the rule checks; as another
user the kernel refuses the rest).  Planted folders and links never get written
through (tests/programs/shared_node.py, one rank dumping between the plantings);
what mpicoll makes is 0700 and 0600; import prunes only this user's own folders;
the C++ and Python sides of the rule agree; the readers of record files treat
them as untrusted data; and a one-node job whose host name resolves to a network
address listens on loopback only (JAX's coordination service and gloo's).
"""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_mpiexec, serial_only
from mpicoll._src.observe import failures, records
from mpicoll._src.runtime import own_files

PROGRAMS = Path(__file__).parent / "programs"
OTHER_UID = 54321  # no user of this machine: "another user" of the node
ME = os.geteuid()

pytestmark = serial_only


def _mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def shared(tmp_path):
    """A shared temporary directory (mode 1777, as /tmp) and a victim: a file and a
    folder of this user's that a planted link points at."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("precious")
    return folder, victim


def _victim_intact(victim):
    return sorted(p.name for p in victim.iterdir()) == ["precious"] and \
        (victim / "precious").read_text() == "precious"


def _plant_link(at, target, owner=OTHER_UID):
    os.symlink(target, at)
    os.lchown(at, owner, owner)


class Rank:
    """tests/programs/shared_node.py with TMPDIR=`temporary`, driven line by line."""

    def __init__(self, temporary, env=None):
        self.process = subprocess.Popen(
            [sys.executable, "-u", str(PROGRAMS / "shared_node.py")], cwd=PROGRAMS,
            env={**os.environ, "TMPDIR": str(temporary), "MPICOLL_FLIGHT_DIR": "",
                 **(env or {})},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        words = self._line().split()
        assert words[:1] == ["ready"], words
        self.pid, self.flight_dir, self.root = int(words[1]), Path(words[2]), Path(words[3])

    def _line(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if line:
                return line.strip()
            if self.process.poll() is not None:
                break
        self.process.kill()
        raise AssertionError(f"shared_node.py ended or stalled: {self.process.stderr.read()}")

    def ask(self, command):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._line()

    def dump(self):
        return self.ask("dump") == "dumped True"

    def close(self):
        """Ends the rank; its stderr."""
        try:
            _, stderr = self.process.communicate("quit\n", timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate()
        return stderr


@pytest.fixture
def rank(shared):
    started = []

    def start(**env):
        started.append(Rank(shared[0], env))
        return started[-1]

    yield start
    for r in started:
        if r.process.poll() is None:
            r.process.kill()
            r.process.communicate()


def test_planted_folders_and_links_are_never_written_through(shared, rank):
    temporary, victim = shared
    r = rank()
    host = socket.gethostname()
    root = temporary / f"mpicoll-{ME}"
    assert r.root == root and r.flight_dir == root / f"flight-{host}-{r.pid}"
    # The old layout's predictable names, planted by another user: never used again.
    legacy = temporary / f"mpicoll-flight-{host}-{r.pid}"
    legacy.mkdir(mode=0o777)
    os.chown(legacy, OTHER_UID, OTHER_UID)
    _plant_link(legacy / "rank0.json", victim / "precious")
    _plant_link(legacy / f"rank0.json.{r.pid}.partial", victim / "precious")

    # 1. Nothing there yet: made private, the file 0600.
    assert r.dump()
    assert (_mode(root), _mode(r.flight_dir), _mode(r.flight_dir / "rank0.json")) == \
        (0o700, 0o700, 0o600)
    assert os.lstat(root).st_uid == ME

    # 2. The job's folder swapped for another user's link to the victim.
    r.flight_dir.rename(root / "aside")
    _plant_link(r.flight_dir, victim)
    assert not r.dump() and _victim_intact(victim)

    # 3. This user's folder taken by another user first (made 0777, a link inside).
    root.rename(temporary / "ours-aside")
    root.mkdir()
    root.chmod(0o777)
    os.chown(root, OTHER_UID, OTHER_UID)
    _plant_link(root / r.flight_dir.name, victim)
    assert not r.dump() and _victim_intact(victim)

    # 4. This user's, but writable by others: refused; 5. readable only: closed to 0700.
    os.unlink(root / r.flight_dir.name)
    os.chown(root, ME, ME)
    assert not r.dump() and _victim_intact(victim)
    root.chmod(0o750)
    assert r.dump() and _mode(root) == 0o700 and (r.flight_dir / "rank0.json").is_file()

    # 6. A planted file at a partial name, or a link at the final name, in a folder
    # the user names that others can write to (a shared /tmp): neither is followed.
    named = temporary / "named"
    named.mkdir()
    named.chmod(0o1777)
    _plant_link(named / "rank0.json", victim / "precious")
    assert r.ask(f"trace {named}").startswith("traced")
    assert _victim_intact(victim) and not (named / "rank0.json").is_symlink()
    assert _mode(named / "rank0.json") == 0o600
    stderr = r.close()
    assert sorted(p.name for p in legacy.iterdir()) == \
        ["rank0.json", f"rank0.json.{r.pid}.partial"], stderr
    assert all(os.path.islink(p) for p in legacy.iterdir()), stderr
    assert _victim_intact(victim), stderr


def test_another_users_folder_at_this_users_name_is_refused_at_import_and_by_stacks(shared,
                                                                                     rank):
    temporary, victim = shared
    root = temporary / f"mpicoll-{ME}"
    root.mkdir(mode=0o777)
    os.chown(root, OTHER_UID, OTHER_UID)
    r = rank()
    _plant_link(root / f"stacks-{r.pid}.txt", victim / "precious")
    _plant_link(root / r.flight_dir.name, victim)
    asked = subprocess.run([sys.executable, "-m", "mpicoll", "stacks", str(r.pid)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert asked.returncode == 1, asked
    assert f"belongs to uid {OTHER_UID}, not to the rank's user" in asked.stderr, asked.stderr
    assert not r.dump()
    stderr = r.close()
    assert f"UnsafeFolderWarning: mpicoll: {root} belongs to uid {OTHER_UID}" in stderr, stderr
    assert stderr.count("UnsafeFolderWarning") == 1, stderr
    assert _victim_intact(victim)


def test_the_stacks_report_goes_through_the_private_folder(shared, rank):
    r = rank()
    asked = subprocess.run([sys.executable, "-m", "mpicoll", "stacks", str(r.pid)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert asked.returncode == 0 and "where every rank is" in asked.stdout, asked
    assert _mode(r.root) == 0o700 and not list(r.root.glob("stacks-*")), list(r.root.iterdir())
    r.close()


def test_a_named_folder_of_another_user_is_refused_at_import(shared):
    temporary, _ = shared
    theirs = temporary / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    link = temporary / "their-link"
    _plant_link(link, temporary)  # a link of theirs to a folder root owns
    for variable, named in (("MPICOLL_TRACE", theirs), ("MPICOLL_FLIGHT_DIR", link)):
        run = subprocess.run([sys.executable, "-c", "import mpicoll"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, variable: str(named)})
        assert run.returncode != 0, run
        assert f"{variable}='{named}': mpicoll cannot write there" in run.stderr, run.stderr
        assert f"uid {OTHER_UID}" in run.stderr, run.stderr


def test_the_timeline_and_its_merge_are_private_and_follow_no_link(shared, rank, tmp_path):
    _, victim = shared
    r = rank()
    made = tmp_path / "timeline" / "run1"
    assert r.ask(f"trace {made}").startswith("traced")
    r.close()
    assert (_mode(made), _mode(made / "rank0.json")) == (0o700, 0o600)
    _plant_link(made / "merged.json", victim / "precious", owner=ME)
    merged = subprocess.run([sys.executable, "-m", "mpicoll", "trace", str(made)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert merged.returncode == 0 and "written:" in merged.stdout, merged
    assert _victim_intact(victim) and not (made / "merged.json").is_symlink()
    assert (_mode(made / "merged.json"), _mode(made / "timeline.svg")) == (0o600, 0o600)
    # In another user's folder the summary still comes; nothing is written there.
    os.chown(made, OTHER_UID, OTHER_UID)
    (made / "merged.json").unlink()
    merged = subprocess.run([sys.executable, "-m", "mpicoll", "trace", str(made)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert merged.returncode == 0 and "not written: merged.json" in merged.stdout, merged
    assert not (made / "merged.json").exists()


# --- Pruning ------------------------------------------------------------------------------

def test_import_prunes_only_this_users_own_old_folders(shared):
    temporary, victim = shared
    root = Path(own_files.private_root(str(temporary)))
    root.mkdir(mode=0o700)
    now = time.time()
    month = now - 30 * 86400

    def folder(at, owner=ME, when=month):
        at.mkdir()
        os.chown(at, owner, owner)
        os.utime(at, (when, when))
        return at

    ours_old = folder(root / "flight-far-41")
    theirs_old = folder(root / "flight-far-42", owner=OTHER_UID)  # only root could: kept
    legacy_theirs = folder(temporary / "mpicoll-flight-far-43", owner=OTHER_UID)
    legacy_ours = folder(temporary / "mpicoll-flight-far-44")  # outside the private folder
    _plant_link(root / "flight-far-45", victim, owner=ME)
    os.utime(root / "flight-far-45", (month, month), follow_symlinks=False)
    other_root = folder(temporary / f"mpicoll-{OTHER_UID}", owner=OTHER_UID)
    their_own = folder(other_root / "flight-far-46", owner=OTHER_UID)
    stale_report = root / "stacks-12345.txt"
    stale_report.write_text("old")
    os.utime(stale_report, (month, month))
    recent = [folder(root / f"flight-node{i}-{1000 + i}", when=now - 100 - i) for i in range(22)]
    running = folder(root / f"flight-{socket.gethostname()}-{os.getpid()}")

    run = subprocess.run([sys.executable, "-c", "import mpicoll"], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(temporary), "MPICOLL_FLIGHT_DIR": ""})
    assert run.returncode == 0, run.stderr
    gone = {p for p in [ours_old, stale_report, *recent] if not os.path.lexists(p)}
    assert gone == {ours_old, stale_report, recent[20], recent[21]}, sorted(map(str, gone))
    for kept in (theirs_old, legacy_theirs, legacy_ours, their_own, running, victim):
        assert kept.is_dir(), kept
    assert os.path.islink(root / "flight-far-45") and _victim_intact(victim)


def test_pruning_a_private_folder_that_fails_the_rule_removes_nothing(shared):
    temporary, _ = shared
    root = Path(own_files.private_root(str(temporary)))
    root.mkdir()
    root.chmod(0o777)
    (root / "flight-far-41").mkdir()
    os.utime(root / "flight-far-41", (0, 0))
    assert failures.prune_flight_folders(str(root)) == []
    assert (root / "flight-far-41").is_dir()


# --- One rule in two languages ---------------------------------------------------------

def _folders(base):
    """(path, private root or None) to judge: every way a folder can be wrong."""
    root = base / f"mpicoll-{ME}"
    root.mkdir(mode=0o700)
    (root / "inside").mkdir(mode=0o700)
    cases = [(root, root), (root / "inside", root), (root / "missing", root)]
    open_root = base / "open"
    open_root.mkdir()
    open_root.chmod(0o777)
    (open_root / "inside").mkdir()
    cases += [(open_root, open_root), (open_root / "inside", open_root)]
    theirs = base / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    cases += [(theirs, theirs), (theirs, None)]
    link = base / "link"
    _plant_link(link, root, owner=ME)
    cases += [(link, link), (link, None)]
    their_link = base / "their-link"
    _plant_link(their_link, root)
    cases += [(their_link, None)]
    a_file = base / "a-file"
    a_file.write_text("")
    cases += [(a_file, None), (a_file, a_file), (base / "missing", None), (base, None)]
    readable = base / "readable"
    readable.mkdir()
    readable.chmod(0o755)
    cases += [(readable, readable)]
    return cases


def test_the_cpp_and_python_rules_give_one_verdict(tmp_path):
    from mpicoll._src.runtime.native import extension

    cases = _folders(tmp_path)
    verdicts = []
    for path, root in cases:
        by_python = own_files.folder_problem(str(path), None if root is None else str(root))
        if root == tmp_path / "readable":  # closed to 0700 by the first: open it again
            path.chmod(0o755)
        by_cpp = extension.check_folder(str(path), "" if root is None else str(root), False)
        verdicts.append((str(path.relative_to(tmp_path)), by_python or "", by_cpp))
    assert all(p == c for _, p, c in verdicts), verdicts
    refused = {path for path, p, _ in verdicts if p}
    assert refused == {"open", "open/inside", "theirs", "link", "their-link", "a-file",
                       f"mpicoll-{ME}/missing", "missing"}, verdicts


# --- Reading record files as untrusted data -------------------------------------------

def _record_file(rank=0, **changes):
    data = {"otherData": {"mpicoll": 1, "rank": rank, "size": 1, "host": "h", "reason": "r",
                          "written_ns": 1, "clock_offset_ns": 0, "kept": "last",
                          "trace_skip": 0},
            "traceEvents": [{"ph": "X", "cat": "collective", "tid": 0, "ts": 0, "dur": 1,
                             "name": "allreduce", "args": {
                                 "sequence": 0, "call": "allreduce(float32[4])",
                                 "op": "allreduce", "comm": "mpicoll:MPI_COMM_WORLD:device0",
                                 "members": "0", "comm_rank": 0, "comm_size": 1,
                                 "dtype": "float32", "shape": [4], "bytes": 16,
                                 "site": "x.py:1", "queued_ns": 1, "started_ns": 2,
                                 "finished_ns": 3, "failed": False}}]}
    for where, value in changes.items():
        *path, key = where.split(".")
        target = data
        for part in path:
            target = target[int(part)] if part.isdigit() else target[part]
        target[key] = value
    return json.dumps(data)


MALFORMED = {
    "truncated": (_record_file()[:-40], "not JSON"),
    "a string for a number": (_record_file(**{"traceEvents.0.args.sequence": "7"}),
                              "'sequence' is str"),
    "a bool for a number": (_record_file(**{"traceEvents.0.tid": True}), "'tid' is bool"),
    "a float for a number": (_record_file(**{"traceEvents.0.args.bytes": 1.5}), "'bytes' is float"),
    "NaN": (_record_file().replace('"written_ns": 1', '"written_ns": NaN'), "NaN is not"),
    "a rank beyond the size": (_record_file(**{"otherData.rank": 5}), "outside 0..0"),
    "another rank's file": (_record_file(**{"otherData.size": 2, "otherData.rank": 1}),
                            "holds the records of rank 1, not of rank 0"),
    "members not ranks": (_record_file(**{"traceEvents.0.args.members": "0;rm"}), "'members'"),
    "no args": (_record_file(**{"traceEvents.0.args": None}), "args is not an object"),
    "events not a list": (_record_file(traceEvents={}), "traceEvents is not a list"),
    "not an object": ("[1, 2]", "no otherData"),
    "deep nesting": ("[" * 100000 + "]" * 100000, "not JSON"),
    "a device out of range": (_record_file(**{"traceEvents.0.tid": 1 << 20}), "'tid'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_record_file_is_named_with_its_field(case, tmp_path):
    text, expected = MALFORMED[case]
    (tmp_path / "rank0.json").write_text(text)
    with pytest.raises(records.Malformed, match="rank0.json") as raised:
        records.load(str(tmp_path))
    assert expected in str(raised.value), raised.value


def test_a_record_file_that_is_a_fifo_a_link_or_too_large_is_refused_without_blocking(
        tmp_path, monkeypatch):
    good = tmp_path / "good"
    good.mkdir()
    (good / "rank0.json").write_text(_record_file())
    assert records.load(str(good))[0].records[0].call == "allreduce(float32[4])"
    os.mkfifo(tmp_path / "rank0.json")  # a reader that opened it plainly would wait forever
    start = time.monotonic()
    with pytest.raises(records.Malformed, match="not a regular file"):
        records.load(str(tmp_path))
    assert time.monotonic() - start < 5
    os.unlink(tmp_path / "rank0.json")
    os.symlink(good / "rank0.json", tmp_path / "rank0.json")
    with pytest.raises(records.Malformed, match="is a link, not a file"):
        records.load(str(tmp_path))
    monkeypatch.setattr(records, "MAX_FILE_BYTES", 100)
    with pytest.raises(records.Malformed, match="more than the 100 read"):
        records.load(str(good))


def test_control_characters_in_a_record_reach_no_terminal(tmp_path):
    (tmp_path / "rank0.json").write_text(_record_file(**{
        "otherData.host": "h\x1b[2J", "otherData.reason": "two\nlines\x07",
        "traceEvents.0.args.site": "x.py:1\r\x1b]0;owned\x07"}))
    loaded = records.load(str(tmp_path))[0]
    assert loaded.host == "h\\x1b[2J" and loaded.reason == "two\nlines\\x07"
    assert loaded.records[0].site == "x.py:1\\x0d\\x1b]0;owned\\x07"
    shown = subprocess.run([sys.executable, "-m", "mpicoll", "flight", str(tmp_path)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert "\x1b" not in shown.stdout + shown.stderr and "h\\x1b[2J" in shown.stdout, shown


def test_the_flight_command_says_a_file_is_malformed_and_exits_2(tmp_path):
    (tmp_path / "rank0.json").write_text(_record_file(**{"traceEvents.0.args.sequence": "7"}))
    shown = subprocess.run([sys.executable, "-m", "mpicoll", "flight", str(tmp_path)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert shown.returncode == 2, shown
    assert "rank0.json: traceEvents[0].args: 'sequence' is str" in shown.stderr, shown.stderr


# --- What a one-node job listens on -------------------------------------------------------

NAMESPACE_HOST = """
set -e
ip link set lo up
ip link add mpc0 type veth peer name mpc1
ip addr add 10.77.0.1/24 dev mpc0
ip link set mpc0 up
ip link set mpc1 up
hostname node77
hosts=$(mktemp)
printf '127.0.0.1 localhost\\n10.77.0.1 node77\\n' > "$hosts"
mount --bind "$hosts" /etc/hosts
exec "$@"
"""


def _namespace_refused():
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "util-linux's unshare and iproute2's ip are needed"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--fork", "bash", "-c",
                            NAMESPACE_HOST, "probe", "true"], capture_output=True, text=True,
                           timeout=30)
    return None if probe.returncode == 0 else f"no network namespace here: {probe.stderr[-300:]}"


def test_a_one_node_job_listens_on_loopback_where_its_host_name_is_a_network_address():
    # A node whose name resolves to its network address (10.77.0.1 here, in a network
    # namespace of its own): JAX's gloo would listen there, the coordination service on
    # every interface.  tests/programs/distributed.py checks every listener opened
    # since MPI's own.
    refused = _namespace_refused()
    if refused:  # a container that refuses network namespaces
        pytest.skip(refused)
    result = run_mpiexec(2, [sys.executable, PROGRAMS / "distributed.py", 1], timeout=240,
                         prefix=["unshare", "--net", "--uts", "--mount", "--fork", "bash",
                                 "-c", NAMESPACE_HOST, "node77"])
    assert result.returncode == 0, result.summary()
    assert "ALL OK (2 ranks x 1 devices)" in result.stdout, result.summary()

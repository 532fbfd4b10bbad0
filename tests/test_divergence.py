"""Programs whose ranks diverge (tests/programs/diverge.py) end in seconds, with one
report naming every rank's state, and no rank returns a value it should not.

Each case runs as its own job at 2 and 3 ranks under the suite's MPI (CI runs this
file under MPICH and Open MPI).  MPICOLL_TIMEOUT is 120 s: every case must end long
before it, by the watchdog's divergence check (csrc/watch/watchdog.h), not the timeout.
The times to end are measured in benchmarks/divergence.py (make bench).
"""

import re
import sys
from pathlib import Path

import pytest

from conftest import mpicoll_command, run_mpiexec

PROGRAM = Path(__file__).parent / "programs" / "diverge.py"
REPORT = "mpicoll: the ranks' collectives cannot match: "
WITHIN = 30  # s: generous for an oversubscribed 2-core machine (about 3 s measured)


def _run(ranks, case, **env):
    return run_mpiexec(ranks, [sys.executable, PROGRAM, case], timeout=180,
                       env={"MPICOLL_TIMEOUT": "120", "MPICOLL_STALL_REPORT": "100", **env})


def _ended_in_seconds(result, returncodes=(3,)):
    """The job ended (by the watchdog, not the timeout) and no rank got a wrong value."""
    assert result.returncode in returncodes, result.summary()
    assert "WRONG" not in result.output, result.summary()
    assert result.seconds < WITHIN, result.summary()


def _one_report(result):
    """The job's one divergence report: (first line, {rank: its line})."""
    assert result.output.count(REPORT) == 1, result.summary()
    text = result.output[result.output.index(REPORT):]
    head, *rest = text.splitlines()
    lines = {}
    for line in rest:
        found = re.match(r"  rank (\d+) \(.*?\): (.*)", line)
        if not found:
            break
        lines[int(found[1])] = found[2]
    return head, lines


# case -> (what the report's first line says, {"odd"/"others": what that rank's line says})
MISMATCHES = {
    "new-shape": ("allreduce(float32[5], op=sum)", "allreduce(float32[4], op=sum)"),
    "new-dtype": ("allreduce(int32[4], op=sum)", "allreduce(float32[4], op=sum)"),
    "other-op": ("allreduce(float32[4], op=max)", "allreduce(float32[4], op=sum)"),
    "swapped": ("bcast(float32[4], root=0)", "allreduce(float32[4], op=sum)"),
    "other-root": ("bcast(float32[4], root=1)", "bcast(float32[4], root=0)"),
}


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_ranks_at_one_collective_with_different_calls_are_named(ranks, case):
    result = _run(ranks, case)
    odd = ranks - 1
    _ended_in_seconds(result)
    head, lines = _one_report(result)
    assert re.search(rf"ranks \d and {odd} are at the same collective on MPI_COMM_WORLD "
                     r"\(sequence 6\) with different calls", head), head
    odd_call, others_call = MISMATCHES[case]
    assert odd_call in lines[odd] and "sequence 6" in lines[odd], lines
    assert "comparing it across the ranks" in lines[odd] or case == "swapped", lines
    for rank in range(odd):  # in the call, or finished after it (a broadcast's root)
        assert others_call in lines[rank], lines
    # The odd rank never returned from its diverging call.
    assert result.stdout.count(f"rank {odd}: returned") == 5, result.summary()


def test_a_mismatch_in_shard_map_names_the_lax_call_as_written_and_its_line():
    """A jax.lax.psum over (RANKS, "dev") whose shapes differ between the ranks: each
    rank's line names the call as the user wrote it, each device's shape, and the
    user's line of the psum (the error surfaces later, where JAX waits on it)."""
    result = _run(2, "lax-devices")
    assert result.returncode == 0, result.summary()
    line = next(number for number, text in enumerate(PROGRAM.read_text().splitlines(), 1)
                if "the line the mismatch names" in text)
    site = rf"called at {re.escape(str(PROGRAM))}:{line} \(<lambda>\)"
    written = "jax.lax.psum over (mpicoll.RANKS, 'dev') of float32[{}] per device: allreduce"
    for rank in range(2):
        raised = re.search(rf"rank {rank}: raised JaxRuntimeError: (.*)", result.stdout)
        assert raised and "ranks called different collectives" in raised[1], result.summary()
        for other, block in ((0, 2), (1, 3)):
            described = re.search(rf"rank {other}: (jax\.lax[^|]*)", raised[1])
            assert described and described[1].startswith(written.format(block)), raised[1]
            assert re.search(site, described[1]), described[1]
        # Eagerly, each psum is a program of its own: the same name, and a line of
        # the user's (the psum's, or where the main thread waits by the time of
        # the check: JAX dispatches the program asynchronously).
        raised = re.search(rf"rank {rank}: eagerly raised JaxRuntimeError: (.*)", result.stdout)
        assert raised and "ranks called different collectives" in raised[1], result.summary()
        for other, block in ((0, 2), (1, 3)):
            described = re.search(rf"rank {other}: (jax\.lax[^|]*)", raised[1])
            assert described and described[1].startswith(written.format(block)), raised[1]
            assert f"called at {PROGRAM}:" in described[1], described[1]


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case,missing", [("skip-finish", "odd"), ("extra", "others")])
def test_a_rank_that_finished_its_script_is_named_where_it_finished(ranks, case, missing):
    result = _run(ranks, case)
    odd = ranks - 1
    _ended_in_seconds(result)
    head, lines = _one_report(result)
    gone = [odd] if missing == "odd" else list(range(odd))
    assert re.search(rf"rank ({'|'.join(map(str, gone))}) has finished its script without "
                     r"reaching the collective rank \d waits in on MPI_COMM_WORLD", head), head
    waiting = [r for r in range(ranks) if r not in gone]
    sequence = 6 if missing == "odd" else 7
    assert re.search(r"waits in on MPI_COMM_WORLD, called at .*diverge\.py:\d+", head), head
    for rank in gone:  # its last call, and the line it was made from
        assert re.match(rf"finished its script at .*diverge\.py:\d+; its last on "
                        rf"MPI_COMM_WORLD: sequence {sequence - 1}, allreduce.*, called at "
                        rf".*diverge\.py:\d+", lines[rank]), lines
    for rank in waiting:
        assert re.match(rf"in allreduce\(float32\[4\], op=sum\) on MPI_COMM_WORLD, sequence "
                        rf"{sequence}, called at .*diverge\.py:\d+", lines[rank]), lines


def _line_of(marker):
    """The line number of the program's line ending with `marker`."""
    lines = PROGRAM.read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.endswith(marker))


def test_a_skipped_eager_call_names_the_line_that_waits_and_every_ranks_records(tmp_path):
    # Each rank its own temporary directory, as on hosts that share no file system:
    # the finished rank's records reach the folder the report names (its end notice
    # carries its last ones).
    own_tmp = ('r=${PMI_RANK:-$OMPI_COMM_WORLD_RANK}; export TMPDIR="$1/node$r"; '
               'unset MPICOLL_FLIGHT_DIR; mkdir -p "$TMPDIR"; shift; exec "$@"')
    result = run_mpiexec(2, ["/bin/sh", "-c", own_tmp, "sh", tmp_path, sys.executable,
                             PROGRAM, "skip-eager"], timeout=180,
                         env={"MPICOLL_TIMEOUT": "120", "MPICOLL_STALL_REPORT": "100"})
    _ended_in_seconds(result)
    head, lines = _one_report(result)
    # JAX caches an eager call's program: the report names the line of the call that
    # waits, not of the program's first caller.
    wait = rf"diverge\.py:{_line_of('# the wait')} \(<module>\)"
    assert re.search(rf"rank 1 has finished its script without reaching the collective rank 0 "
                     rf"waits in on MPI_COMM_WORLD, called at .*{wait}", head), head
    assert re.search(rf"in allreduce\(float32\[4\], op=sum\) on MPI_COMM_WORLD, sequence 7, "
                     rf"called at .*{wait}", lines[0]), lines
    assert re.match(r"finished its script at .*diverge\.py:\d+; its last on MPI_COMM_WORLD: "
                    r"sequence 6, allreduce\(float32\[4\], op=sum\)$", lines[1]), lines
    folder = re.search(r"flight records: (\S+)/rank\*\.json", result.output)[1]
    assert folder.startswith(str(tmp_path / "node0")), folder
    assert sorted(p.name for p in Path(folder).glob("rank*.json")) == ["rank0.json",
                                                                      "rank1.json"]
    _, flight = mpicoll_command("flight", folder)
    assert "flight records of 2 of 2 ranks" in flight, flight
    assert "rank 1 has not reached sequence 7 (its last: sequence 6, allreduce(float32[4])" \
        in flight, flight


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_exits_mid_job_writes_the_report(ranks):
    result = _run(ranks, "exit-mid")
    odd = ranks - 1
    _ended_in_seconds(result, (7, 9))  # 9: the launcher reaped a rank it killed first
    head, lines = _one_report(result)
    assert re.search(rf"rank {odd} exits with code 7 while rank \d waits for it", head), head
    assert re.match(r"exits with code 7 at .*diverge\.py:\d+ \(os\._exit\); its last on "
                    r"MPI_COMM_WORLD: sequence 5", lines[odd]), lines
    assert all("in allreduce(float32[4], op=sum) on MPI_COMM_WORLD, sequence 6" in lines[r]
               for r in range(odd)), lines


def test_a_rank_that_finished_after_distributed_initialize_is_named():
    # JAX's shutdown barrier at exit waits for every process: the rank that finished
    # tells the others before it (mpicoll/distributed.py), and the report names the
    # call's MPI part (its leader device's), not a device waiting for its leader.
    result = _run(2, "mesh-finish")
    _ended_in_seconds(result)
    head, lines = _one_report(result)
    assert re.search(r"rank 1 has finished its script without reaching the collective "
                     r"rank 0 waits in", head), head
    # the psum as written, then as mpicoll runs it
    call = (r"jax\.lax\.psum over \('hosts', 'local'\) of float32\[1\] per device: "
            r"allreduce\(float32\[1\], op=sum\), over 2 local devices")
    # the communicator named after the mesh axes it stands for
    assert re.match(rf"finished its script at .*diverge\.py:\d+; its last on mesh axes "
                    rf"hosts,local: sequence 2, {call}, called at .*diverge\.py:\d+", lines[1]), lines
    assert re.match(rf"in {call} on mesh axes hosts,local, sequence 3, called at "
                    rf".*diverge\.py:\d+", lines[0]), lines
    assert "waiting for this process's other local devices" not in result.output, \
        result.summary()
    assert result.stdout.count("rank 1: returned") == 2, result.summary()


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_that_never_reaches_the_first_collective_is_named(ranks):
    result = _run(ranks, "never-first")
    odd = ranks - 1
    _ended_in_seconds(result)
    head, lines = _one_report(result)
    assert f"rank {odd} has finished its script without reaching the collective" in head, head
    assert re.match(r"finished its script at .*diverge\.py:\d+$", lines[odd]), lines
    for rank in range(odd):  # the collective the program called, not MPI_Comm_dup alone
        assert re.match(r"in allreduce \(called at .*diverge\.py:\d+ .*\) on MPI_COMM_WORLD "
                        r"\(its first collective there", lines[rank]), lines


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("case", ["check-shape", "swapped-alike", "late-check", "slow-check"])
def test_checks_raise_the_mismatch_on_every_rank(ranks, case):
    """MPICOLL_CHECK=1: a different shape, and two alike programs called in swapped
    order (their call sites differ), raise the mismatch on every rank: JaxRuntimeError,
    or ValueError on a rank that ran its program from JAX's cache (jit's C++ fast path,
    jax-ml/jax#34083; docs/failures.md).  By default (first-run checks): two
    ranks comparing different new calls while a third comes late are no divergence
    for the watchdog, whose probe sees them (their checks meet and raise); nor is a
    rank still in a comparison the others have finished (slow-check)."""
    result = _run(ranks, case, **({} if case.endswith("late-check") or case == "slow-check"
                                  else {"MPICOLL_CHECK": "1"}))
    _ended_in_seconds(result, (0,))
    raised = re.findall(r"rank (\d): raised (\w+): (.*)", result.stdout)
    assert sorted(int(r) for r, _, _ in raised) == list(range(ranks)), result.summary()
    assert {kind for _, kind, _ in raised} <= {"JaxRuntimeError", "ValueError"}, result.summary()
    assert all("mpicoll: ranks called different collectives" in text for _, _, text in raised)

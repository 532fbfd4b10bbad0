"""What the job says when it is stuck or failing (csrc/watch/watchdog.h), in jobs of 2-3 ranks.

Stall reports: tests/programs/stall.py with MPICOLL_STALL_REPORT=1: one report
per stall for the whole job (the lowest stalled rank's), naming the ranks that
have arrived and what each other rank is doing, asked over the watchdogs' own
communicator while the stalled ranks' threads are stuck in MPI; the timeout
ends the job with it.  Uncaught exceptions: one traceback per job, from the
rank whose error ends it, mpicoll's own frames left out.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import mpicoll_command, run_mpiexec, serial_only
from mpicoll._src.observe import records

PROGRAM = Path(__file__).parent / "programs" / "stall.py"
pytestmark = serial_only


def _reports(output):
    """The stall reports in a job's output: (head line, the lines under it)."""
    reports = []
    for line in output.splitlines():
        if line.startswith("mpicoll: stall report from"):
            reports.append((line, []))
        elif reports and line.startswith("  "):
            reports[-1][1].append(line.strip())
    return reports


def test_a_rank_busy_in_python_is_named_and_the_job_goes_on():
    result = run_mpiexec(3, [sys.executable, PROGRAM, "late", "4"],
                         env={"MPICOLL_STALL_REPORT": "1", "MPICOLL_TIMEOUT": "60"}, timeout=180)
    assert result.returncode == 0, result.summary()
    reports = _reports(result.output)
    assert reports, result.summary()
    # Repeated with back-off (1 s, 2 s), each once for the job: by rank 0.
    assert 1 <= len(reports) <= 3, result.summary()
    head, lines = reports[0]
    assert re.match(r"mpicoll: stall report from rank 0 \(.*\): waiting [\d.]+ s in "
                    r"allreduce\(float32\[4\], op=sum\) on MPI_COMM_WORLD, sequence 2, called at "
                    r".*stall\.py:\d+ ", head), head
    assert lines[0] == "arrived (2 of 3 ranks): 0 1", lines
    assert re.match(r"rank 2 \(.*\): not in an mpicoll collective for [\d.]+ s; its last on "
                    r"MPI_COMM_WORLD: sequence 1, allreduce\(float32\[4\], op=sum\), called at .*stall\.py:\d+", lines[1]), lines
    assert result.output.count("allreduce [3.0, 3.0, 3.0, 3.0]") == 3


def test_a_late_rank_arriving_as_the_report_is_gathered_is_not_misreported():
    # The last rank sleeps 1.05 s before each of 6 allreduces, so it arrives
    # while the 1 s report is being gathered: the wait is ending.  No report may
    # then describe the next wait (0 s in), come from a rank other than the
    # lowest stalled one, or name no rank behind the wait.  Before the fix about
    # half of them did (reports.h, EveryMemberCame; watchdog.h).
    result = run_mpiexec(3, [sys.executable, PROGRAM, "late", "1.05", "6"],
                         env={"MPICOLL_STALL_REPORT": "1", "MPICOLL_TIMEOUT": "60"}, timeout=180)
    assert result.returncode == 0, result.summary()
    assert result.output.count("allreduce [3.0, 3.0, 3.0, 3.0]") == 3, result.summary()
    for head, lines in _reports(result.output):
        sequence = int(re.search(r"sequence (\d+)", head).group(1))
        behind = [int(s) for line in lines
                  for s in re.findall(r"its last on MPI_COMM_WORLD: sequence (\d+)", line)]
        assert head.startswith("mpicoll: stall report from rank 0 "), result.summary()
        assert float(re.search(r"waiting ([\d.]+) s", head).group(1)) >= 0.95, result.summary()
        assert any(b < sequence for b in behind), result.summary()


def test_ranks_waiting_for_each_other_on_two_communicators_end_the_job_at_once(tmp_path):
    # Rank 1 waits in an allgather on another communicator while rank 0 waits in
    # an allreduce on COMM_WORLD: neither can move, and the watchdog says so
    # within a second or two (csrc/watch/watchdog.h), long before the stall report.
    flight = tmp_path / "flight"
    result = run_mpiexec(2, [sys.executable, PROGRAM, "elsewhere"],
                         env={"MPICOLL_STALL_REPORT": "60", "MPICOLL_TIMEOUT": "120",
                              "MPICOLL_FLIGHT_DIR": str(flight)}, timeout=180)
    assert result.returncode == 3 and "done" not in result.stdout, result.summary()
    assert result.seconds < 30 and not _reports(result.output), result.summary()
    assert result.output.count("the ranks' collectives cannot match") == 1, result.summary()
    assert re.search(r"the ranks wait for each other in collectives on different "
                     r"communicators: rank 0 waits for rank\(s\) 1, which wait in turn for "
                     r"rank 0 elsewhere", result.output), result.summary()
    assert re.search(r"  rank 0 \(.*\): in allreduce\(float32\[4\], op=sum\) on MPI_COMM_WORLD, "
                     r"sequence 2, called at .*stall\.py:\d+", result.output), result.summary()
    assert re.search(r"  rank 1 \(.*\): in allgather\(float32\[2\]\) on comm\d+, sequence 2, "
                     r"called at .*stall\.py:\d+ .*; its last on MPI_COMM_WORLD: sequence 1",
                     result.output), result.summary()
    # The flight recorder: both ranks dumped (rank 1 on the reporting rank's
    # notice), and the reader says where they diverge.
    assert f"flight records: {flight}/rank*.json" in result.output, result.summary()
    assert sorted(p.name for p in flight.glob("rank*.json")) == ["rank0.json", "rank1.json"]
    status, text = mpicoll_command("flight", flight)
    assert status == 1, text
    assert "MPI_COMM_WORLD, local device 0 (ranks 0,1): the ranks diverge\n" \
        "  rank 0 is at sequence 2 that no other rank reached\n" in text, text
    assert re.search(r"  rank 1 has not reached sequence 2 \(its last: sequence 1, "
                     r"allreduce\(float32\[4\]\) at .*stall\.py:\d+", text), text
    assert re.search(r"    rank 0: sequence 2, allreduce\(float32\[4\]\) at .*stall\.py:\d+ .*"
                     r"\(not finished: in it for [\d.]+ s\)", text), text
    assert re.search(r"comm\d+, local device 0 \(ranks 0,1\): the ranks diverge\n"
                     r"  rank 1 is at sequence 2 that no other rank reached\n"
                     r"  rank 0 has not reached sequence 2 \(its last: sequence 1, "
                     r"allgather\(float32\[2\]\)", text), text
    assert "agree" not in text, text


def test_a_stopped_rank_does_not_answer_and_the_timeout_ends_the_job():
    result = run_mpiexec(2, [sys.executable, PROGRAM, "stopped"],
                         env={"MPICOLL_STALL_REPORT": "1", "MPICOLL_TIMEOUT": "6"}, timeout=180)
    assert result.returncode != 0, result.summary()
    reports = _reports(result.output)
    assert reports, result.summary()
    # Named with its host, gathered when the side channel opened.
    host = socket.gethostname()
    assert any(line.startswith(f"rank 1 ({host}): no answer within 3 s")
               for _, lines in reports for line in lines), result.summary()
    assert "MPICOLL_TIMEOUT=6); aborting the job" in result.output


def test_an_error_on_one_rank_is_printed_there_and_named_by_the_others(tmp_path):
    result = run_mpiexec(3, [sys.executable, PROGRAM, "raise-one"], timeout=180,
                         env={"MPICOLL_FLIGHT_DIR": str(tmp_path)})
    assert result.returncode != 0, result.summary()
    assert result.output.count("Traceback (most recent call last)") == 1, result.summary()
    assert "uncaught exception on rank 1 of 3; aborting the job" in result.output
    assert "RuntimeError: deliberate failure on rank 1" in result.output
    # The ranks waiting in the allreduce say who ends the job (when the abort
    # leaves them the time: it kills them 0.3 s later).
    named = re.findall(r"mpicoll: rank (\d): the job is being aborted by rank 1", result.output)
    assert set(named) <= {"0", "2"} and named, result.summary()
    # The aborting rank's flight records are written (and those of the ranks
    # that had time to take its notice).
    reasons = {int(p.stem[4:]): json.loads(p.read_text())["otherData"]["reason"]
               for p in tmp_path.glob("rank*.json")}
    assert reasons.get(1) == "an uncaught exception on this rank", reasons
    assert all(reasons[r] == "aborted by rank 1" for r in reasons if r != 1), reasons


def test_sigusr1_writes_the_flight_records_and_the_job_goes_on(tmp_path):
    result = run_mpiexec(2, [sys.executable, PROGRAM, "sigusr1"], timeout=180,
                         env={"MPICOLL_FLIGHT_DIR": str(tmp_path)})
    assert result.returncode == 0, result.summary()
    assert "rank 0: flight dump written" in result.output, result.summary()
    # Only rank 0 was sent SIGUSR1: rank 1 has no file, so the ranks are not said to
    # agree, and why it may have none is said.
    status, text = mpicoll_command("flight", tmp_path)
    assert status == 1 and "rank 0 (" in text and "written for: SIGUSR1" in text, text
    assert "  rank 1: no flight records (its process had ended, or was not sent SIGUSR1 " \
        "(the files here were written for SIGUSR1; only a rank it is sent to writes one))" \
        in text, text
    data = json.loads((tmp_path / "rank0.json").read_text())
    records = [e for e in data["traceEvents"] if e.get("cat") == "collective"]
    calls = [e for e in records if e["args"]["comm"] == "mpicoll:MPI_COMM_WORLD:device0"]
    # Each split communicator, though MPI gave it the handle of the one freed
    # before it, is named as itself, with its own members, and numbered from 1.
    splits = [(e["args"]["comm"], e["args"]["members"], e["args"]["sequence"])
              for e in records if e not in calls]
    assert splits == [(f"mpicoll:split{i}:device0", "0,1" if i % 2 == 0 else "1,0", 1)
                      for i in range(4)], splits
    # The warm-up and three more allreduces, in order, all finished.
    assert [e["args"]["sequence"] for e in calls] == [1, 2, 3, 4], calls
    assert all(e["args"]["finished_ns"] and e["name"] == "allreduce(float32[4])" and
               e["args"]["bytes"] == 16 and "stall.py" in e["args"]["site"] for e in calls)


def test_the_timeline_shows_the_straggler_on_every_device(tmp_path):
    env = {"MPICOLL_TRACE": str(tmp_path),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = run_mpiexec(3, [sys.executable, PROGRAM, "straggler", "0.05"], timeout=240, env=env)
    assert result.returncode == 0, result.summary()
    done = subprocess.run([sys.executable, "-m", "mpicoll", "trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the straggler: rank 2" in done.stdout, done.stdout
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]) for e in merged if e.get("ph") == "X"}
    assert tracks == {(r, d) for r in range(3) for d in range(2)}, tracks
    # Ranks 0 and 1 wait about 50 ms for rank 2 in each of the 5 late calls.
    for rank in (0, 1):
        waits = [e["dur"] for e in merged if e.get("cat") == "wait" and e["pid"] == rank]
        assert sum(w > 30e3 for w in waits) >= 2 * 5, (rank, waits)
    # Rank 2 itself mostly does not wait: the first call's compile skew and the odd
    # descheduled thread (6 device threads on 2 cores here) aside.
    late = [e["dur"] for e in merged if e.get("cat") == "wait" and e["pid"] == 2]
    calls = [e for e in merged if e.get("ph") == "X" and e.get("cat") != "wait"
             and e["pid"] == 2]
    assert len(calls) >= 2 * 5 and sum(w > 30e3 for w in late) <= len(calls) // 4, (calls, late)
    svg = (tmp_path / "timeline.svg").read_text()
    assert svg.startswith("<svg") and "rank 2 dev 1" in svg


TIMELINE = Path(__file__).parent / "programs" / "timeline.py"


def _trace_summary(directory, *flags):
    done = subprocess.run([sys.executable, "-m", "mpicoll", "trace", str(directory), *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_slow_compile_on_one_rank_is_warm_up_not_a_straggler(tmp_path):
    # The last rank reaches the step's first call 0.4 s late (its compile);
    # the 20 calls after are balanced.  Only --all counts the first call.
    result = run_mpiexec(2, [sys.executable, TIMELINE, "slow-compile", "0.4"], timeout=120,
                         env={"MPICOLL_TRACE": str(tmp_path)})
    assert result.returncode == 0, result.summary()
    def waits_ms(summary):
        return {int(m[1]): float(m[2])
                for m in re.finditer(r"^\s+(\d)\s+\S+\s+\d+\s+([\d.]+)", summary, re.M)}

    # The slow rank is not named, and its 0.4 s is nobody's wait.  (On 2 cores the
    # balanced calls can still find the other rank 0.3 ms later each time, and
    # name it: rank 0 was, in one full serial run.)
    summary = _trace_summary(tmp_path)
    assert "the straggler: rank 1" not in summary, summary
    assert "left out below: the first call of their call site" in summary, summary
    assert max(waits_ms(summary).values()) < 50, summary
    waits = waits_ms(_trace_summary(tmp_path, "--all"))
    assert waits[0] >= 350 and waits[1] < 100, waits


def test_the_end_of_job_summary_says_who_waited_and_how_long(tmp_path):
    """MPICOLL_SUMMARY=1: rank 0 prints once, at the end, each rank's time in
    collectives with its waiting for peers (ranks 0 and 1 waited about 10 x 50 ms for
    rank 2), and the kinds by time with their calls and bytes; without it, nothing."""
    result = run_mpiexec(3, [sys.executable, TIMELINE, "summary", "0.05"], timeout=120,
                         env={"MPICOLL_SUMMARY": "1"})
    assert result.returncode == 0, result.summary()
    assert result.output.count("mpicoll: communication summary (MPICOLL_SUMMARY=1), 3 ranks:") \
        == 1, result.summary()
    rows = {int(m[1]): m for m in re.finditer(
        r"^\s+(\d)\s+\S+\s+([\d.]+) (s|ms)\s+([\d.]+) (s|ms|us) \(\d+%\)\s+([\d.]+) (s|ms|us)",
        result.output, re.M)}
    assert sorted(rows) == [0, 1, 2], result.summary()
    waited = {rank: float(m[6]) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m[7]]
              for rank, m in rows.items()}
    assert waited[0] > 0.35 and waited[1] > 0.35 and waited[2] < 0.2, waited
    kinds = dict(re.findall(r"^    (\w+)\s+(\d+) calls\s+16 B/call", result.output, re.M))
    assert kinds == {"allreduce": "10", "allgather": "1"}, result.summary()
    quiet = run_mpiexec(2, [sys.executable, TIMELINE, "summary", "0"], timeout=120)
    assert quiet.returncode == 0 and "communication summary" not in quiet.output, \
        quiet.summary()


def test_a_trace_started_and_stopped_in_code_holds_its_calls_alone(tmp_path):
    result = run_mpiexec(3, [sys.executable, TIMELINE, "in-code", str(tmp_path)], timeout=120)
    assert result.returncode == 0, result.summary()
    for rank in range(3):
        assert f"rank {rank}: traced to {tmp_path}/block\n" in result.output, result.summary()
        assert f"rank {rank}: traced to {tmp_path}/skipped/rank{rank}.json" in result.output
    for name, ops in (("block", ["allreduce", "allgather"] * 5), ("skipped", ["allreduce"] * 2)):
        files = records.load(tmp_path / name)
        assert [f.rank for f in files] == [0, 1, 2]
        for f in files:
            assert [r.op for r in f.records] == ops, (name, f.rank, f.records)
            assert f.kept == "all" and f.reason == "stop_trace"
            assert all(r.finished_ns for r in f.records)
        # the same collectives on every rank: one sequence per call on its communicator
        assert len({(r.comm, r.sequence) for f in files for r in f.records}) == len(ops)
    assert "timeline of 3 ranks, 30 collectives" in _trace_summary(tmp_path / "block")


# One rank prints the traceback and the others a line naming it.  Raised within
# the 100 ms the abort settles, the lowest prints it; oversubscribed ranks reach
# the hook further apart than that, so raise-all accepts any one.  Raised apart,
# the first prints it (and the others may be ended before they print their line).
@pytest.mark.parametrize("case,first,error", [
    ("raise-all", None, "ValueError: mpicoll.allreduce: unknown op='nope'"),
    ("raise-all-last-first", 2, "RuntimeError: the same failure on every rank")])
def test_the_same_error_on_every_rank_is_printed_once_without_mpicolls_frames(case, first,
                                                                              error):
    result = run_mpiexec(3, [sys.executable, PROGRAM, case], timeout=180)
    assert result.returncode != 0, result.summary()
    assert result.output.count("Traceback (most recent call last)") == 1, result.summary()
    printed = re.search(r"uncaught exception on rank (\d) of 3; aborting the job",
                        result.output)
    assert printed, result.summary()
    printing = int(printed[1])
    assert printing in ({0, 1, 2} if first is None else {first}), result.summary()
    too = re.findall(r"mpicoll: uncaught (\w+) on rank (\d) too: (.*) \(rank (\d) prints its "
                     r"traceback; aborting the job\)", result.output)
    assert all(f"{kind}: {text}".startswith(error) and int(names) == printing
               for kind, _, text, names in too), result.summary()
    if first is None:
        assert {int(rank) for _, rank, _, _ in too} == {0, 1, 2} - {printing}, result.summary()
    traceback = result.output.split("Traceback (most recent call last)")[1]
    traceback = traceback.split(error)[0]
    # mpicoll's own frames are its package folder's (the checkout's folder may be named
    # mpicoll too: docs/install.md clones into one).
    package = str(Path(__file__).resolve().parent.parent / "mpicoll") + "/"
    assert "stall.py" in traceback and package not in traceback, traceback


# --- Where every rank is: Python stacks in reports, records gathered ----------------------

def _per_rank_temp_dirs(base, ranks, argv):
    """argv run with TMPDIR=base/<rank>: each rank's temporary folder apart, as on separate
    hosts without shared storage."""
    for r in range(ranks):
        (base / str(r)).mkdir(parents=True)
    rank = "${PMI_RANK:-$OMPI_COMM_WORLD_RANK}"
    return ["sh", "-c", f'TMPDIR="{base}/{rank}" exec "$0" "$@"', *map(str, argv)]


def _stack_of(lines, rank):
    """The Python stack lines under rank `rank`'s line in a report's lines."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"rank {rank} ("))
    stack = []
    for line in lines[start + 1:]:
        if line.startswith(("rank ", "flight records", "(next report")):
            break
        stack.append(line)
    return stack


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_busy_rank_is_shown_where_it_is_in_its_python_code(ranks, tmp_path):
    # Rank 1 in a numpy loop (2 ranks) or asleep in Python (3 ranks), rank 2 in a C
    # function holding the GIL: each answers with its main thread's frames,
    # innermost first, with their source lines.  Each rank's temporary folder is
    # its own: the report's folder holds every rank's records all the same.
    argv = _per_rank_temp_dirs(tmp_path, ranks, [sys.executable, PROGRAM, "busy", "3"])
    result = run_mpiexec(ranks, argv, timeout=180, env={
        "MPICOLL_STALL_REPORT": "1", "MPICOLL_TIMEOUT": "60", "MPICOLL_FLIGHT_DIR": ""})
    assert result.returncode == 0 and result.output.count(": done") == ranks, result.summary()
    reports = _reports(result.output)
    assert reports, result.summary()
    _, lines = reports[0]
    expected = {1: ("multiply_matrices", "a = np.tanh(a @ a)") if ranks == 2
                else ("load_batch", "time.sleep(seconds)"),
                2: ("hold_the_gil", "ctypes.PyDLL(None).usleep(int(seconds * 1e6))")}
    for rank in range(1, ranks):
        function, source = expected[rank]
        stack = _stack_of(lines, rank)
        assert stack[0] == "Python, main thread (innermost first):", lines
        assert re.fullmatch(rf"tests/programs/stall\.py:\d+ in {function}: "
                            rf"{re.escape(source)}.*", stack[1]), lines
        assert re.fullmatch(r"tests/programs/stall\.py:\d+ in <module>: \w+\(SLEEP\)",
                            stack[2]), lines
    # Rank 0 waits in the collective: the report names its call, no stack.
    folder = Path(re.search(r"flight records: (\S+)/rank\*\.json", result.output).group(1))
    assert folder.parent == tmp_path / "0" / f"mpicoll-{os.geteuid()}", folder  # its own
    assert sorted(p.name for p in folder.glob("rank*.json")) == \
        [f"rank{r}.json" for r in range(ranks)], list(folder.iterdir())
    for r in range(1, ranks):  # each other rank's own copy stays in its own folder
        assert (tmp_path / str(r) / folder.parent.name / folder.name / f"rank{r}.json").exists()
    status, text = mpicoll_command("flight", folder)
    assert "no flight records" not in text and all(f"rank {r} (" in text for r in range(ranks)), \
        text


def test_python_m_mpicoll_stacks_shows_every_rank_of_a_live_job():
    # Rank 1 asks, from a thread, while its main thread sleeps and rank 0 waits.
    result = run_mpiexec(2, [sys.executable, PROGRAM, "stacks", "4"],
                         env={"MPICOLL_STALL_REPORT": "60"}, timeout=180)
    assert result.returncode == 0, result.summary()
    assert "found rank 0's process as rank 0" in result.output, result.summary()
    assert "stacks exit 0\n" in result.stdout, result.summary()
    answer = result.stdout.split("stacks exit 0\n", 1)[1]
    lines = [line.strip() for line in answer.splitlines()]
    assert lines[0] == "mpicoll: where every rank is (asked on rank 0)", answer
    assert re.fullmatch(r"rank 0 \(.*\): in allreduce\(float32\[4\], op=sum\) on MPI_COMM_WORLD, "
                        r"sequence 2, called at .*stall\.py:\d+ \(<lambda>\) for [\d.]+ s",
                        lines[1]), answer
    # Its innermost frames may be JAX's own (a newer JAX's block_until_ready is Python).
    assert any(re.fullmatch(r"tests/programs/stall\.py:\d+ in <module>: "
                            r"summed\(jnp\.ones\(4\)\)\.block_until_ready\(\)", line)
               for line in _stack_of(lines, 0)), answer
    assert re.fullmatch(r"rank 1 \(.*\): not in an mpicoll collective for [\d.]+ s",
                        lines[lines.index(_stack_of(lines, 0)[-1]) + 1]), answer
    assert re.fullmatch(r"tests/programs/stall\.py:\d+ in load_batch: time\.sleep\(seconds\)",
                        _stack_of(lines, 1)[1]), answer
    # The job's own output has it too (printed by the rank asked).
    assert result.stderr.count("mpicoll: where every rank is") == 1, result.summary()


def test_the_rank_printing_a_traceback_gathers_the_records_of_the_others(tmp_path):
    argv = _per_rank_temp_dirs(tmp_path, 2, [sys.executable, PROGRAM, "raise-one"])
    result = run_mpiexec(2, argv, timeout=180, env={"MPICOLL_FLIGHT_DIR": ""})
    assert result.returncode != 0, result.summary()
    folder = Path(re.search(r"the ranks' last collectives: (\S+)/rank\*\.json",
                            result.output).group(1))
    assert folder.parent == tmp_path / "1" / f"mpicoll-{os.geteuid()}", result.summary()
    reasons = {int(p.stem[4:]): json.loads(p.read_text())["otherData"]["reason"]
               for p in folder.glob("rank*.json")}
    assert reasons == {0: "aborted by rank 1", 1: "an uncaught exception on this rank"}, reasons


def test_a_process_reads_its_own_python_stack_as_a_report_prints_it():
    from mpicoll._src.runtime.native import extension

    text = extension.python_stacks()  # read as the watchdog reads it: without the GIL
    lines = text.splitlines()
    assert lines[0] == "    Python, main thread (innermost first):", text
    assert re.fullmatch(r"      tests/test_watchdog\.py:\d+ in "
                        r"test_a_process_reads_its_own_python_stack_as_a_report_prints_it: "
                        r"text = extension\.python_stacks\(\)  # read as .*", lines[1]), text
    assert len(lines) == 5 and all(" in " in line for line in lines[1:]), text  # 4 frames


def test_reading_stacks_while_frames_and_threads_churn_never_crashes_the_process():
    # The read takes no GIL: a frame returning (its data-stack chunk freed) or a
    # thread ending as it is walked makes it fault; the guard (python_stacks.h,
    # ReadGuarded) abandons that read and tries again.  Unguarded, this process
    # crashed (SIGSEGV) within 2 s.
    done = subprocess.run([sys.executable, str(PROGRAM.parent / "stack_reads.py"), "4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    reads, main, unreadable, rounds = map(int, re.findall(r"\d+", done.stdout))
    assert rounds > 100 and reads > 1000, done.stdout
    # Every read shows the main thread's frames or says it could not be read.
    assert main + unreadable == reads and unreadable < reads / 20, done.stdout


def test_the_stacks_command_runs_without_mpi_and_signals_only_mpicoll_ranks():
    # Offline (no MPI, no JAX: it runs beside the job it asks), and a process
    # that is not an mpicoll rank (here PID 1) is refused, never signalled.
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "mpicoll", "stacks", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "python -m mpicoll stacks: process 1 is not running mpicoll on this host" in done.stderr
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "mpicoll._src.observe.stacks" in imported and not imported & {"jax", "mpi4py"}, imported
    # --launcher: only the ranks a launcher started (its descendants) are asked.
    with subprocess.Popen(["sleep", "60"]) as not_a_launcher:
        done = subprocess.run([sys.executable, "-m", "mpicoll", "stacks", "--launcher",
                               str(not_a_launcher.pid)], capture_output=True, text=True, timeout=60)
        not_a_launcher.kill()
    assert done.returncode == 1 and (f"process {not_a_launcher.pid} launched no mpicoll rank on "
                                     "this host") in done.stderr, done.stderr

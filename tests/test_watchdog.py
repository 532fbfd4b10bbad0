"""What the job says when it is stuck or failing (csrc/core/watchdog.h), in jobs of 2-3 ranks.

Stall reports: tests/programs/stall.py with MPICOLL_STALL_REPORT=1: one report
per stall for the whole job (the lowest stalled rank's), naming the ranks that
have arrived and what each other rank is doing, asked over the watchdogs' own
communicator while the stalled ranks' threads are stuck in MPI; the timeout
ends the job with it.  Uncaught exceptions: one traceback per job, from the
rank whose error ends it, mpicoll's own frames left out.
"""

import re
import sys
from pathlib import Path

import pytest

from conftest import run_mpiexec, serial_only

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
                    r"allreduce\(float32\[4\]\) on MPI_COMM_WORLD \(as rank 0, local device 0\), "
                    r"sequence 2, called at .*stall\.py:\d+ ", head), head
    assert lines[0] == "arrived (2 of 3 ranks): 0 1", lines
    assert re.match(r"rank 2 \(.*\): not in an mpicoll collective for [\d.]+ s$", lines[1]), lines
    assert result.output.count("allreduce [3.0, 3.0, 3.0, 3.0]") == 3


def test_a_rank_in_another_collective_is_named_and_the_timeout_ends_the_job():
    result = run_mpiexec(2, [sys.executable, PROGRAM, "elsewhere"],
                         env={"MPICOLL_STALL_REPORT": "1", "MPICOLL_TIMEOUT": "4"}, timeout=180)
    assert result.returncode != 0 and "done" not in result.stdout, result.summary()
    reports = _reports(result.output)
    assert reports and all(head.startswith("mpicoll: stall report from rank 0")
                           for head, _ in reports), result.summary()
    head, lines = reports[-1]
    assert "allreduce(float32[4])" in head and "on MPI_COMM_WORLD" in head
    assert lines[0] == "arrived (1 of 2 ranks): 0"
    assert re.match(r"rank 1 \(.*\): for [\d.]+ s in allgather\(float32\[2\]\) on comm\d+ "
                    r"\(as rank 1, local device 0\), sequence 2, called at .*stall\.py:\d+ ",
                    lines[1]), lines
    assert re.search(r"mpicoll: rank 0 \(rank 0 of MPI_COMM_WORLD, local device 0\) has waited "
                     r"[\d.]+ s in allreduce \(MPICOLL_TIMEOUT=4\); aborting the job",
                     result.output), result.summary()


def test_a_stopped_rank_does_not_answer_and_the_timeout_ends_the_job():
    result = run_mpiexec(2, [sys.executable, PROGRAM, "stopped"],
                         env={"MPICOLL_STALL_REPORT": "1", "MPICOLL_TIMEOUT": "6"}, timeout=180)
    assert result.returncode != 0, result.summary()
    reports = _reports(result.output)
    assert reports, result.summary()
    assert any(re.match(r"rank 1: no answer within 3 s", line)
               for _, lines in reports for line in lines), result.summary()
    assert "MPICOLL_TIMEOUT=6); aborting the job" in result.output


def test_an_error_on_one_rank_is_printed_there_and_named_by_the_others():
    result = run_mpiexec(3, [sys.executable, PROGRAM, "raise-one"], timeout=180)
    assert result.returncode != 0, result.summary()
    assert result.output.count("Traceback (most recent call last)") == 1, result.summary()
    assert "uncaught exception on rank 1 of 3; aborting the job" in result.output
    assert "RuntimeError: deliberate failure on rank 1" in result.output
    # The ranks waiting in the allreduce say who ends the job (when the abort
    # leaves them the time: it kills them 0.3 s later).
    named = re.findall(r"mpicoll: rank (\d): the job is being aborted by rank 1", result.output)
    assert set(named) <= {"0", "2"} and named, result.summary()


def test_the_same_error_on_every_rank_is_printed_once_without_mpicolls_frames():
    result = run_mpiexec(3, [sys.executable, PROGRAM, "raise-all"], timeout=180)
    assert result.returncode != 0, result.summary()
    assert result.output.count("Traceback (most recent call last)") == 1, result.summary()
    assert "uncaught exception on rank 0 of 3; aborting the job" in result.output
    for rank in (1, 2):
        assert (f"mpicoll: uncaught ValueError on rank {rank} too: mpicoll.allreduce: unknown "
                "op='nope'") in result.output, result.summary()
    traceback = result.output.split("Traceback (most recent call last)")[1]
    traceback = traceback.split("ValueError")[0]
    assert "stall.py" in traceback and "/mpicoll/" not in traceback, traceback

"""Reading the flight recorder's dumps and the timeline (mpicoll/_src/observe/records.py) on
records made up here (one rank<r>.json per rank, as csrc/watch/flight.h writes them),
where the answer is known; and XLA's own profiler naming mpicoll's calls.  The jobs that
write real records are in test_watchdog.py."""

import glob
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import mpicoll
from conftest import environment_outside_the_job, mpicoll_command
from mpicoll._src.observe import records, timeline

WORLD = "mpicoll:MPI_COMM_WORLD:device0"


def _event(rank, sequence, call, started, finished, comm=WORLD, members="0,1,2", device=0,
           site=None):
    return {"ph": "X", "cat": "collective", "name": call, "pid": rank, "tid": device,
            "ts": started / 1e3, "dur": ((finished or started) - started) / 1e3,
            "args": {"sequence": sequence, "call": call, "op": call.split("(")[0],
                     "comm": comm, "members": members, "comm_rank": rank, "comm_size": 3,
                     "dtype": "float32", "shape": [4], "bytes": 16,
                     "site": site or f"job.py:{sequence}",
                     "queued_ns": started, "started_ns": started, "finished_ns": finished,
                     "failed": False}}


def _write(directory, rank, events, offset=0, written=10_000_000_000, size=3, reason="test"):
    data = {"otherData": {"mpicoll": 1, "rank": rank, "size": size, "host": f"node{rank}",
                          "reason": reason, "written_ns": written, "clock_offset_ns": offset,
                          "kept": "last"},
            "traceEvents": events}
    (directory / f"rank{rank}.json").write_text(json.dumps(data))


def test_the_installed_mpicoll_command_reads_records_without_mpi_or_jax(tmp_path):
    # `mpicoll flight DIR` (the console script setup.cfg installs) is offline as
    # `python -m mpicoll flight DIR` is: it runs on a login node, beside a live job.
    for rank in range(3):
        _write(tmp_path, rank, _allreduces(rank, 5))
    script = Path(sys.executable).parent / "mpicoll"
    assert script.exists(), f"no {script}: `make install` installs the mpicoll command"
    env = environment_outside_the_job(standalone=True)
    done = subprocess.run([sys.executable, "-X", "importtime", str(script), "flight",
                           str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "the ranks agree" in done.stdout, done.stdout + done.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "mpicoll" in imported and not {"jax", "mpi4py"} & imported, sorted(imported)


def _allreduces(rank, last, running=None, members="0,1,2"):
    """Sequences 1..last of allreduce on WORLD, each started at second s and finished
    0.2 s later, but `running` (a sequence number) not finished at the dump (second 10)."""
    return [_event(rank, s, "allreduce(float32[4])", s * 10**9,
                   None if s == running else s * 10**9 + 200_000_000, members=members)
            for s in range(1, last + 1)]


def test_ranks_that_agree_are_said_to(tmp_path):
    for rank in range(3):
        _write(tmp_path, rank, _allreduces(rank, 5))
    status, text = mpicoll_command("flight", tmp_path)
    assert status == 0, text
    assert "MPI_COMM_WORLD, local device 0 (ranks 0,1,2): the ranks agree, each at sequence 5\n"\
        "  ranks 0-2: sequence 5, allreduce(float32[4]) at job.py:5 (finished 4.8 s before the "\
        "dump)" in text, text
    assert text.endswith("the ranks agree: every rank wrote its records, and on every "
                         "communicator every member is at the same sequence number, having "
                         "called the same collectives\n"), text


def test_a_rank_that_skipped_a_collective_is_named_behind(tmp_path):
    # Ranks 0 and 2 wait in sequence 6; rank 1 skipped it and finished its script, but
    # was asked for its records before it ended.
    for rank in range(3):
        _write(tmp_path, rank, _allreduces(rank, 5) if rank == 1
               else _allreduces(rank, 6, running=6))
    status, text = mpicoll_command("flight", tmp_path)
    assert status == 1, text
    assert "MPI_COMM_WORLD, local device 0 (ranks 0,1,2): the ranks diverge\n" \
        "  rank 1 has not reached sequence 6 (its last: sequence 5, allreduce(float32[4]) at " \
        "job.py:5)\n" in text, text
    assert "  each rank's last collective here:\n" \
        "    ranks 0, 2: sequence 6, allreduce(float32[4]) at job.py:6 (not finished: in it " \
        "for 4.0 s)\n" \
        "    rank 1: sequence 5, allreduce(float32[4]) at job.py:5 (finished 4.8 s before the " \
        "dump)\n" in text, text
    assert "is at sequence" not in text and "agree" not in text, text  # two of three are at 6
    assert text.endswith("the ranks diverge on 1 of 1 communicator (above)\n"), text


MEETING = "mpicoll:MPI_COMM_WORLD:meeting of devices 0,1"


def _meetings(rank, last, device, running=None):
    """Meetings 1..last of local `device` (csrc/meeting/meeting.cc records each device's),
    `running` not finished at the dump, on 2 ranks."""
    return [_event(rank, s, "allreduce(float32[4])", s * 10**9,
                   None if s == running else s * 10**9 + 200_000_000, comm=MEETING,
                   members="0,1", device=device)
            for s in range(1, last + 1)]


def test_local_devices_that_did_not_meet_are_not_a_skipped_collective(tmp_path):
    # Rank 1's device 1 never reached meeting 6 (stopped in a host callback, say): its
    # device 0 waits there, and so rank 1's leader never joined rank 0's MPI call.
    _write(tmp_path, 0, _allreduces(0, 6, running=6, members="0,1")
           + _meetings(0, 6, 0, running=6) + _meetings(0, 6, 1, running=6), size=2)
    _write(tmp_path, 1, _allreduces(1, 5, members="0,1")
           + _meetings(1, 6, 0, running=6) + _meetings(1, 5, 1), size=2)
    text, diverged = records.flight_report(records.load(tmp_path))
    assert diverged, text
    assert "  rank 1 has not reached sequence 6 (its last: sequence 5, allreduce(float32[4]) " \
        "at job.py:5; its local devices did not meet: below)\n" in text, text
    assert "MPI_COMM_WORLD, rank 1: its local devices 0, 1 did not meet\n" \
        "  local device 0 waits in meeting 6, allreduce(float32[4]) at job.py:6 (not " \
        "finished: in it for 4.0 s)\n" \
        "  local device 1 has not arrived (its last: meeting 5, allreduce(float32[4]) at " \
        "job.py:5 (finished 4.8 s before the dump))\n" in text, text
    assert "meeting of devices" not in text, text  # no cross-rank verdict on the meetings
    assert text.endswith("the ranks did not skip a collective: the local devices of rank 1 "
                         "did not meet (above)"), text
    assert [(u.rank, [r.device for r in u.waiting], list(u.absent))
            for u in records.unmet_meetings(records.load(tmp_path))] == [(1, [0], [1])]


def test_a_rank_whose_devices_all_skipped_a_meeting_skipped_a_collective(tmp_path):
    # Every device of rank 1 is at meeting 5: they met; rank 1's program is behind.
    _write(tmp_path, 0, _allreduces(0, 6, running=6, members="0,1")
           + _meetings(0, 6, 0, running=6) + _meetings(0, 6, 1, running=6), size=2)
    _write(tmp_path, 1, _allreduces(1, 5, members="0,1")
           + _meetings(1, 5, 0) + _meetings(1, 5, 1), size=2)
    text, diverged = records.flight_report(records.load(tmp_path))
    assert diverged and not records.unmet_meetings(records.load(tmp_path)), text
    assert "did not meet" not in text, text
    assert text.endswith("the ranks diverge on 1 of 1 communicator (above)"), text


def test_a_rank_without_a_file_is_a_divergence(tmp_path):
    # Rank 1 finished its script (it wrote nothing) while ranks 0 and 2 wait in sequence 6.
    for rank in (0, 2):
        _write(tmp_path, rank, _allreduces(rank, 6, running=6))
    files = records.load(tmp_path)
    [stream] = records.divergences(files)
    assert stream.no_file == [1] and not stream.behind and stream.top == 6
    text, diverged = records.flight_report(files)
    assert diverged, text
    assert "flight records of 2 of 3 ranks" in text
    assert "  rank 0 (node0): 6 records, written for: test\n" \
        "  rank 1: no flight records (its process had ended or could not be asked)\n" \
        "  rank 2 (node2): 6 records, written for: test\n" in text, text
    assert "the ranks diverge\n" \
        "  rank 1: no flight records (its process had ended or could not be asked)\n" in text
    assert "agree" not in text, text
    # And at the command line: exit 1.
    assert mpicoll_command("flight", tmp_path) == (1, text + "\n")


def test_a_rank_with_a_file_but_no_record_on_a_communicator_has_not_reached_it(tmp_path):
    # Rank 2 never called on comm7 (ranks 0 and 1 are in its first collective).
    split = "mpicoll:comm7:device0"
    for rank in range(3):
        events = _allreduces(rank, 2)
        if rank != 2:
            events.append(_event(rank, 1, "allgather(float32[4])", 3 * 10**9, None, comm=split))
        _write(tmp_path, rank, events)
    text, diverged = records.flight_report(records.load(tmp_path))
    assert diverged
    assert "comm7, local device 0 (ranks 0,1,2): the ranks diverge\n" \
        "  rank 2 has not reached sequence 1 (none of the 2 records it kept is on this " \
        "communicator)\n" in text, text
    assert "MPI_COMM_WORLD, local device 0 (ranks 0,1,2): the ranks agree, each at sequence 2"\
        in text
    # The communicators that diverge come first.
    assert text.index("comm7") < text.index("MPI_COMM_WORLD"), text
    assert text.endswith("the ranks diverge on 1 of 2 communicators (above)"), text


def test_a_rank_that_added_a_collective_is_named_ahead(tmp_path):
    # Rank 0 called one allreduce more than ranks 1 and 2 (which were asked while they
    # were in Python, between collectives).
    for rank in range(3):
        _write(tmp_path, rank, _allreduces(rank, 6, running=6) if rank == 0
               else _allreduces(rank, 5))
    status, text = mpicoll_command("flight", tmp_path)
    assert status == 1, text
    assert "the ranks diverge\n" \
        "  rank 0 is at sequence 6 that no other rank reached\n" \
        "  ranks 1, 2 have not reached sequence 6 (their last: sequence 5, " \
        "allreduce(float32[4]) at job.py:5)\n" in text, text
    assert "    rank 0: sequence 6, allreduce(float32[4]) at job.py:6 (not finished: in it " \
        "for 4.0 s)\n" in text, text
    assert "agree" not in text, text


def test_a_multi_line_reason_is_printed_under_its_rank(tmp_path):
    report = ("mpicoll: the ranks diverge on MPI_COMM_WORLD\n"
              "  rank 1 has not reached sequence 6\n")
    for rank in range(2):
        _write(tmp_path, rank, _allreduces(rank, 5, members="0,1"), size=2,
               reason=report if rank == 0 else "asked by rank 0")
    text, diverged = records.flight_report(records.load(tmp_path))
    assert not diverged, text
    assert "  rank 0 (node0): 5 records, written for:\n" \
        "      mpicoll: the ranks diverge on MPI_COMM_WORLD\n" \
        "        rank 1 has not reached sequence 6\n" \
        "  rank 1 (node1): 5 records, written for: asked by rank 0\n" in text, text


def test_the_first_sequence_where_calls_differ_or_a_rank_is_missing_is_named(tmp_path):
    calls = ["allreduce(float32[4])"] * 3 + ["bcast(float32[4])"]
    for rank in range(3):
        events = [_event(rank, s + 1, call, s * 1000, s * 1000 + 50) for s, call in enumerate(calls)]
        if rank == 1:  # rank 1 called allgather at sequence 3
            events[2] = _event(1, 3, "allgather(float32[4])", 2000, 2050)
        _write(tmp_path, rank, events)
    # On a second communicator, rank 2 never reached sequence 2 (the others are in it).
    split = "mpicoll:comm7:device0"
    for rank in range(3):
        events = [_event(rank, 1, "allreduce(float32[4])", 5000, 5050, comm=split)]
        if rank != 2:
            events.append(_event(rank, 2, "allreduce(float32[4])", 6000, None, comm=split))
        data = json.loads((tmp_path / f"rank{rank}.json").read_text())
        data["traceEvents"] += events
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(data))
    found = {d.comm: d for d in records.divergences(records.load(tmp_path))}
    assert found[WORLD].differ_at == 3 and not found[WORLD].behind
    assert {r: c.call for r, c in found[WORLD].calls.items()} == {
        0: "allreduce(float32[4])", 1: "allgather(float32[4])", 2: "allreduce(float32[4])"}
    assert found[split].differ_at is None and found[split].top == 2
    assert found[split].behind[2].sequence == 1
    text, diverged = records.flight_report(records.load(tmp_path))
    assert diverged
    assert "MPI_COMM_WORLD, local device 0 (ranks 0,1,2): the ranks diverge\n" \
        "  at sequence 3 they called different collectives (they agree up to 2):\n" in text
    assert "    rank 1: allgather(float32[4]) at job.py:3" in text
    assert "    ranks 0, 2: allreduce(float32[4]) at job.py:3" in text
    assert "comm7, local device 0 (ranks 0,1,2): the ranks diverge" in text
    assert "  rank 2 has not reached sequence 2 (its last: sequence 1, allreduce(float32[4]) " \
        "at job.py:1)" in text, text


def test_a_directory_without_dumps_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no rank<r>.json files"):
        records.load(tmp_path)
    (tmp_path / "rank0.json").write_text("{}")
    with pytest.raises(ValueError, match="not an mpicoll record file"):
        records.load(tmp_path)


def test_the_merge_puts_every_rank_on_rank_0s_clock_and_splits_wait_from_transfer(tmp_path):
    # Rank 1's clock reads 5 ms behind rank 0's; it arrives 2 ms after rank 0
    # (on rank 0's clock) and both finish 0.5 ms after it arrives.  Sequence 1 is
    # the site's first call (warm-up, left out of the totals); 2 is the same.
    def calls(rank, arrive, offset):
        return [_event(rank, s, "allreduce(float32[4])", arrive + s * 10_000_000 - offset,
                       12_500_000 + s * 10_000_000 - offset, members="0,1", site="job.py:1")
                for s in (1, 2)]
    _write(tmp_path, 0, calls(0, 10_000_000, 0), size=2)
    _write(tmp_path, 1, calls(1, 12_000_000, 5_000_000), offset=5_000_000, size=2)
    files = records.load(tmp_path)
    spans = {(s.rank, s.sequence): s for s in timeline.spans(files)}
    assert spans[0, 2].wait_ns == 2_000_000 and spans[0, 2].transfer_ns == 500_000
    assert spans[1, 2].wait_ns == 0 and spans[1, 2].transfer_ns == 500_000
    assert spans[0, 1].warm_up and spans[1, 1].warm_up and not spans[0, 2].warm_up
    assert timeline.totals(spans.values()) == {0: (1, 2_000_000, 500_000, 0),
                                               1: (1, 0, 500_000, 1)}
    summary = timeline.write_merged(str(tmp_path))
    assert "the straggler: rank 1 (it waited least, 0.000 ms, and arrived last 1 times" \
        in summary, summary
    assert "2 of them left out below: the first call of their call site" in summary, summary
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    waits = [e for e in merged if e.get("cat") == "wait"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in waits] == [(0, 0.0, 2000.0),
                                                              (0, 10000.0, 2000.0)]
    transfers = sorted((e["pid"], e["ts"], e["dur"]) for e in merged if e.get("cat") == "transfer")
    assert transfers == [(0, 2000.0, 500.0), (0, 12000.0, 500.0), (1, 2000.0, 500.0),
                         (1, 12000.0, 500.0)]
    assert (tmp_path / "timeline.svg").read_text().count("<rect") >= 8


def _balanced_after_a_slow_compile(directory, ranks, calls=20, trace_skip=0):
    """Every rank calls one site `calls` times; the last rank's first call comes 300 ms late
    (its compile), then the ranks take turns arriving last, 10 us apart."""
    for rank in range(ranks):
        events, clock = [], 0
        for s in range(1, calls + 1):
            late = (300_000_000 if s == 1 else 10_000 * ((s + rank) % ranks == 0))
            arrive = clock + (late if (s == 1 and rank == ranks - 1) or s > 1 else 0)
            last = clock + (300_000_000 if s == 1 else 10_000)
            events.append(_event(rank, s, "allreduce(float32[4])", arrive, last + 50_000,
                                 members=",".join(map(str, range(ranks))), site="job.py:9"))
            clock = last + 1_000_000
        _write(directory, rank, events, size=ranks)
        if trace_skip:
            data = json.loads((directory / f"rank{rank}.json").read_text())
            data["otherData"]["trace_skip"] = trace_skip
            (directory / f"rank{rank}.json").write_text(json.dumps(data))


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_slow_compile_on_one_rank_names_no_straggler(tmp_path, ranks):
    _balanced_after_a_slow_compile(tmp_path, ranks)
    summary = timeline.write_merged(str(tmp_path))
    assert "no straggler" in summary and "the straggler" not in summary, summary
    assert f"{ranks} of them left out below" in summary, summary
    files = records.load(tmp_path)
    assert all(wait < 1_000_000 for _, wait, _, _ in
               timeline.totals(timeline.spans(files)).values())
    # Counted (--all), the others waited 300 ms for the slow compiler, whom the old
    # verdict (the least wait, whatever the others' waits) named the straggler.
    every = timeline.totals(timeline.spans(files, warm_up=False))
    assert all(every[r][1] >= 300_000_000 for r in range(ranks - 1)), every
    assert min(every, key=lambda r: every[r][1]) == ranks - 1


def test_a_trace_that_skipped_warm_up_is_counted_whole(tmp_path):
    # Recorded with a skip, the files hold no compile: their first calls count.
    _balanced_after_a_slow_compile(tmp_path, 2, trace_skip=1)
    files = records.load(tmp_path)
    assert files[0].trace_skip == 1
    assert not any(s.warm_up for s in timeline.spans(files))


def test_a_straggler_after_warm_up_is_named(tmp_path):
    # Rank 2 arrives 5 ms after the others in each of 10 calls of one site.
    for rank in range(3):
        events = [_event(rank, s, "allreduce(float32[4])",
                         s * 10**8 + (5_000_000 if rank == 2 else 0), s * 10**8 + 5_100_000,
                         site="job.py:9")
                  for s in range(1, 11)]
        _write(tmp_path, rank, events)
    summary = timeline.write_merged(str(tmp_path))
    assert "the straggler: rank 2 (it waited least, 0.000 ms, and arrived last 9 times; the " \
        "others waited 45.000 ms each on average" in summary, summary


def test_a_running_program_traces_between_start_and_stop(tmp_path):
    step = jax.jit(lambda x: mpicoll.allreduce(x))
    step(jnp.ones(4)).block_until_ready()
    with pytest.raises(RuntimeError, match="mpicoll.stop_trace: no trace runs"):
        mpicoll.stop_trace()
    with mpicoll.trace(tmp_path / "one") as directory:
        assert directory == str(tmp_path / "one")
        with pytest.raises(RuntimeError, match=r"mpicoll.start_trace: a trace to .*one runs "
                                               r"already \(start_trace\)"):
            mpicoll.start_trace(tmp_path / "two")
        for _ in range(3):
            step(jnp.ones(4))
    calls = records.load(tmp_path / "one")[0].records
    assert [r.op for r in calls] == ["allreduce"] * 3
    assert len({r.sequence for r in calls}) == 3
    mpicoll.start_trace(tmp_path / "two", skip=2)
    for _ in range(3):
        step(jnp.ones(4))
    # (under the multi-rank suite each rank traces to its own tmp_path)
    from mpi4py import MPI
    assert mpicoll.stop_trace() == str(tmp_path / "two" / f"rank{MPI.COMM_WORLD.Get_rank()}.json")
    assert len(records.load(tmp_path / "two")[0].records) == 1
    with pytest.raises(ValueError, match="skip must be a whole number"):
        mpicoll.start_trace(tmp_path / "three", skip=-1)
    with pytest.raises(ValueError, match="cannot write there"):
        mpicoll.start_trace("/proc/mpicoll-trace")


def test_xlas_profiler_names_mpicolls_calls(tmp_path):
    # jax.profiler (XLA's profiler) shows each custom call by its HLO name,
    # mpicoll_<collective>.N, beside XLA's own work: nothing to add for it.
    step = jax.jit(lambda x: mpicoll.allreduce(x * 2.0) + 1.0)
    step(jnp.ones(4)).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        step(jnp.ones(4)).block_until_ready()
    from jax.profiler import ProfileData
    names = set()
    for path in glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True):
        for plane in ProfileData.from_file(path).planes:
            for line in plane.lines:
                names.update(event.name for event in line.events)
    assert any(name.startswith("mpicoll_allreduce") for name in names), sorted(names)[:50]



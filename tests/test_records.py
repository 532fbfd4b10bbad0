"""Reading the flight recorder's dumps and the timeline (mpicoll/_records.py) on
records made up here, where the answer is known; and XLA's own profiler naming
mpicoll's calls.  The jobs that write real records are in test_watchdog.py."""

import glob
import json

import jax
import jax.numpy as jnp
import pytest

import mpicoll
from mpicoll import _records

WORLD = "mpicoll:MPI_COMM_WORLD:device0"


def _event(rank, sequence, call, started, finished, comm=WORLD, members="0,1,2", device=0):
    return {"ph": "X", "cat": "collective", "name": call, "pid": rank, "tid": device,
            "ts": started / 1e3, "dur": ((finished or started) - started) / 1e3,
            "args": {"sequence": sequence, "call": call, "op": call.split("(")[0],
                     "comm": comm, "members": members, "comm_rank": rank, "comm_size": 3,
                     "dtype": "float32", "shape": [4], "bytes": 16, "site": f"job.py:{sequence}",
                     "queued_ns": started, "started_ns": started, "finished_ns": finished,
                     "failed": False}}


def _write(directory, rank, events, offset=0, written=10_000_000_000, size=3):
    data = {"otherData": {"mpicoll": 1, "rank": rank, "size": size, "host": f"node{rank}",
                          "reason": "test", "written_ns": written, "clock_offset_ns": offset,
                          "kept": "last"},
            "traceEvents": events}
    (directory / f"rank{rank}.json").write_text(json.dumps(data))


def test_ranks_that_agree_are_said_to(tmp_path):
    for rank in range(3):
        _write(tmp_path, rank, [_event(rank, s, "allreduce(float32[4])", s * 1000, s * 1000 + 50)
                                for s in range(1, 6)])
    text, diverged = _records.flight_report(_records.load(tmp_path))
    assert not diverged and "the ranks agree" in text, text


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
    found = {d.comm: d for d in _records.divergences(_records.load(tmp_path))}
    assert found[WORLD].sequence == 3 and not found[WORLD].missing
    assert {r: c.call for r, c in found[WORLD].calls.items()} == {
        0: "allreduce(float32[4])", 1: "allgather(float32[4])", 2: "allreduce(float32[4])"}
    assert found[split].sequence == 2 and set(found[split].calls) == {0, 1}
    assert found[split].missing[2].sequence == 1
    text, diverged = _records.flight_report(_records.load(tmp_path))
    assert diverged
    assert "MPI_COMM_WORLD, local device 0 (ranks 0,1,2): the ranks diverge at sequence 3" in text
    assert "rank 1: allgather(float32[4]) at job.py:3" in text
    assert "rank 0, 2: allreduce(float32[4]) at job.py:3" in text
    assert "comm7, local device 0 (ranks 0,1,2): the ranks diverge at sequence 2" in text
    assert "rank 2: has not reached it; its last: sequence 1, allreduce(float32[4])" in text


def test_a_directory_without_dumps_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no rank<r>.json files"):
        _records.load(tmp_path)
    (tmp_path / "rank0.json").write_text("{}")
    with pytest.raises(ValueError, match="not an mpicoll record file"):
        _records.load(tmp_path)


def test_the_merge_puts_every_rank_on_rank_0s_clock_and_splits_wait_from_transfer(tmp_path):
    # Rank 1's clock reads 5 ms behind rank 0's; it arrives 2 ms after rank 0
    # (on rank 0's clock) and both finish 0.5 ms after it arrives.
    _write(tmp_path, 0, [_event(0, 1, "allreduce(float32[4])", 10_000_000, 12_500_000,
                                members="0,1")], size=2)
    _write(tmp_path, 1, [_event(1, 1, "allreduce(float32[4])", 7_000_000, 7_500_000,
                                members="0,1")], offset=5_000_000, size=2)
    files = _records.load(tmp_path)
    spans = {s.rank: s for s in _records.spans(files)}
    assert spans[0].wait_ns == 2_000_000 and spans[0].transfer_ns == 500_000
    assert spans[1].wait_ns == 0 and spans[1].transfer_ns == 500_000
    summary = _records.write_merged(str(tmp_path))
    assert "the straggler: rank 1" in summary, summary
    merged = json.loads((tmp_path / "merged.json").read_text())["traceEvents"]
    waits = [e for e in merged if e.get("cat") == "wait"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in waits] == [(0, 0.0, 2000.0)]
    transfers = sorted((e["pid"], e["ts"], e["dur"]) for e in merged if e.get("cat") == "transfer")
    assert transfers == [(0, 2000.0, 500.0), (1, 2000.0, 500.0)]
    assert (tmp_path / "timeline.svg").read_text().count("<rect") >= 4


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

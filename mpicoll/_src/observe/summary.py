"""The end-of-job communication summary (MPICOLL_SUMMARY=1): how much of the run
went to mpicoll's collectives, per rank and per kind, printed once by rank 0 as
the job ends, with no trace decided on beforehand.

What is counted (csrc/watch/totals.h): each local device's calls, their kind,
bytes and time from entry to return (a meeting of local devices as one call of
each device; the MPI call inside it is the same time).  A rank's time in
collectives is its busiest device's.  Waiting against transfer is estimated
from the totals alone: in a collective the rank that arrives last waits least,
so the least time any rank spent in a kind is taken as that kind's transfer,
and each rank's time beyond it as its waiting for peers (a lower bound of the
waiting a trace would show: `python -m mpicoll trace` splits every call).

How it is gathered: at exit, after this rank's end notice (a rank another
waits for is still named by the watchdog), one MPI_Igather of a fixed-size
record per rank on a duplicate of COMM_WORLD made at import, given a bounded
time: a rank that never reaches its end (it was lost, or it waits elsewhere)
leaves the summary out, said in one line, and the job's end is not held up.
"""

import json
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

from ..runtime.native import extension

RECORD_BYTES = 16384  # one rank's totals, JSON: a few hundred bytes per kind
GATHER_SECONDS = 30.0  # how long rank 0 waits for the others' records at its exit
_started = time.monotonic()
_comm = None


def install():
    """Count every call from now on and print the summary at exit (failures.configure
    registers summarize_at_exit to run after this rank's end notice)."""
    global _comm
    extension.set_communication_totals(True)
    _comm = MPI.COMM_WORLD.Dup()  # every rank reads the same setting: every rank is here
    return "communication summary at exit (MPICOLL_SUMMARY)"


def _mine():
    """This rank's totals: run seconds, and per kind the busiest device's
    (calls, seconds, bytes, longest call's seconds)."""
    kinds = {}
    for _slot, kind, calls, ns, nbytes, max_ns in extension.communication_totals():
        best = kinds.get(kind)
        if best is None or ns > best[1] * 1e9:
            kinds[kind] = (calls, ns * 1e-9, nbytes, max_ns * 1e-9)
    return {"host": socket.gethostname(), "run": time.monotonic() - _started, "kinds": kinds}


def _encoded(record):
    """record as JSON within RECORD_BYTES: where its kinds do not fit (dozens of
    distinct ones), those with the least time are left out, never cut mid-text."""
    kinds = sorted(record["kinds"].items(), key=lambda item: -item[1][1])
    while True:
        text = json.dumps(dict(record, kinds=dict(kinds))).encode()
        if len(text) <= RECORD_BYTES or not kinds:
            return text
        kinds = kinds[:len(kinds) // 2]


def summarize_at_exit():
    """Gather every rank's totals on rank 0 and print the summary there."""
    if _comm is None:
        return
    mine = _encoded(_mine())
    send = np.zeros(RECORD_BYTES, np.uint8)
    send[:len(mine)] = np.frombuffer(mine, np.uint8)
    rank, size = _comm.Get_rank(), _comm.Get_size()
    gathered = np.zeros(RECORD_BYTES * size, np.uint8) if rank == 0 else None
    request = _comm.Igather(send, gathered, root=0)
    deadline = time.monotonic() + GATHER_SECONDS
    while not request.Test():
        if time.monotonic() > deadline:
            if rank == 0:
                print(f"mpicoll: no communication summary: not every rank reached the end of "
                      f"its script within {GATHER_SECONDS:g} s of rank 0", file=sys.stderr,
                      flush=True)
            return
        time.sleep(0.001)
    if rank == 0:
        records = [json.loads(bytes(gathered[r * RECORD_BYTES:(r + 1) * RECORD_BYTES])
                             .rstrip(b"\0").decode()) for r in range(size)]
        print(report(records), file=sys.stderr, flush=True)


def _duration(seconds):
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else \
        f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _size(nbytes):
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def report(records):
    """The summary's text from every rank's record (rank order), as rank 0 prints it."""
    kinds = sorted({kind for record in records for kind in record["kinds"]})
    least = {kind: min(record["kinds"].get(kind, (0, 0.0))[1] for record in records)
             for kind in kinds}
    lines = [f"mpicoll: communication summary (MPICOLL_SUMMARY=1), {len(records)} "
             f"rank{'s' if len(records) > 1 else ''}:",
             f"  {'rank':>4}  {'host':<16} {'run':>9} {'in collectives':>20} "
             f"{'waiting for peers':>18} {'transfer':>10} {'calls':>8}"]
    for rank, record in enumerate(records):
        mine = record["kinds"]
        total = sum(seconds for _, seconds, _, _ in mine.values())
        waiting = sum(mine[kind][1] - least[kind] for kind in mine)
        share = 100 * total / record["run"] if record["run"] > 0 else 0
        lines.append(f"  {rank:>4}  {record['host'][:16]:<16} {_duration(record['run']):>9} "
                     f"{_duration(total) + f' ({share:.0f}%)':>20} {_duration(waiting):>18} "
                     f"{_duration(total - waiting):>10} "
                     f"{sum(calls for calls, _, _, _ in mine.values()):>8}")
    lines.append("  waiting for peers: a rank's time in a kind of collective beyond the least "
                 "any rank spent in it (the rank that arrives last waits least); transfer: "
                 "that least")
    by_time = sorted(kinds, key=lambda kind: -sum(r["kinds"].get(kind, (0, 0.0))[1]
                                                 for r in records))
    lines.append("  the kinds by time (summed over the ranks):")
    for kind in by_time[:8]:
        rows = [r["kinds"][kind] for r in records if kind in r["kinds"]]
        calls = max(row[0] for row in rows)
        seconds = sum(row[1] for row in rows)
        per_call = sum(row[2] for row in rows) / max(1, sum(row[0] for row in rows))
        mean = seconds / max(1, sum(row[0] for row in rows))
        longest = max(row[3] for row in rows)
        lines.append(f"    {kind:<16} {calls:>8} calls  {_size(per_call):>10}/call  "
                     f"mean {_duration(mean):>9}  longest {_duration(longest):>9}  "
                     f"{_duration(seconds):>9}")
    return "\n".join(lines)

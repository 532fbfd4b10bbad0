"""Reading the flight recorder's dumps and the timeline (csrc/core/flight.h).

Both are one file per rank, `rank<r>.json`: a Chrome trace whose collective
events carry every field of the record in "args" (sequence number on its
communicator, call, communicator name and members, call site, queued, started
and finished times on the rank's own clock).

* `python -m mpicoll flight DIR`: where the ranks diverge.  A collective is
  identified by its communicator (name and members; each local device has its
  own) and its sequence number on it; the first sequence number at which the
  ranks called different things, or at which some rank is missing, is where the
  job went wrong.
* `python -m mpicoll trace DIR`: the ranks merged onto rank 0's clock (the
  offsets were measured over MPI at start), each collective split into the
  wait for peers (from this rank's arrival to the last rank's) and the transfer
  (from the last arrival to this rank's finish): DIR/merged.json for
  chrome://tracing or ui.perfetto.dev, DIR/timeline.svg, and a summary naming
  the straggler.
"""

import dataclasses
import glob
import html
import json
import os
import re

_RANK_FILE = re.compile(r"rank(\d+)\.json$")


@dataclasses.dataclass(frozen=True)
class Record:
    """One collective on one local device of one rank (times: ns, the rank's clock)."""
    rank: int
    device: int
    sequence: int
    call: str        # e.g. allreduce(float32[4])
    op: str
    comm: str        # mpicoll's name of the device's communicator
    members: str     # its members' COMM_WORLD ranks, "0,1,2"
    comm_rank: int
    site: str
    bytes: int
    queued_ns: int
    started_ns: int
    finished_ns: int  # None while it ran (at the time of the dump)
    failed: bool

    @property
    def stream(self):
        """The communicator as the ranks share it: (name, members)."""
        return self.comm, self.members


@dataclasses.dataclass
class RankFile:
    rank: int
    size: int
    host: str
    reason: str
    written_ns: int
    clock_offset_ns: int
    kept: str  # "last" (flight recorder: the last N) or "all" (timeline)
    records: list
    path: str


def load(directory):
    """Every rank<r>.json in `directory`, by rank; ValueError saying what is wrong."""
    numbered = [(int(m.group(1)), p) for p in glob.glob(os.path.join(directory, "rank*.json"))
                if (m := _RANK_FILE.search(p))]
    paths = [p for _, p in sorted(numbered)]
    if not paths:
        raise ValueError(f"{directory}: no rank<r>.json files (mpicoll writes them there on a "
                         "stall, a timeout, an abort or SIGUSR1 (MPICOLL_FLIGHT_DIR), or at "
                         "exit with MPICOLL_TRACE)")
    files = []
    for path in paths:
        try:
            with open(path) as handle:
                data = json.load(handle)
            meta = data["otherData"]
            if meta.get("mpicoll") != 1:
                raise KeyError("mpicoll")
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(f"{path}: not an mpicoll record file ({error})") from None
        rank = meta["rank"]
        records = [_record(rank, event) for event in data["traceEvents"]
                   if event.get("cat") == "collective"]
        files.append(RankFile(rank=rank, size=meta["size"], host=meta["host"],
                              reason=meta["reason"], written_ns=meta["written_ns"],
                              clock_offset_ns=meta["clock_offset_ns"], kept=meta["kept"],
                              records=records, path=path))
    return files


def _record(rank, event):
    args = event["args"]
    return Record(rank=rank, device=event["tid"], sequence=args["sequence"], call=args["call"],
                  op=args["op"], comm=args["comm"], members=args["members"],
                  comm_rank=args["comm_rank"], site=args["site"], bytes=args["bytes"],
                  queued_ns=args["queued_ns"], started_ns=args["started_ns"],
                  finished_ns=args["finished_ns"], failed=args["failed"])


def _comm_title(comm, members):
    """mpicoll:MPI_COMM_WORLD:device0 -> MPI_COMM_WORLD, local device 0 (ranks 0,1,2)."""
    name, device = comm, None
    if name.startswith("mpicoll:"):
        name = name[len("mpicoll:"):]
    match = re.match(r"(.*):device(\d+)$", name)
    if match:
        name, device = match.group(1), int(match.group(2))
    where = f", local device {device}" if device is not None else ""
    return f"{name}{where} (ranks {members})"


# --- The flight recorder: where the ranks diverge -----------------------------------------

@dataclasses.dataclass
class Divergence:
    """The first sequence number on a communicator at which the ranks do not agree."""
    comm: str
    members: str
    sequence: int
    calls: dict      # rank -> Record at that sequence number
    missing: dict    # rank -> its last Record on that communicator before it (or None)
    no_file: list    # member ranks without a dump


def divergences(files):
    """[Divergence] for each communicator whose ranks disagree or where one is missing,
    earliest first (by sequence number of the divergence's first record's start)."""
    by_rank = {f.rank: f for f in files}
    streams = {}
    for f in files:
        for r in f.records:
            streams.setdefault(r.stream, {}).setdefault(f.rank, {})[r.sequence] = r
    found = []
    for (comm, members), ranks in streams.items():
        expected = [int(m) for m in members.split(",") if m.strip().lstrip("-").isdigit()]
        present = [r for r in expected if r in by_rank]
        no_file = [r for r in expected if r not in by_rank]
        # A member with a file but no record here: it never called on this
        # communicator in the window its ring holds.
        highs = {r: max(ranks[r]) if r in ranks else 0 for r in present}
        lows = {r: min(ranks[r]) for r in present if r in ranks}
        start = max(lows.values()) if lows else 1
        top = max(highs.values()) if highs else 0
        for sequence in range(start, top + 1):
            calls = {r: ranks[r][sequence] for r in present
                     if r in ranks and sequence in ranks[r]}
            missing = {r: _last_before(ranks.get(r, {}), sequence) for r in present
                       if highs[r] < sequence}
            signatures = {c.call for c in calls.values()}
            if missing or len(signatures) > 1:
                found.append(Divergence(comm, members, sequence, calls, missing, no_file))
                break
    return found


def _last_before(records, sequence):
    earlier = [s for s in records if s < sequence]
    return records[max(earlier)] if earlier else None


def _age(record, written_ns):
    if record.finished_ns is None:
        return f"not finished: in it for {(written_ns - record.started_ns) * 1e-9:.1f} s"
    return f"finished {(written_ns - record.finished_ns) * 1e-9:.1f} s before the dump"


def _where(record):
    return f" at {record.site}" if record.site else ""


def flight_report(files):
    """The text `python -m mpicoll flight DIR` prints; (text, whether the ranks diverge)."""
    by_rank = {f.rank: f for f in files}
    size = max(f.size for f in files)
    lines = [f"flight records of {len(files)} of {size} ranks "
             f"({os.path.dirname(files[0].path) or '.'}):"]
    for f in files:
        lines.append(f"  rank {f.rank} ({f.host}): {len(f.records)} records, written for: "
                     f"{f.reason}")
    absent = sorted(set(range(size)) - set(by_rank))
    if absent:
        lines.append(f"  no file from rank(s) {', '.join(map(str, absent))} (the process was "
                     "gone or could not be asked; see the stall report)")
    found = divergences(files)
    if not found:
        lines.append("the ranks agree: every communicator's sequence of collectives is the same "
                     "on every rank that has a dump, and none of them is missing one")
        return "\n".join(lines), False
    for d in found:
        lines.append("")
        lines.append(f"{_comm_title(d.comm, d.members)}: the ranks diverge at sequence "
                     f"{d.sequence}" + (f" (they agree up to {d.sequence - 1})"
                                        if d.sequence > 1 else ""))
        groups = {}
        for rank, record in sorted(d.calls.items()):
            groups.setdefault((record.call, record.site), []).append((rank, record))
        for (call, site), members in groups.items():
            ranks = ", ".join(str(r) for r, _ in members)
            first = members[0][1]
            lines.append(f"  rank {ranks}: {call}{_where(first)} "
                         f"({_age(first, by_rank[members[0][0]].written_ns)})")
        for rank, last in sorted(d.missing.items()):
            if last is None:
                lines.append(f"  rank {rank}: has not reached it (no earlier record on this "
                             "communicator)")
            else:
                lines.append(f"  rank {rank}: has not reached it; its last: sequence "
                             f"{last.sequence}, {last.call}{_where(last)} "
                             f"({_age(last, by_rank[rank].written_ns)})")
        for rank in d.no_file:
            lines.append(f"  rank {rank}: no dump")
    return "\n".join(lines), True


# --- The timeline: merged onto one clock, wait and transfer -------------------------------

@dataclasses.dataclass
class Span:
    rank: int
    device: int
    call: str
    sequence: int
    comm: str
    start_ns: int     # on rank 0's clock
    last_arrival_ns: int
    finished_ns: int

    @property
    def wait_ns(self):
        return max(0, self.last_arrival_ns - self.start_ns)

    @property
    def transfer_ns(self):
        return max(0, self.finished_ns - max(self.start_ns, self.last_arrival_ns))


def spans(files):
    """Every finished collective of every rank as a Span on rank 0's clock."""
    instances = {}
    for f in files:
        for r in f.records:
            if r.finished_ns is None:
                continue
            instances.setdefault((r.comm, r.members, r.sequence), []).append(
                (f.rank, r, f.clock_offset_ns))
    out = []
    for (comm, members, sequence), parts in instances.items():
        last = max(r.started_ns + offset for _, r, offset in parts)
        for rank, r, offset in parts:
            out.append(Span(rank=rank, device=r.device, call=r.call, sequence=sequence,
                            comm=comm, start_ns=r.started_ns + offset, last_arrival_ns=last,
                            finished_ns=r.finished_ns + offset))
    out.sort(key=lambda s: (s.start_ns, s.rank, s.device))
    return out


def merged_trace(files, all_spans):
    """A Chrome trace of every rank: per collective a "wait" and a "transfer" span."""
    origin = min((s.start_ns for s in all_spans), default=0)
    events = []
    for f in files:
        events.append({"ph": "M", "name": "process_name", "pid": f.rank,
                       "args": {"name": f"rank {f.rank} ({f.host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": f.rank,
                       "args": {"sort_index": f.rank}})
        for device in sorted({r.device for r in f.records}):
            events.append({"ph": "M", "name": "thread_name", "pid": f.rank, "tid": device,
                           "args": {"name": f"local device {device}"}})
    for s in all_spans:
        common = {"pid": s.rank, "tid": s.device,
                  "args": {"sequence": s.sequence, "comm": s.comm}}
        if s.wait_ns:
            events.append({"ph": "X", "cat": "wait", "name": f"wait: {s.call}",
                           "ts": (s.start_ns - origin) / 1e3, "dur": s.wait_ns / 1e3,
                           "cname": "terrible", **common})
        events.append({"ph": "X", "cat": "transfer", "name": s.call,
                       "ts": (max(s.start_ns, s.last_arrival_ns) - origin) / 1e3,
                       "dur": s.transfer_ns / 1e3, "cname": "good", **common})
    return {"displayTimeUnit": "ns", "traceEvents": events,
            "otherData": {"mpicoll": "merged", "ranks": [f.rank for f in files]}}


def totals(all_spans):
    """{rank: (collectives, wait ns, transfer ns, times it arrived last)}."""
    out = {}
    for s in all_spans:
        n, wait, transfer, last = out.get(s.rank, (0, 0, 0, 0))
        out[s.rank] = (n + 1, wait + s.wait_ns, transfer + s.transfer_ns,
                       last + (s.start_ns == s.last_arrival_ns))
    return out


def trace_summary(files, all_spans):
    """The text `python -m mpicoll trace DIR` prints, the straggler named."""
    per_rank = totals(all_spans)
    lines = [f"timeline of {len(files)} ranks, {len(all_spans)} collectives "
             "(wait: for the last rank to arrive; transfer: from then to this rank's finish)",
             f"  {'rank':>4}  {'host':<16} {'calls':>6} {'wait ms':>10} {'transfer ms':>12} "
             f"{'arrived last':>13}"]
    hosts = {f.rank: f.host for f in files}
    for rank in sorted(per_rank):
        n, wait, transfer, last = per_rank[rank]
        lines.append(f"  {rank:>4}  {hosts.get(rank, '?'):<16} {n:>6} {wait * 1e-6:>10.3f} "
                     f"{transfer * 1e-6:>12.3f} {last:>13}")
    if len(per_rank) > 1:
        waits = {rank: v[1] for rank, v in per_rank.items()}
        straggler = min(waits, key=waits.get)
        others = [w for r, w in waits.items() if r != straggler]
        if max(others) > 0:
            lines.append(f"the straggler: rank {straggler} (it waited least; the others waited "
                         f"{sum(others) * 1e-6 / len(others):.3f} ms each on average, mostly "
                         "for it)")
    return "\n".join(lines)


def picture(files, all_spans, width=1000):
    """An SVG: one row per rank and local device, each collective's wait (orange)
    and transfer (blue) on one time axis, and each rank's totals at the right."""
    rows = sorted({(s.rank, s.device) for s in all_spans})
    if not rows:
        rows = [(f.rank, 0) for f in files]
    origin = min((s.start_ns for s in all_spans), default=0)
    end = max((s.finished_ns for s in all_spans), default=origin + 1)
    scale = (width - 320) / max(1, end - origin)
    row_height, top = 22, 40
    height = top + row_height * len(rows) + 50
    per_rank = totals(all_spans)
    most = max([v[1] + v[2] for v in per_rank.values()] or [1]) or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="10" y="18" font-size="14">mpicoll timeline: {len(all_spans)} collectives, '
           f'{(end - origin) * 1e-6:.2f} ms; orange: waiting for peers, blue: transfer</text>']
    for index, (rank, device) in enumerate(rows):
        y = top + index * row_height
        out.append(f'<text x="10" y="{y + 15}">rank {rank} dev {device}</text>')
        out.append(f'<line x1="110" x2="{width - 200}" y1="{y + 10}" y2="{y + 10}" '
                   'stroke="#ddd"/>')
        for s in all_spans:
            if (s.rank, s.device) != (rank, device):
                continue
            x = 110 + (s.start_ns - origin) * scale
            if s.wait_ns:
                out.append(f'<rect x="{x:.2f}" y="{y + 3}" width="{max(0.5, s.wait_ns * scale):.2f}" '
                           f'height="14" fill="#f28e2b"><title>rank {rank}: wait {s.wait_ns / 1e3:.1f} us '
                           f'in {html.escape(s.call)} #{s.sequence}</title></rect>')
            xt = 110 + (max(s.start_ns, s.last_arrival_ns) - origin) * scale
            out.append(f'<rect x="{xt:.2f}" y="{y + 3}" width="{max(0.5, s.transfer_ns * scale):.2f}" '
                       f'height="14" fill="#4e79a7"><title>rank {rank}: {html.escape(s.call)} '
                       f'#{s.sequence} transfer {s.transfer_ns / 1e3:.1f} us</title></rect>')
        if device == min(d for r, d in rows if r == rank) and rank in per_rank:
            _, wait, transfer, _ = per_rank[rank]
            x0 = width - 190
            ww, wt = 120 * wait / most, 120 * transfer / most
            out.append(f'<rect x="{x0}" y="{y + 3}" width="{ww:.2f}" height="14" fill="#f28e2b"/>')
            out.append(f'<rect x="{x0 + ww:.2f}" y="{y + 3}" width="{wt:.2f}" height="14" '
                       'fill="#4e79a7"/>')
            out.append(f'<text x="{x0 + ww + wt + 4:.2f}" y="{y + 15}" font-size="10">'
                       f'{(wait + transfer) * 1e-6:.1f} ms</text>')
    y = top + len(rows) * row_height + 20
    out.append(f'<text x="110" y="{y}">0</text>')
    out.append(f'<text x="{width - 260}" y="{y}">{(end - origin) * 1e-6:.2f} ms</text>')
    out.append(f'<text x="{width - 190}" y="{top - 8}">total per rank</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_merged(directory):
    """Merge DIR's timeline files: writes DIR/merged.json and DIR/timeline.svg;
    returns the summary text."""
    files = load(directory)
    all_spans = spans(files)
    with open(os.path.join(directory, "merged.json"), "w") as handle:
        json.dump(merged_trace(files, all_spans), handle)
    with open(os.path.join(directory, "timeline.svg"), "w") as handle:
        handle.write(picture(files, all_spans))
    return (trace_summary(files, all_spans) + f"\nwritten: {directory}/merged.json "
            f"(chrome://tracing, ui.perfetto.dev), {directory}/timeline.svg")

"""The timeline: the ranks' records (observe/records.py reads them) merged onto
rank 0's clock, each collective split into the wait for its peers and the
transfer (`python -m mpicoll trace DIR`; the format is described in records.py).

The totals and the straggler leave out warm-up: a collective that is, on any
of its ranks, the first call of its call site with that signature on that
device.  Those first calls wait for every rank to compile the program (and
touch its buffers), which one rank may do much later than another on a
balanced run; they stay in the pictures.  A trace recorded with a skip
(MPICOLL_TRACE_SKIP, start_trace(skip=)) left warm-up out already, and none of
its calls is left out again.
"""

import dataclasses
import html
import json
import os

from .records import _meeting_devices, load, slot_name


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
    warm_up: bool = False  # the first call of its site on one of its ranks (not in the totals)

    @property
    def meeting(self):
        """A meeting of local devices (its wait: for the last device of any rank to
        arrive), not an MPI call."""
        return _meeting_devices(self.comm) is not None

    @property
    def wait_ns(self):
        return max(0, self.last_arrival_ns - self.start_ns)

    @property
    def transfer_ns(self):
        return max(0, self.finished_ns - max(self.start_ns, self.last_arrival_ns))


def _first_calls(f):
    """ids of the records of `f` that are the first call of their call site with that
    signature on their device (site and call: a new shape at a site compiles anew);
    none where the trace skipped warm-up when it recorded."""
    if f.trace_skip:
        return set()
    seen, first = set(), set()
    for r in sorted(f.records, key=lambda r: r.started_ns):
        key = (r.device, r.site, r.call)
        if key not in seen:
            seen.add(key)
            first.add(id(r))
    return first


def spans(files, warm_up=True):
    """Every finished collective of every rank as a Span on rank 0's clock; warm_up:
    mark each site's first calls (False: none)."""
    instances = {}
    for f in files:
        first = _first_calls(f) if warm_up else set()
        for r in f.records:
            if r.finished_ns is None:
                continue
            # A point-to-point call (sequence 0) is one rank's alone here.
            key = (r.comm, r.members, r.sequence) if r.sequence else (f.rank, id(r))
            instances.setdefault(key, []).append((f.rank, r, f.clock_offset_ns, id(r) in first))
    out = []
    for parts in instances.values():
        last = max(r.started_ns + offset for _, r, offset, _ in parts)
        warm = any(first for *_, first in parts)
        for rank, r, offset, _ in parts:
            out.append(Span(rank=rank, device=r.device, call=r.call, sequence=r.sequence,
                            comm=r.comm, start_ns=r.started_ns + offset, last_arrival_ns=last,
                            finished_ns=r.finished_ns + offset, warm_up=warm))
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
                           "args": {"name": slot_name(device)}})
    for s in all_spans:
        common = {"pid": s.rank, "tid": s.device,
                  "args": {"sequence": s.sequence, "comm": s.comm, "warm_up": s.warm_up}}
        if s.meeting:
            events.append({"ph": "X", "cat": "meeting", "name": f"meeting: {s.call}",
                           "ts": (s.start_ns - origin) / 1e3,
                           "dur": (s.finished_ns - s.start_ns) / 1e3, **common})
            continue
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
    """{rank: (collectives, wait ns, transfer ns, times it arrived last)}, warm-up left out."""
    out = {}
    for s in all_spans:
        if s.meeting or s.warm_up:  # a meeting: the leader's MPI call inside has its own span
            continue
        n, wait, transfer, last = out.get(s.rank, (0, 0, 0, 0))
        out[s.rank] = (n + 1, wait + s.wait_ns, transfer + s.transfer_ns,
                       last + (s.start_ns == s.last_arrival_ns))
    return out


def trace_summary(files, all_spans):
    """The text `python -m mpicoll trace DIR` prints, the straggler named."""
    per_rank = totals(all_spans)
    calls = sum(1 for s in all_spans if not s.meeting)
    warm = sum(1 for s in all_spans if s.warm_up and not s.meeting)
    lines = [f"timeline of {len(files)} ranks, {calls} collectives "
             "(wait: for the last rank to arrive; transfer: from then to this rank's finish)"]
    if warm:
        lines.append(f"  {warm} of them left out below: the first call of their call site on "
                     "some rank (warm-up: compilation; --all counts them)")
    lines.append(f"  {'rank':>4}  {'host':<16} {'calls':>6} {'wait ms':>10} {'transfer ms':>12} "
                 f"{'arrived last':>13}")
    hosts = {f.rank: f.host for f in files}
    for rank in sorted(per_rank):
        n, wait, transfer, last = per_rank[rank]
        lines.append(f"  {rank:>4}  {hosts.get(rank, '?'):<16} {n:>6} {wait * 1e-6:>10.3f} "
                     f"{transfer * 1e-6:>12.3f} {last:>13}")
    if len(per_rank) > 1:
        lines.append(_verdict(per_rank))
    return "\n".join(lines)


# A rank is the straggler when the others waited, on average, at least this many
# times as long as it did, for at least this share of their time in collectives,
# and it arrived last at least this many times as often as they did; short of
# that the ranks are balanced and the smallest wait is chance.
_STRAGGLER_RATIO = 2.0
_STRAGGLER_SHARE = 0.1
# ... and they waited at least this long per collective on average: below it, a
# rank that is systematically a few microseconds later (rank 0 arrived last in
# 18 of 20 balanced calls on jax 0.12, the others waiting 10 us per call) is
# scheduling, not a straggler worth naming.
_STRAGGLER_FLOOR_NS = 100_000


def _verdict(per_rank):
    """The straggler named, or that there is none."""
    waits = {rank: v[1] for rank, v in per_rank.items()}
    straggler = min(waits, key=waits.get)
    others = [rank for rank in waits if rank != straggler]
    mean = sum(waits[r] for r in others) / len(others)
    in_collectives = sum(per_rank[r][1] + per_rank[r][2] for r in others) / len(others)
    last_mean = sum(per_rank[r][3] for r in others) / len(others)
    calls = sum(per_rank[r][0] for r in others) / len(others)
    if mean > 0 and mean >= _STRAGGLER_RATIO * waits[straggler] \
            and mean >= _STRAGGLER_SHARE * in_collectives \
            and mean >= _STRAGGLER_FLOOR_NS * max(calls, 1) \
            and per_rank[straggler][3] >= _STRAGGLER_RATIO * last_mean:
        return (f"the straggler: rank {straggler} (it waited least, {waits[straggler] * 1e-6:.3f}"
                f" ms, and arrived last {per_rank[straggler][3]} times; the others waited "
                f"{mean * 1e-6:.3f} ms each on average, mostly for it)")
    return (f"no straggler: the ranks waited {min(waits.values()) * 1e-6:.3f}-"
            f"{max(waits.values()) * 1e-6:.3f} ms each "
            "(a straggler: the others wait at least "
            f"{_STRAGGLER_RATIO:g}x as long as it, for {_STRAGGLER_SHARE:.0%} of their time in "
            f"collectives, {_STRAGGLER_FLOOR_NS * 1e-3:g} us per call at least, and it "
            f"arrives last {_STRAGGLER_RATIO:g}x as often)")


def picture(files, all_spans, width=1000):
    """An SVG: one row per rank and local device, each collective's wait (orange)
    and transfer (blue) on one time axis, and each rank's totals at the right."""
    rows = sorted({(s.rank, s.device) for s in all_spans if not s.meeting})
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
           f'<text x="10" y="18" font-size="14">mpicoll timeline: '
           f'{sum(1 for s in all_spans if not s.meeting)} collectives, '
           f'{(end - origin) * 1e-6:.2f} ms; orange: waiting for peers, blue: transfer</text>']
    for index, (rank, device) in enumerate(rows):
        y = top + index * row_height
        out.append(f'<text x="10" y="{y + 15}">rank {rank} dev {device}</text>')
        out.append(f'<line x1="110" x2="{width - 200}" y1="{y + 10}" y2="{y + 10}" '
                   'stroke="#ddd"/>')
        for s in all_spans:
            if (s.rank, s.device) != (rank, device) or s.meeting:
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


def write_merged(directory, warm_up=True):
    """Merge DIR's timeline files: writes DIR/merged.json and DIR/timeline.svg;
    returns the summary text (warm_up=False: each site's first calls count too)."""
    from ..runtime import own_files

    files = load(directory)
    all_spans = spans(files, warm_up)
    summary = trace_summary(files, all_spans)
    # Written as mpicoll writes any file (runtime/own_files.py): into a folder of
    # this user's or root's, never through a link; one of another user's is still
    # read and summarized.
    try:
        own_files.write_file(directory, "merged.json",
                             json.dumps(merged_trace(files, all_spans)))
        own_files.write_file(directory, "timeline.svg", picture(files, all_spans))
    except own_files.Refused as error:
        return summary + f"\nnot written: merged.json and timeline.svg ({error})"
    return (summary + f"\nwritten: {directory}/merged.json "
            f"(chrome://tracing, ui.perfetto.dev), {directory}/timeline.svg")

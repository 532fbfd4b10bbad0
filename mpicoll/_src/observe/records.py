"""Reading the flight recorder's dumps and the timeline (csrc/watch/flight.h, written by
records_file.h).

Both are one file per rank, `rank<r>.json`: a Chrome trace whose collective
events carry every field of the record in "args" (sequence number on its
communicator, call, communicator name and members, call site, queued, started
and finished times on the rank's own clock).

* `python -m mpicoll flight DIR`: where the ranks diverge.  A collective is
  identified by its communicator (name and members; each local device has its
  own) and its sequence number on it.  On each communicator, each member's last
  record says how far it got: a member short of another's last sequence number
  skipped a collective (or the other added one), one without a file had ended or
  could not be asked, and the first sequence number at which the members called
  different things is where their programs parted.  The ranks agree only where
  every rank has a file and every communicator's members are at the same
  sequence number, having called the same collectives.
* `python -m mpicoll trace DIR` (observe/timeline.py reads the same files):
  the ranks merged onto rank 0's clock (the
  offsets were measured over MPI at start), each collective split into the
  wait for peers (from this rank's arrival to the last rank's) and the transfer
  (from the last arrival to this rank's finish): DIR/merged.json for
  chrome://tracing or ui.perfetto.dev, DIR/timeline.svg, and a summary naming
  the straggler.
"""

import dataclasses
import glob
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
    trace_skip: int  # each call site's first N calls were not traced (warm-up)
    records: list
    path: str


# A rank file is data from a folder another user may reach (a shared /tmp, a
# project folder): read without following links or blocking, up to this bound
# (a trace keeps about 700 bytes per collective per device, so 1 GiB is about 1.5
# million of them), and checked field by field before anything uses it.
MAX_FILE_BYTES = 1 << 30
MAX_RANKS = 1 << 24
MAX_LOCAL_DEVICES = 1 << 12
# The records' first thread of XLA's own collectives on mpicoll's MPI (csrc/engine/
# comm_table.h, kXlaSlot: one past the last local device; one per XLA communicator).
XLA_SLOT = 256
_MEMBERS = re.compile(r"(\d+(,\d+)*)?$")
# Characters a terminal would act on (escape sequences, bells, carriage returns):
# shown as \xNN, so a planted file cannot rewrite the reader's screen.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class Malformed(ValueError):
    """A rank file that is not what mpicoll writes; the message names the file and the field."""


def _shown(text, lines):
    pattern = _CONTROL if lines else _CONTROL_OR_NEWLINE
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _field(where, data, key, kind, lines=False, optional=False, low=None, high=None):
    """data[key] checked to be `kind`: int (not a bool; within [low, high]), "int or None",
    bool, or str (characters a terminal acts on shown escaped; `lines`: newlines kept)."""
    try:
        value = data[key]
    except KeyError:
        if optional:
            return None
        raise Malformed(f"{where}: no {key!r}") from None
    if kind == "int or None":
        if value is None:
            return None
        kind = int
    if type(value) is not kind:
        wanted = "a whole number" if kind is int else kind.__name__
        raise Malformed(f"{where}: {key!r} is {type(value).__name__} {value!r:.40}, not "
                        f"{wanted}")
    if kind is int and ((low is not None and value < low) or (high is not None and value > high)):
        raise Malformed(f"{where}: {key!r} is {value}, outside {low}..{high}")
    if kind is str and not value.isprintable():  # (the common case: nothing to escape)
        return _shown(value, lines)
    return value


def load(directory):
    """Every rank<r>.json in `directory`, by rank; ValueError (Malformed for a file that
    is not what mpicoll writes) saying what is wrong."""
    from ..runtime import own_files

    numbered = [(int(m.group(1)), p) for p in glob.glob(os.path.join(directory, "rank*.json"))
                if (m := _RANK_FILE.search(p))]
    paths = sorted(numbered)
    if not paths:
        raise ValueError(f"{directory}: no rank<r>.json files (mpicoll writes them there on a "
                         "stall, a timeout, an abort or SIGUSR1 (MPICOLL_FLIGHT_DIR), or at "
                         "exit with MPICOLL_TRACE)")
    if len(paths) > MAX_RANKS:
        raise ValueError(f"{directory}: {len(paths)} rank files, more than {MAX_RANKS} ranks")
    files = []
    for number, path in paths:
        try:
            raw = own_files.read_file(path, MAX_FILE_BYTES)
        except OSError as error:
            raise Malformed(f"{path}: not readable as a record file ({error})") from None
        try:
            data = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as error:
            raise Malformed(f"{path}: not an mpicoll record file (not JSON: {error})") from None
        files.append(_rank_file(path, number, data))
    return files


def _no_constant(name):
    raise ValueError(f"{name} is not a number mpicoll writes")


def _rank_file(path, number, data):
    if not isinstance(data, dict) or not isinstance(data.get("otherData"), dict):
        raise Malformed(f"{path}: not an mpicoll record file (no otherData)")
    meta = data["otherData"]
    if meta.get("mpicoll") != 1 or type(meta.get("mpicoll")) is not int:
        raise Malformed(f"{path}: not an mpicoll record file (otherData.mpicoll is not 1)")
    where = f"{path}: otherData"
    size = _field(where, meta, "size", int, low=1, high=MAX_RANKS)
    rank = _field(where, meta, "rank", int, low=0, high=size - 1)
    if rank != number:
        raise Malformed(f"{path}: holds the records of rank {rank}, not of rank {number}")
    kept = _field(where, meta, "kept", str)
    if kept not in ("last", "all"):
        raise Malformed(f"{where}: 'kept' is {kept!r}, not 'last' or 'all'")
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise Malformed(f"{path}: traceEvents is not a list")
    records = []
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise Malformed(f"{path}: traceEvents[{index}] is not an object")
        if event.get("cat") == "collective":
            records.append(_record(f"{path}: traceEvents[{index}]", rank, event))
    return RankFile(rank=rank, size=size, host=_field(where, meta, "host", str),
                    reason=_field(where, meta, "reason", str, lines=True),
                    written_ns=_field(where, meta, "written_ns", int),
                    clock_offset_ns=_field(where, meta, "clock_offset_ns", int),
                    kept=kept,
                    trace_skip=_field(where, meta, "trace_skip", int, optional=True, low=0) or 0,
                    records=records, path=path)


def _record(where, rank, event):
    device = _field(where, event, "tid", int, low=0, high=MAX_LOCAL_DEVICES - 1)
    args = event.get("args")
    if not isinstance(args, dict):
        raise Malformed(f"{where}: args is not an object")
    where += ".args"
    members = _field(where, args, "members", str)
    if not _MEMBERS.match(members):
        raise Malformed(f"{where}: 'members' is {members!r:.60}, not ranks like 0,1,2")
    return Record(rank=rank, device=device,
                  sequence=_field(where, args, "sequence", int, low=0),
                  call=_field(where, args, "call", str), op=_field(where, args, "op", str),
                  comm=_field(where, args, "comm", str), members=members,
                  comm_rank=_field(where, args, "comm_rank", int, low=-1),
                  site=_field(where, args, "site", str),
                  bytes=_field(where, args, "bytes", int, low=0),
                  queued_ns=_field(where, args, "queued_ns", int),
                  started_ns=_field(where, args, "started_ns", int),
                  finished_ns=_field(where, args, "finished_ns", "int or None"),
                  failed=_field(where, args, "failed", bool))


_MEETING = re.compile(r"(.*):meeting of devices ([\d,]+)$")


def _meeting_devices(comm):
    """'mpicoll:MPI_COMM_WORLD:meeting of devices 0,1' -> [0, 1]; None for a communicator."""
    match = _MEETING.match(comm)
    return [int(d) for d in match.group(2).split(",")] if match else None


def slot_name(device):
    """What a records file's thread is: "local device 1", or XLA's own collectives."""
    return "XLA's own collectives" if device >= XLA_SLOT else f"local device {device}"


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
class Stream:
    """One communicator (name and members) as the ranks' files show it: where each
    member got to on it, and whether the members agree."""
    comm: str
    members: str
    last: dict       # member with a file -> its last Record here (None: none here)
    no_file: list    # members without a file
    differ_at: int   # the first sequence number at which members called different things
    calls: dict      # rank -> its Record at differ_at ({} where they never differ)

    @property
    def top(self):
        """The highest sequence number a member reached here."""
        return max(r.sequence for r in self.last.values() if r is not None)

    @property
    def behind(self):
        """{rank: its last Record here, or None} of the members with a file short of top."""
        return {rank: r for rank, r in self.last.items() if r is None or r.sequence < self.top}

    @property
    def ahead(self):
        """The members at top, where they are no more than those behind: one collective
        more on them is likelier than one skipped by all the others.  [] otherwise."""
        at_top = [rank for rank, r in self.last.items()
                  if r is not None and r.sequence == self.top]
        return at_top if self.behind and len(at_top) <= len(self.behind) else []

    @property
    def diverged(self):
        return bool(self.no_file or self.behind or self.differ_at is not None)


def streams(files):
    """[Stream] of every communicator with a record in some file: those whose members
    diverge first, each kind in the order first seen."""
    by_rank = {f.rank: f for f in files}
    size = max(f.size for f in files)
    held = {}  # (comm, members) -> rank -> sequence -> Record
    for f in files:
        for r in f.records:
            # 0: point-to-point, two ranks' business; a meeting: the local devices' (below)
            if r.sequence and _meeting_devices(r.comm) is None:
                held.setdefault(r.stream, {}).setdefault(f.rank, {})[r.sequence] = r
    found = []
    for (comm, members), ranks in held.items():
        # The members as the writer translated them to COMM_WORLD ranks (a rank it could
        # not translate is left out; where none could be, those with records stand in).
        listed = {int(m) for m in members.split(",") if m.strip().isdigit() and int(m) < size}
        expected = sorted(listed | set(ranks))
        # A member's ring keeps the latest of its records, so its last one here is the
        # last it made here; one with a file but no record here has not called here (or
        # not within the records its ring kept).
        last = {m: ranks[m][max(ranks[m])] if m in ranks else None
                for m in expected if m in by_rank}
        differ_at, calls = None, {}
        for sequence in sorted({s for kept in ranks.values() for s in kept}):
            at = {m: kept[sequence] for m, kept in sorted(ranks.items()) if sequence in kept}
            if len({r.call for r in at.values()}) > 1:
                differ_at, calls = sequence, at
                break
        found.append(Stream(comm, members, last, [m for m in expected if m not in by_rank],
                            differ_at, calls))
    return [s for s in found if s.diverged] + [s for s in found if not s.diverged]


@dataclasses.dataclass
class Unmet:
    """A meeting of one rank's local devices that some of them have not reached: those in
    it wait for the others, which are still short of it."""
    rank: int
    comm: str        # the communicator's name, e.g. mpicoll:MPI_COMM_WORLD
    waiting: list    # Records of the devices in the meeting (not finished)
    absent: dict     # device -> its last Record on this meeting (None: none kept)


def unmet_meetings(files):
    """[Unmet] of every rank whose local devices did not meet: one device is inside meeting
    N (csrc/meeting/meeting.cc records each device's meetings) while another of the same
    meeting is short of N.  The ranks' programs cannot do that (each device runs the same
    program): a device that does not arrive is still computing, stopped outside mpicoll,
    or mpicoll deadlocked."""
    found = []
    for f in files:
        mine = {}  # comm -> device -> its last Record
        for r in f.records:
            if _meeting_devices(r.comm) is not None:
                last = mine.setdefault(r.comm, {}).get(r.device)
                if last is None or r.sequence > last.sequence:
                    mine[r.comm][r.device] = r
        for comm, last in mine.items():
            top = max(r.sequence for r in last.values())
            waiting = [r for r in last.values() if r.sequence == top and r.finished_ns is None]
            absent = {d: last.get(d) for d in _meeting_devices(comm)
                      if d not in last or last[d].sequence < top}
            if waiting and absent:
                found.append(Unmet(f.rank, _MEETING.match(comm).group(1),
                                   sorted(waiting, key=lambda r: r.device), absent))
    return found


def _unmet_lines(unmet, written):
    name = unmet.comm[len("mpicoll:"):] if unmet.comm.startswith("mpicoll:") else unmet.comm
    devices = sorted([r.device for r in unmet.waiting] + list(unmet.absent))
    lines = [f"{name}, rank {unmet.rank}: its local devices {', '.join(map(str, devices))} "
             "did not meet"]
    for r in unmet.waiting:
        lines.append(f"  local device {r.device} waits in meeting {r.sequence}, {r.call}"
                     f"{_where(r)} ({_age([r], written)})")
    for device, r in sorted(unmet.absent.items()):
        last = ("none in its records" if r is None else
                f"its last: meeting {r.sequence}, {r.call}{_where(r)} ({_age([r], written)})")
        lines.append(f"  local device {device} has not arrived ({last})")
    lines.append("  the program did not skip a collective here (every device runs the same "
                 "program): a device that has not arrived is still computing toward it, is "
                 "stopped outside mpicoll (a host callback, another library, XLA), or mpicoll "
                 "deadlocked (please report it)")
    return lines


def divergences(files):
    """[Stream] of each communicator whose members diverge: one called something else at
    some sequence number, one is short of another's last, or one wrote no file."""
    return [s for s in streams(files) if s.diverged]


def _runs(ranks):
    """[0, 2, 3, 4] -> [[0], [2, 3, 4]]: the consecutive runs."""
    runs = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return runs


def _ranks(ranks):
    """[1] -> 'rank 1'; [0, 2, 3, 4] -> 'ranks 0, 2-4'."""
    parts = []
    for run in _runs(ranks):
        parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(r) for r in run]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _age(records, written):
    """How long before the dump the records (all finished, or all not) finished or started:
    'finished 0.1 s before the dump', 'not finished: in it for 3.9 to 4.0 s'."""
    finished = records[0].finished_ns is not None
    seconds = sorted({round((written[r.rank] - (r.finished_ns if finished else r.started_ns))
                            * 1e-9, 1) for r in records})
    span = f"{seconds[0]:.1f}" + (f" to {seconds[-1]:.1f}" if len(seconds) > 1 else "")
    return (f"finished {span} s before the dump" if finished
            else f"not finished: in it for {span} s")


def _where(record):
    return f" at {record.site}" if record.site else ""


def _grouped(records, key):
    """{key(record): [records]} in the order of their lowest rank."""
    groups = {}
    for record in sorted(records, key=lambda r: r.rank):
        groups.setdefault(key(record), []).append(record)
    return groups


def _no_file_reason(files, count):
    """Why `count` ranks have no file, as far as the others' files say."""
    its = "its process" if count == 1 else "their processes"
    if all(f.reason == "SIGUSR1" for f in files):
        return (f"{its} had ended, or {'was' if count == 1 else 'were'} not sent SIGUSR1 "
                "(the files here were written for SIGUSR1; only a rank it is sent to writes "
                "one)")
    return f"{its} had ended or could not be asked"


def _stream_lines(stream, by_rank, unmet_ranks=()):
    """The lines of one communicator: what diverges (each rank behind or ahead named), then
    each member's last collective there.  A rank in `unmet_ranks` is behind because its
    local devices did not meet (said where it is named)."""
    unmet_note = "; its local devices did not meet: below"
    written = {rank: f.written_ns for rank, f in by_rank.items()}
    title = _comm_title(stream.comm, stream.members)
    top = stream.top
    if not stream.diverged:
        lines = [f"{title}: the ranks agree, each at sequence {top}"]
    else:
        lines = [f"{title}: the ranks diverge"]
    if stream.differ_at is not None:
        lines.append(f"  at sequence {stream.differ_at} they called different collectives"
                     + (f" (they agree up to {stream.differ_at - 1})"
                        if stream.differ_at > 1 else "") + ":")
        for group in _grouped(stream.calls.values(), lambda r: (r.call, r.site)).values():
            lines.append(f"    {_ranks([r.rank for r in group])}: {group[0].call}"
                         f"{_where(group[0])} ({_age(group, written)})")
    ahead = stream.ahead
    if len(ahead) == 1:
        lines.append(f"  rank {ahead[0]} is at sequence {top} that no other rank reached")
    elif ahead:
        lines.append(f"  {_ranks(ahead)} are at sequence {top} that the other ranks did not "
                     "reach")
    behind = stream.behind
    for rank in sorted(r for r, record in behind.items() if record is None):
        f = by_rank[rank]
        kept = (f"none of the {len(f.records)} records it kept is on this communicator"
                if f.kept == "last" else "it has no record on this communicator")
        lines.append(f"  rank {rank} has not reached sequence {top} ({kept}"
                     f"{unmet_note if rank in unmet_ranks else ''})")
    reached = [record for record in behind.values() if record is not None]
    for group in _grouped(reached, lambda r: (r.sequence, r.call, r.site)).values():
        ranks = [r.rank for r in group]
        lines.append(f"  {_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} not reached "
                     f"sequence {top} ({'its' if len(ranks) == 1 else 'their'} last: sequence "
                     f"{group[0].sequence}, {group[0].call}{_where(group[0])}"
                     f"{unmet_note if set(ranks) <= set(unmet_ranks) else ''})")
    if stream.no_file:
        lines.append(f"  {_ranks(stream.no_file)}: no flight records "
                     f"({_no_file_reason(by_rank.values(), len(stream.no_file))})")
    indent = "  "
    if stream.diverged:
        lines.append("  each rank's last collective here:")
        indent = "    "
    present = [r for r in stream.last.values() if r is not None]
    for group in _grouped(present, lambda r: (r.sequence, r.call, r.site,
                                               r.finished_ns is None)).values():
        lines.append(f"{indent}{_ranks([r.rank for r in group])}: sequence "
                     f"{group[0].sequence}, {group[0].call}{_where(group[0])} "
                     f"({_age(group, written)})")
    return lines


def flight_report(files):
    """The text `python -m mpicoll flight DIR` prints; (text, whether the ranks fall short
    of agreeing).  They agree only where every rank wrote a file and, on every
    communicator, every member is at the same sequence number, having called the same
    collectives; otherwise the text names the ranks behind, ahead or without a file."""
    by_rank = {f.rank: f for f in files}
    size = max(f.size for f in files)
    absent = sorted(set(range(size)) - set(by_rank))

    heads = []  # (rank, its lines): each file, and each run of ranks without one
    for f in files:
        head = f"  rank {f.rank} ({f.host}): {len(f.records)} records, written for:"
        reason = f.reason.strip("\n")
        if "\n" in reason:  # a report of its own (the watchdog's): under the line, indented
            heads.append((f.rank, [head] + [f"      {line}".rstrip()
                                            for line in reason.splitlines()]))
        else:
            heads.append((f.rank, [f"{head} {reason}"]))
    for run in _runs(absent):
        heads.append((run[0], [f"  {_ranks(run)}: no flight records "
                               f"({_no_file_reason(files, len(run))})"]))
    lines = [f"flight records of {len(files)} of {size} ranks "
             f"({os.path.dirname(files[0].path) or '.'}):"]
    for _, head in sorted(heads, key=lambda entry: entry[0]):
        lines += head
    found = streams(files)
    unmet = unmet_meetings(files)
    unmet_ranks = sorted({u.rank for u in unmet})
    for stream in found:
        lines.append("")
        lines += _stream_lines(stream, by_rank, unmet_ranks)
    written = {rank: f.written_ns for rank, f in by_rank.items()}
    for u in unmet:
        lines.append("")
        lines += _unmet_lines(u, written)
    lines.append("")
    diverging = [s for s in found if s.diverged]
    if unmet:
        lines.append(f"the ranks did not skip a collective: the local devices of "
                     f"{_ranks(unmet_ranks)} did not meet (above)")
    elif diverging:
        lines.append(f"the ranks diverge on {len(diverging)} of {len(found)} "
                     f"communicator{'s' if len(found) > 1 else ''} (above)")
    elif absent:
        lines.append(f"the ranks are not known to agree: {_ranks(absent)} wrote no flight "
                     "records, and the others' records do not say where "
                     f"{'it' if len(absent) == 1 else 'they'} stopped")
    elif not found:
        lines.append("the ranks agree: no rank has a collective in its records")
    else:
        lines.append("the ranks agree: every rank wrote its records, and on every "
                     "communicator every member is at the same sequence number, having called "
                     "the same collectives")
    return "\n".join(lines), bool(unmet or diverging or absent)

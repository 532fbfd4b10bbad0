// The local meeting: a collective over every device of several processes
// whose L local device threads meet in this process, so that the process's
// MPI work runs once, inside the meeting: on CPU every collective over ranks x
// local devices (mpicoll's axis_name= collectives, jax.lax over mpicoll.RANKS
// and a local axis, a global mesh's axes that span processes).  This file is
// the meeting itself (the protocol below); meeting.h its shared state,
// kinds.h what each kind packs, calls and takes, kinds.def the kinds.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "../engine/call.h"
#include "../engine/execute.h"
#include "../watch/guard.h"
#include "../entries/entries.h"
#include "kinds.def"
#include "kinds.h"
#include "meeting.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
namespace meeting {
namespace {

// The participants are the P ranks of the communicator times L local devices
// of each (all of a process's devices, or one group of them: the "groups"
// attribute names each device's group, and each group meets apart), numbered
// rank-major: row j = rank * L + device (Python reorders rows to the mesh axes'
// order around the call).  A "row" is one
// participant's block: a device's whole input for allreduce, allgather,
// permute and bcast; 1/(P*L) of it for reduce_scatter and alltoall, whose input
// holds one row per participant.  What each kind packs into the leader's send
// buffer, which MPI collective the leader runs, and what each device takes out:
//
//   kind            pack (every device at once)       MPI (leader)         device k takes
//   allreduce       1/L of the reduction of the L      MPI_Allreduce        the whole result
//                   inputs (slices in parallel)        in place
//   allgather       its row at place r * L + k of the  MPI_Allgather in     every row: the
//                   leader's OUTPUT                    place, into it, in   leader has them;
//                                                      pieces (below)       the others copy
//                                                                           each piece as it
//                                                                           lands (the leader
//                                                                           waits for that)
//   reduce_scatter  1/L of the reduction (as above)    reduce-scatter of    row k
//                                                      blocks of L rows
//   alltoall        its row for (r, k') at             MPI_Alltoallv of     (r, k)'s row for
//                   ((r' * L + k) * L + k'), r' the    blocks of L*L rows   k, every r and k
//                   place of r among the OTHER ranks;  to and from every
//                   its rows for this rank go straight other rank
//                   into device k''s output
//   permute         its row, once per pair that        MPI_Alltoallv        the row of the
//                   sends from it to another rank (by  (counts from the     pair that sends
//                   destination rank, then source      pairs)               to it, else zeros
//                   row); to a device of this rank,
//                   straight into that device's output
//   bcast           the root's row (root rank, root    MPI_Bcast            the row
//                   device)
//   reduce          1/L of the reduction (as above)    MPI_Reduce to the    the root: the sum;
//                                                      root's rank          others zeros
//
// alltoall's and permute's rows of 64 KiB or more skip the send and receive
// buffers: the leader's one MPI_Alltoallw reads them in the devices' inputs
// and writes them in their outputs (RowsInPlace, memory/rows_in_place.h).
//
// Bytes each rank sends are then those of the direct collective over P*L
// participants, whatever L: no device's data crosses the network twice, and
// none is padded with zeros.
//
// The meeting: each thread posts its input and output and waits; the last
// arrival sorts them by device (the leader, lowest ordinal, first: the same
// local device on every rank, so every leader talks on the same
// communicator).  Every thread packs its part, the leader runs the MPI
// collective (Execute: check mode, timeout, serialized lock, records, as for
// any call) and publishes; every thread copies its part out.  A generation
// counter separates successive calls: a thread that returns and comes back for
// the next call cannot mix with one still copying out, because the next call
// cannot finish (nor, since only the last arrival resizes the buffers, touch
// them) before that thread arrives too.  Inputs are read, and other devices'
// outputs written (alltoall's and permute's rows within the rank, allgather's
// rows into the leader's output), only while packing or by the leader's MPI
// call (large rows, below), when every thread is still inside the call; the
// one buffer read later, the leader's allgather output, is read while the
// leader waits for it.  So no XLA buffer is touched after its thread has
// returned.  Waiting threads are watched by the timeout like an MPI wait; a
// short spin before sleeping keeps the wake-up off the futex path at small
// sizes.

// A kind's row of kinds.def (nullptr for a code no row has).
struct KindFacts {
  const char* name;
  bool rows_in, reduces;
};
const KindFacts* FactsOf(int64_t kind) {
  static const KindFacts facts[] = {
#define MPICOLL_MEETING_FACTS(Enum, Type, name, code, rows_in, reduces) {name, rows_in, reduces},
      MPICOLL_MEETING_KINDS(MPICOLL_MEETING_FACTS)
#undef MPICOLL_MEETING_FACTS
  };
  constexpr int64_t count = sizeof(facts) / sizeof(facts[0]);
  return kind >= 0 && kind < count ? &facts[kind] : nullptr;
}

// One per communicator slot and group of local devices (most slots have one:
// every local device; a mesh axis that takes some of a process's devices has
// several, each meeting apart and led by its own lowest device, which talks on
// its own device's communicator).  Made on first use, never freed: a waiting
// thread may hold one while another looks up the next.
LocalMeeting& MeetingFor(int64_t comm_slot, int64_t group) {
  static std::mutex made_mutex;
  static auto* const made = new std::unordered_map<int64_t, std::unique_ptr<LocalMeeting>>();
  std::lock_guard<std::mutex> lock(made_mutex);
  std::unique_ptr<LocalMeeting>& meeting =
      (*made)[(comm_slot % kMaxComms) * kMaxLocalDevices + group];
  if (!meeting) meeting = std::make_unique<LocalMeeting>();
  return *meeting;
}

// allgather, on a device other than the leader: copies every piece of the
// leader's output as it lands, until the leader publishes the call's end
// (called and returning with the lock held); *copied: the bytes of every rank
// block copied so far.  Whether it ended by `deadline`.
bool CopyGathered(LocalMeeting& m, const Meeting& g, std::unique_lock<std::mutex>& lock,
                  uint64_t generation, char* output, size_t elem_bytes, size_t* copied,
                  int64_t deadline) {
  const size_t block = static_cast<size_t>(g.local) * g.row_bytes;  // bytes per rank
  for (;;) {
    if (!AwaitLocal(m, lock, [&] {
          return m.gathered.load() * elem_bytes > *copied || m.generation.load() != generation;
        }, deadline)) {
      return false;
    }
    // The end first: once it is published, so is every piece before it.
    const bool ended = m.generation.load() != generation;
    const size_t upto = m.gathered.load() * elem_bytes;
    if (upto > *copied) {
      lock.unlock();
      for (int r = 0; r < g.ranks; ++r) {
        const size_t at = r * block + *copied;
        std::memcpy(output + at, g.gathered + at, upto - *copied);
      }
      lock.lock();
      *copied = upto;
    }
    if (ended) return true;
  }
}

// The meeting's own flight record on each device, from its arrival to its
// return: sequence N on "<communicator>:meeting of devices 0,1" is the N-th
// meeting of those devices there.  Every device of every rank counts the same
// meetings, so `python -m mpicoll flight` tells a device that has not arrived
// at its rank's meeting (the devices did not meet: never the program's doing)
// from a rank that skipped a collective (observe/records.py).  The leader's
// MPI call inside the meeting keeps its own record on its communicator.
struct MeetingRecord {
  FlightRecord* record = nullptr;
  bool failed = false;
  // The device's whole part in the meeting counts in the end-of-job summary
  // (totals.h); its waits and the leader's MPI call inside it are inner calls.
  int32_t device;
  Counted counted;
  const char* kind;
  int64_t bytes, begun_ns;
  MeetingRecord(LocalMeeting& m, const Call& c, int32_t device, const std::string& devices)
      : device(device), counted(BeginCounted(device)), kind(c.name),
        bytes(static_cast<int64_t>(c.in_count * c.elem_bytes)), begun_ns(NowNs()) {
    const uint64_t sequence = ++m.met[device];
    if (!Recording()) return;
    const CommIdentity* identity = m.identity.load(std::memory_order_acquire);
    if (identity == nullptr) {
      std::lock_guard<std::mutex> lock(m.mutex);
      identity = m.identity.load(std::memory_order_relaxed);
      if (identity == nullptr) {
        const CommIdentity* comm = CounterOf(device, c.comm_key, c.comm).identity;
        std::string name = comm->name;
        const size_t suffix = name.rfind(":device");
        if (suffix != std::string::npos) name.resize(suffix);
        identity = new CommIdentity{name + ":meeting of devices " + devices, comm->members};
        m.identity.store(identity, std::memory_order_release);  // kept for the process
      }
    }
    record = BeginRecord(device, c, identity, sequence, 0, NowNs());
  }
  ~MeetingRecord() {
    const int64_t now = NowNs();
    FinishRecord(record, now, failed);
    EndCounted(device, counted, kind, now - begun_ns, bytes);
  }
};

// How this process's turns went (meeting_turns(), for tests and benchmarks):
// ended on XLA's thread, handed to the progress thread past the bound, queued
// whole.
struct TurnCounts {
  std::atomic<int64_t> here{0}, handed_off{0}, queued{0};
};
TurnCounts turns;

// Where one device's turn in a meeting stands (Advance).
enum class Step { kArrive, kAwaitArrivals, kPack, kAwaitPacked, kLead, kAwaitEnd, kCopyGathered,
                  kTakeOut, kAwaitCopies, kDone };

// One device's turn in one call: what it keeps of XLA's call frame (which does
// not outlive the handler), and how far the turn has come.
struct MeetingCall {
  Call c{};
  Meeting g{};
  std::vector<int64_t> dims, pairs;
  LocalMeeting* meeting = nullptr;
  std::string devices;  // "0,1": the devices that meet, until the meeting has its identity
  int32_t device = 0;
  int64_t op = 0;
  size_t in_bytes = 0, out_bytes = 0;
  Step step = Step::kArrive;
  uint64_t generation = 0;     // the meeting's calls completed when this one began
  size_t gathered_copied = 0;  // allgather, not the leader: bytes copied (CopyGathered)
  int others = 0;
  LeadGate gate;
  std::optional<MeetingRecord> recorded;
  ffi::Error result = ffi::Error::Success();
};

// Runs one device's turn until it is done (true, the outcome in call.result) or
// until a wait would pass `deadline` (false: where it stands is kept in `call`,
// and a later Advance goes on from there).  With kNoDeadline it runs to the end.
//
// So a turn starts on XLA's thread and, past the bound, ends on the device's
// progress thread (CpuLocalMeetingEntry): each step waits only for this
// process's other devices (bounded by `deadline`) or, in the leader's MPI call,
// for the other ranks' leaders, which on XLA's thread happens only once they
// have all arrived (LeadGate).  Every step is the same whichever thread runs it.
bool Advance(MeetingCall& call, int64_t deadline) {
  Call& c = call.c;
  Meeting& g = call.g;
  const int64_t kind = g.kind, local = g.local;
  const int32_t device = call.device;
  const ffi::Span<const int64_t> dims(call.dims);
  LocalMeeting& m = *call.meeting;
  if (!call.recorded) call.recorded.emplace(m, c, device, call.devices);
  const Turn turn{m, c, g, device, dims, &call.gate};
  Call waiting = c;  // reports.h: WaitInsideCall says what it waits for
  std::unique_lock<std::mutex> lock(m.mutex);
  for (;;) {
    switch (call.step) {
      case Step::kArrive: {
        call.generation = m.generation.load();
        const int index = m.arrived.load();
        if (index == 0) {
          m.expected = static_cast<int>(local);
          m.bytes = call.in_bytes;
          m.kind = kind;
          m.dtype = c.dtype;
          m.op = call.op;
          m.mismatch.clear();
        } else if (m.expected != local || m.bytes != call.in_bytes || m.kind != kind ||
                   m.dtype != c.dtype || m.op != call.op) {
          m.mismatch = std::string("mpicoll.") + c.name +
                       ": the local devices called different collectives on one communicator "
                       "at once (local device " + std::to_string(device) + ")";
        }
        m.inputs[index] = c.in;
        m.outputs[index] = c.out;
        m.devices[index] = device;
        if (index + 1 == m.expected) {
          // Every thread of the previous call has arrived here, so none still
          // reads its error or buffers.  The arrivals go in device order, the
          // leader first.
          m.error.clear();
          m.gathered.store(0);
          if (m.mismatch.empty()) {
            WithKind(kind, [&](auto k) { decltype(k)::Size(m, g, call.in_bytes); });
          }
          std::tuple<int32_t, const char*, char*> arrivals[kMaxLocalDevices];
          for (int i = 0; i < m.expected; ++i) {
            arrivals[i] = {m.devices[i], m.inputs[i], m.outputs[i]};
          }
          std::sort(arrivals, arrivals + m.expected);
          for (int i = 0; i < m.expected; ++i) {
            std::tie(m.devices[i], m.inputs[i], m.outputs[i]) = arrivals[i];
          }
        }
        m.arrived.store(index + 1);
        m.changed.notify_all();
        call.step = Step::kAwaitArrivals;
        break;
      }
      case Step::kAwaitArrivals: {
        InFlightScope watched(waiting, device, /*new_call=*/false);
        if (!AwaitLocal(m, lock, [&] {
              return m.arrived.load() == m.expected || m.generation.load() != call.generation;
            }, deadline)) {
          return false;
        }
        g.part = static_cast<int>(std::find(m.devices, m.devices + m.expected, device) -
                                  m.devices);
        // (The leader publishes only after every device has packed, so the call
        // cannot be over yet; kept as the one safe way out if it were.)
        call.step = m.generation.load() == call.generation ? Step::kPack : Step::kTakeOut;
        break;
      }
      case Step::kPack: {
        g.gathered = m.outputs[0];  // read now: the next call's arrivals rewrite m.outputs
        std::string failed = m.mismatch;
        if (failed.empty()) {
          lock.unlock();
          ffi::Error err = WithKind(kind, [&](auto k) { return decltype(k)::Pack(turn); });
          lock.lock();
          if (err.failure()) failed = std::string(err.message());
        }
        if (!failed.empty() && m.error.empty()) m.error = failed;
        m.packed.store(m.packed.load() + 1);
        m.changed.notify_all();
        call.step = g.part == 0                ? Step::kAwaitPacked
                    : kind == kMeetAllgather ? Step::kCopyGathered
                                             : Step::kAwaitEnd;
        break;
      }
      case Step::kAwaitPacked: {  // the leader
        InFlightScope watched(waiting, device, /*new_call=*/false);
        if (!AwaitLocal(m, lock, [&] { return m.packed.load() == m.expected; }, deadline)) {
          return false;
        }
        call.step = Step::kLead;
        break;
      }
      case Step::kLead: {
        if (m.error.empty()) {
          lock.unlock();
          ffi::Error err = WithKind(kind, [&](auto k) { return decltype(k)::Lead(turn); });
          lock.lock();
          if (call.gate.handed_off) {  // nothing ran but the barrier's start: the progress
            call.gate.handed_off = false;  // thread leads
            call.gate.here = false;
            return false;
          }
          if (err.failure()) m.error = std::string(err.message());
        }
        m.packed.store(0);
        m.arrived.store(0);
        m.generation.store(call.generation + 1);
        m.changed.notify_all();
        call.step = Step::kTakeOut;
        break;
      }
      case Step::kAwaitEnd: {
        InFlightScope watched(waiting, device, /*new_call=*/false);
        if (!AwaitLocal(m, lock, [&] { return m.generation.load() != call.generation; },
                        deadline)) {
          return false;
        }
        call.step = Step::kTakeOut;
        break;
      }
      case Step::kCopyGathered: {
        InFlightScope watched(waiting, device, /*new_call=*/false);
        if (!CopyGathered(m, g, lock, call.generation, c.out, c.elem_bytes,
                          &call.gathered_copied, deadline)) {
          return false;
        }
        call.step = Step::kTakeOut;
        break;
      }
      case Step::kTakeOut: {
        // Until this thread arrives at the next call, nobody writes the buffers
        // or m.error.
        const std::string error = m.error;
        call.others = m.expected - 1;
        call.step = Step::kDone;
        if (!error.empty()) {
          call.recorded->failed = true;
          call.result = ffi::Error::Internal(error);
          break;
        }
        lock.unlock();
        WithKind(kind, [&](auto k) { decltype(k)::Unpack(turn, call.out_bytes); });
        lock.lock();
        if (kind == kMeetAllgather && call.others > 0) {
          // The others copy from the leader's output: it stays XLA's until they have.
          if (g.part != 0) {
            m.copied.store(m.copied.load() + 1);
            m.changed.notify_all();
          } else {
            call.step = Step::kAwaitCopies;
          }
        }
        break;
      }
      case Step::kAwaitCopies: {  // the leader of an allgather
        InFlightScope watched(waiting, device, /*new_call=*/false);
        if (!AwaitLocal(m, lock, [&] { return m.copied.load() == call.others; }, deadline)) {
          return false;
        }
        m.copied.store(0);  // before the leader's next call, so before anyone's next copy
        call.step = Step::kDone;
        break;
      }
      case Step::kDone:
        lock.unlock();
        call.recorded.reset();  // the flight record and the summary's count end here
        return true;
    }
  }
}


ffi::Future CpuLocalMeetingEntry(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                                ffi::Result<ffi::AnyBuffer> out, int32_t device,
                                int64_t comm_slot, int64_t op, int64_t root, int64_t site,
                                int64_t local, int64_t kind, int64_t split,
                                ffi::Span<const int64_t> pairs, ffi::Span<const int64_t> groups) {
  auto call = std::make_shared<MeetingCall>();
  Call& c = call->c;
  const KindFacts* facts = FactsOf(kind);
  if (facts == nullptr) {
    return CompletedFuture(ffi::Error::InvalidArgument("mpicoll: unknown local meeting kind"));
  }
  const bool reduces = facts->reduces;
  if (ffi::Error err = reduces ? PrepareArray<AllreduceOp>(c, x, out, device, comm_slot, 0, op,
                                                           site, ffi::Span<const int64_t>())
                               : PrepareArray<AllgatherOp>(c, x, out, device, comm_slot, 0, op,
                                                           site, ffi::Span<const int64_t>());
      err.failure()) {
    return CompletedFuture(err);
  }
  // groups: each local device's group (those that meet), empty where all do.
  const int64_t group = groups.size() == 0                             ? 0
                        : device < static_cast<int64_t>(groups.size()) ? groups[device]
                                                                       : -1;
  if (local < 1 || local > kMaxLocalDevices || group < 0 || group >= kMaxLocalDevices) {
    return CompletedFuture(ffi::Error::InvalidArgument("mpicoll: local meeting out of range"));
  }
  c.name = facts->name;
  const size_t in_bytes = c.in_count * c.elem_bytes, out_bytes = c.out_count * c.elem_bytes;
  const int participants = c.size * static_cast<int>(local);
  const bool rows_in = facts->rows_in;
  if (in_bytes == 0 && out_bytes == 0) return CompletedFuture(ffi::Error::Success());
  // XLA's call frame does not outlive the handler: the job keeps copies.
  call->dims.assign(x.dimensions().begin(), x.dimensions().end());
  call->pairs.assign(pairs.begin(), pairs.end());
  c.dims = call->dims.data();
  call->g = Meeting{kind, c.size, static_cast<int>(local), c.rank, 0,
                    rows_in ? in_bytes / participants : in_bytes, call->pairs, root,
                    kind == kMeetAllreduce && split != 0};
  call->meeting = &MeetingFor(comm_slot, group);
  if (call->meeting->identity.load(std::memory_order_acquire) == nullptr) {
    // The group's devices: those with groups[d] == group, or all of them.
    const int64_t listed = groups.size() == 0 ? local : static_cast<int64_t>(groups.size());
    for (int64_t d = 0; d < listed; ++d) {
      if (groups.size() != 0 && groups[d] != group) continue;
      call->devices += (call->devices.empty() ? "" : ",") + std::to_string(d);
    }
  }
  call->device = device;
  call->op = op;
  call->in_bytes = in_bytes;
  call->out_bytes = out_bytes;
  // Where the ranks agreed (meetings_start_here: runtime/comm.py), the turn starts on XLA's thread,
  // each wait bounded by kArrivedHereNs, and where the devices and ranks are all
  // there it ends there (no hop: a balanced job's small collectives); past the
  // bound it goes on on the device's progress thread (engine/progress.h), so XLA
  // holds none of its own threads while the devices wait for each other or for
  // a late rank (docs/design.md, "Ranks x devices").  Queued whole instead: a
  // call while the device's queue holds an earlier one (it must not overtake
  // it), the split allreduce (each device's own MPI call while packing, no
  // barrier before it), and where MPI runs serialized (one MPI call at a time:
  // nothing may wait on XLA's thread beside it).
  call->gate.barrier = meetings_start_here[comm_slot % kMaxComms].load(std::memory_order_acquire);
  if (call->gate.barrier && progress_threads[device].Pending() == 0 &&
      !call->g.split && !serialized_mpi.on.load(std::memory_order_relaxed)) {
    call->gate.here = true;
    call->gate.deadline = NowNs() + kArrivedHereNs;
    if (Advance(*call, call->gate.deadline)) {
      turns.here.fetch_add(1, std::memory_order_relaxed);
      return CompletedFuture(call->result);
    }
    call->gate.here = false;
    turns.handed_off.fetch_add(1, std::memory_order_relaxed);
  } else {
    turns.queued.fetch_add(1, std::memory_order_relaxed);
  }
  return Overlap(device, [call] {
    Advance(*call, kNoDeadline);
    return call->result;
  });
}
}  // namespace
}  // namespace meeting

void SetGatherPieces(int pieces) { meeting::gather_pieces_asked.store(pieces); }

std::array<int64_t, 3> MeetingTurns() {
  return {meeting::turns.here.load(), meeting::turns.handed_off.load(),
          meeting::turns.queued.load()};
}

// A collective whose local devices meet in this process (CPU only; see above).
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuLocalMeeting, meeting::CpuLocalMeetingEntry,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ctx<LocalDevice>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("root")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("local")
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("split")
                                  .Attr<ffi::Span<const int64_t>>("pairs")
                                  .Attr<ffi::Span<const int64_t>>("groups"));

}  // namespace mpicoll

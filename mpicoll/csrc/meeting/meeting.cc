// The local meeting: a collective over every device of several processes (a
// global mesh's axes that span processes and their devices, or the ranks x
// devices allreduce of small arrays) whose L local device threads meet in this
// process, so that ONE MPI collective moves the process's data.
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/call.h"
#include "../core/collectives.h"
#include "../core/comm_table.h"
#include "../core/execute.h"
#include "../core/guard.h"
#include "../entries/entries.h"
#include "../memory/host.h"
#include "../memory/rows_in_place.h"
#include "kinds.def"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
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
// none is padded with zeros (issue 34).
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
enum MeetingKind : int64_t {
#define MPICOLL_MEETING_ENUM(Enum, name, code, rows_in, reduces, mpi) Enum = code,
  MPICOLL_MEETING_KINDS(MPICOLL_MEETING_ENUM)
#undef MPICOLL_MEETING_ENUM
};

// A kind's row of kinds.def (nullptr for a code no row has).
struct KindFacts {
  const char* name;
  bool rows_in, reduces;
};
const KindFacts* FactsOf(int64_t kind) {
  static const KindFacts facts[] = {
#define MPICOLL_MEETING_FACTS(Enum, name, code, rows_in, reduces, mpi) \
  {name, rows_in, reduces},
      MPICOLL_MEETING_KINDS(MPICOLL_MEETING_FACTS)
#undef MPICOLL_MEETING_FACTS
  };
  constexpr int64_t count = sizeof(facts) / sizeof(facts[0]);
  return kind >= 0 && kind < count ? &facts[kind] : nullptr;
}
const char* KindName(int64_t kind) { return FactsOf(kind) ? FactsOf(kind)->name : "?"; }

struct LocalMeeting {
  std::mutex mutex;
  std::condition_variable changed;
  std::atomic<uint64_t> generation{0};  // calls completed
  std::atomic<int> arrived{0};
  std::atomic<int> packed{0};  // threads done packing in this call
  std::atomic<int> copied{0};  // allgather: threads done copying the leader's output
  std::atomic<size_t> gathered{0};  // allgather: elements of every rank block final in it
  int expected = 0;
  size_t bytes = 0;
  int64_t kind = -1;
  ffi::DataType dtype = ffi::DataType::INVALID;
  int64_t op = -1;
  const char* inputs[kMaxLocalDevices];
  char* outputs[kMaxLocalDevices];  // written by other devices while packing (alltoall, permute)
  int32_t devices[kMaxLocalDevices];
  std::vector<char> send, receive;
  std::vector<int64_t> counts;  // permute: MPI_Alltoallv's row size and counts
  std::string mismatch;         // arrivals that disagree (never in one SPMD program)
  std::string error;            // this generation's failure, seen by every thread
};
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
constexpr int64_t kLocalSpinNs = 50000;

// Waits (spin, then sleep) until ready() holds; ready reads atomics only.
template <typename Ready>
void AwaitLocal(LocalMeeting& m, std::unique_lock<std::mutex>& lock, Ready&& ready) {
  if (ready()) return;
  lock.unlock();
  const int64_t spin_until = NowNs() + kLocalSpinNs;
  while (!ready() && NowNs() < spin_until) std::this_thread::yield();
  lock.lock();
  m.changed.wait(lock, ready);
}

// allgather's pipeline.  Every device but the leader copies the whole gathered
// output out of the leader's (L - 1 copies of the result: each device's output
// is its own), and done after MPI, that copy adds to the call: 4 MiB per
// process over 2 processes x 2 devices, MPI's 1.2-1.4 ms and then 1.1 ms of
// copying.  So the leader can gather in pieces (each piece an element range of
// every rank's block: a chunk, as for counts above INT_MAX or the GPU staging
// pipeline, core/execute.h), publishing each as it lands, and the others copy
// piece k while MPI moves piece k + 1.  That pays only where the copying
// threads have cores of their own: each piece is an MPI call (4 pieces cost
// MPICH 1.17x one call's time in shared memory), and on the 2-core machine,
// where 2 processes x 2 devices share 2 cores, pieces made a 2 x 2 gather of
// 4 MiB per process 10-15% slower in shared memory (and 15-25% faster at 2 x 4
// over TCP between simulated hosts).  So by default (MPICOLL_GATHER_PIECES=0)
// pieces are used where this process may run on two cores per local device;
// MPICOLL_GATHER_PIECES=N asks for N pieces (1: whole).  A piece is never
// under kGatherPieceBytes of every block.
constexpr int kGatherPieces = 4;
constexpr size_t kGatherPieceBytes = size_t{256} << 10;
std::atomic<int> gather_pieces_asked{0};

int GatherPieces(int local) {
  if (const int asked = gather_pieces_asked.load(std::memory_order_relaxed); asked > 0) {
    return asked;
  }
  static const int cores = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  }();
  return cores >= 2 * local ? kGatherPieces : 1;
}

struct GatherPipeline : HostMemory {
  LocalMeeting* meeting = nullptr;
  size_t piece = kMaxChunk;  // elements of every block per MPI call
  GatherPipeline(LocalMeeting& m, const Call& c, size_t block, int local) : meeting(&m) {
    advise_huge_pages = false;  // the leader's output: the devices' rows are in it already
    const size_t pieces = GatherPieces(local);
    const size_t least = std::max<size_t>(1, kGatherPieceBytes / c.elem_bytes);
    if (pieces > 1 && block >= 2 * least) {
      piece = std::min(kMaxChunk, std::max(least, (block + pieces - 1) / pieces));
    }
  }
  size_t ChunkElements(const Call&, size_t) const { return piece; }
  int AfterChunk(const Call&, const Chunk& k) {
    {
      std::lock_guard<std::mutex> lock(meeting->mutex);  // a waiter cannot miss the change
      meeting->gathered.store(k.offset + k.count);
    }
    meeting->changed.notify_all();
    return MPI_SUCCESS;
  }
};

// What one call of the meeting is: the participants and the row they exchange.
struct Meeting {
  int64_t kind;
  int ranks, local, rank, part;  // part: this device's place among the local devices
  size_t row_bytes;
  ffi::Span<const int64_t> pairs;  // permute: (source row, destination row) pairs
  int64_t root;                    // bcast: the root participant's row
  bool split = false;              // allreduce: every device allreduces its own slice
  const char* gathered = nullptr;  // allgather: the leader's output, every row in it
};

// alltoall's and permute's rows from and to the devices' own buffers.  Packed,
// every row for another process is copied into the send buffer and every row
// from one out of the receive buffer: alltoall at 4 MiB per process over 2 x 2
// devices spent 0.2 ms packing and 0.1 ms unpacking per device around MPI's
// 1.5 ms.  Large rows instead go to one MPI_Alltoallw whose datatypes name
// them where they are (absolute addresses from MPI_BOTTOM), in the order the
// packed buffers would hold them.  Every device is still in the call while
// the leader runs it.  Small rows keep the packed path, where a datatype per
// process per call would cost more than the copies.
constexpr size_t kDirectRowBytes = size_t{64} << 10;

bool RowsGoDirect(const Meeting& g) {
  return (g.kind == kMeetAlltoall || g.kind == kMeetPermute) &&
         g.row_bytes >= kDirectRowBytes &&
         g.row_bytes * g.local <= static_cast<size_t>(INT_MAX);
}

// The element range [begin, end) of slice `part` of `count` elements over `local` devices.
std::pair<size_t, size_t> SliceOf(size_t count, int part, int local) {
  return {count * part / local, count * (part + 1) / local};
}

// Slice `part` of the reduction of the L inputs (in device order, so the
// result does not depend on who arrived first) into `into`, with MPI's own
// operators (every op and dtype the MPI collective takes).  The slices are
// disjoint: every thread reduces its own at once.
ffi::Error ReduceLocalSlice(const LocalMeeting& m, const Call& c, int part, char* into) {
  const auto [begin, end] = SliceOf(c.in_count, part, m.expected);
  const size_t offset = begin * c.elem_bytes;
  std::memcpy(into + offset, m.inputs[0] + offset, (end - begin) * c.elem_bytes);
  for (int i = 1; i < m.expected; ++i) {
    for (size_t at = begin; at < end; at += kMaxChunk) {
      const int n = static_cast<int>(std::min(kMaxChunk, end - at));
      const size_t from = offset + (at - begin) * c.elem_bytes;
      const int rc = MPI_Reduce_local(m.inputs[i] + from, into + from, n, c.type, c.mpi_op);
      if (rc != MPI_SUCCESS) return MpiFailure(c, rc);
    }
  }
  return ffi::Error::Success();
}

// allreduce, split: this device's slice of the local reduction (Pack), across
// the ranks on this device's own communicator, every device at once, inside
// the meeting (so every MPI call of a call still runs between the threads'
// arrival and their release: no device is elsewhere meanwhile).  Above
// local_combine_bytes(L) per device this takes the node's link traffic over L
// streams instead of one (Python decides: ops/ranks_devices.py).
ffi::Error AllreduceOwnSlice(LocalMeeting& m, const Call& mine, const Meeting& g, int32_t device,
                             ffi::Span<const int64_t> dims) {
  const auto [begin, end] = SliceOf(mine.in_count, g.part, g.local);
  if (begin == end) return ffi::Error::Success();  // alike on every rank
  Call c = mine;
  c.in = c.out = m.send.data() + begin * c.elem_bytes;
  c.in_count = c.out_count = end - begin;
  HostMemory memory;
  memory.advise_huge_pages = false;
  return Execute<AllreduceOp>(c, device, memory, [&c, &g, dims] {
    return Describe(c, c.dtype, dims, /*reduces=*/true, /*rooted=*/false) + ", slice " +
           std::to_string(g.part) + " of " + std::to_string(g.local) + " local devices";
  });
}

// permute: where row `row`'s pairs put their data.  The send buffer holds the
// pairs from this rank, by destination rank, then source row; the receive
// buffer those to this rank, by source rank, then source row (what
// MPI_Alltoallv makes of the send buffers of every rank).
struct PermuteSlots {
  std::vector<int64_t> send_counts, receive_counts;
  explicit PermuteSlots(const Meeting& g) : send_counts(g.ranks), receive_counts(g.ranks) {
    for (size_t i = 0; i + 1 < g.pairs.size(); i += 2) {
      const int from = static_cast<int>(g.pairs[i] / g.local);
      const int to = static_cast<int>(g.pairs[i + 1] / g.local);
      if (from == to) continue;  // inside a rank: device to device, no message
      if (from == g.rank) ++send_counts[to];
      if (to == g.rank) ++receive_counts[from];
    }
  }
  // The place of pair (source, destination) in this rank's send buffer.
  static size_t SendSlot(const Meeting& g, int64_t source, int64_t destination) {
    return Slot(g, source, destination, /*by_destination=*/true);
  }
  static size_t ReceiveSlot(const Meeting& g, int64_t source, int64_t destination) {
    return Slot(g, source, destination, /*by_destination=*/false);
  }

 private:
  // Pairs of this rank's block that come before (source, destination).
  static size_t Slot(const Meeting& g, int64_t source, int64_t destination,
                     bool by_destination) {
    const int64_t block = (by_destination ? destination : source) / g.local;
    size_t slot = 0;
    for (size_t i = 0; i + 1 < g.pairs.size(); i += 2) {
      const int64_t s = g.pairs[i], d = g.pairs[i + 1];
      if ((by_destination ? s : d) / g.local != g.rank) continue;  // not this rank's
      if (s / g.local == d / g.local) continue;                    // no message
      const int64_t b = (by_destination ? d : s) / g.local;
      if (b < block || (b == block && s < source)) ++slot;
    }
    return slot;
  }
};

// This thread's part before the MPI call (every thread at once).
ffi::Error Pack(LocalMeeting& m, const Call& c, const Meeting& g, const char* input) {
  const size_t row = g.row_bytes;
  const int L = g.local;
  switch (g.kind) {
    case kMeetAllreduce:
    case kMeetReduceScatter:
    case kMeetReduce:
      return ReduceLocalSlice(m, c, g.part, m.send.data());
    case kMeetAllgather:  // straight into the leader's output, where MPI gathers in place
      std::memcpy(m.outputs[0] + (static_cast<size_t>(g.rank) * L + g.part) * row, input, row);
      break;
    case kMeetAlltoall:
      // Rows for this rank's own devices go straight into their outputs: every
      // device is still in the call, and no output is any device's input.
      for (int r = 0; r < g.ranks; ++r) {
        const size_t other = r < g.rank ? r : r - 1;  // r's place among the other ranks
        if (r != g.rank && RowsGoDirect(g)) continue;  // MPI reads them where they are
        for (int k = 0; k < L; ++k) {
          const char* from = input + (static_cast<size_t>(r) * L + k) * row;
          char* to = r == g.rank
                         ? m.outputs[k] + (static_cast<size_t>(g.rank) * L + g.part) * row
                         : m.send.data() + ((other * L + g.part) * L + k) * row;
          std::memcpy(to, from, row);
        }
      }
      break;
    case kMeetPermute: {
      const int64_t me = static_cast<int64_t>(g.rank) * L + g.part;
      for (size_t i = 0; i + 1 < g.pairs.size(); i += 2) {
        if (g.pairs[i] != me) continue;
        const int64_t to = g.pairs[i + 1];
        if (to / L != g.rank && RowsGoDirect(g)) continue;  // MPI reads it where it is
        std::memcpy(to / L == g.rank ? m.outputs[to % L]  // a device of this rank
                                     : m.send.data() + PermuteSlots::SendSlot(g, me, to) * row,
                    input, row);
      }
      break;
    }
    case kMeetBcast:
      if (g.root == static_cast<int64_t>(g.rank) * L + g.part) {
        std::memcpy(m.send.data(), input, row);
      }
      break;
  }
  return ffi::Error::Success();
}

// The leader's one MPI collective on the packed data (Execute: checked, timed,
// recorded like any call, and described as this kind over L local devices).
ffi::Error Lead(LocalMeeting& m, const Call& mine, const Meeting& g, int32_t device,
                ffi::Span<const int64_t> dims) {
  Call c = mine;
  HostMemory memory;
  memory.advise_huge_pages = false;
  const size_t row = g.row_bytes / c.elem_bytes;  // elements
  const size_t L = g.local, P = g.ranks;
  auto described = [&](const char* name, bool reduces, bool rooted) {
    return [&c, &g, dims, name, reduces, rooted] {
      Call named = c;
      named.name = name;
      return Describe(named, named.dtype, dims, reduces, rooted) + ", over " +
             std::to_string(g.local) + " local devices";
    };
  };
  switch (g.kind) {
    case kMeetAllreduce:
      if (g.split) return ffi::Error::Success();  // every device allreduced its slice
      c.in = c.out = m.send.data();
      c.in_count = c.out_count = row;
      return Execute<AllreduceOp>(c, device, memory, described("allreduce", true, false));
    case kMeetAllgather: {  // in place, in the leader's own output (Pack), in pieces
      c.in = c.out = m.outputs[0];
      c.in_count = L * row, c.out_count = P * L * row;
      c.name = AllgatherOp::kName, c.mpi_op = MPI_OP_NULL;
      GatherPipeline pipeline(m, c, L * row, g.local);
      return Execute<AllgatherOp>(c, device, pipeline, described("allgather", false, false));
    }
    case kMeetReduceScatter:
      c.in = m.send.data(), c.out = m.receive.data();
      c.in_count = P * L * row, c.out_count = L * row;
      c.name = ReduceScatterOp::kName;
      return Execute<ReduceScatterOp>(c, device, memory,
                                      described("reduce_scatter", true, false));
    case kMeetAlltoall:  // L * L rows to and from every other rank, none to itself
      m.counts.assign(1, static_cast<int64_t>(L * L * row));
      for (int side = 0; side < 2; ++side) {
        for (size_t r = 0; r < P; ++r) m.counts.push_back(static_cast<int>(r) != g.rank);
      }
      c.args = m.counts.data(), c.nargs = m.counts.size();
      c.in = m.send.data(), c.out = m.receive.data();
      c.in_count = c.out_count = (P - 1) * L * L * row;
      c.name = AlltoallvOp::kName, c.mpi_op = MPI_OP_NULL;
      if (RowsGoDirect(g)) {  // to rank r: device k's rows for r's devices, contiguous
        RowsInPlace rows(g.ranks);  // from r: its device k's row for each device here
        for (size_t r = 0; r < P; ++r) {
          if (static_cast<int>(r) == g.rank) continue;
          for (size_t k = 0; k < L; ++k) {
            rows.to[r].emplace_back(m.inputs[k] + r * L * g.row_bytes,
                                    static_cast<int>(L * g.row_bytes));
            for (size_t here = 0; here < L; ++here) {
              rows.from[r].emplace_back(m.outputs[here] + (r * L + k) * g.row_bytes,
                                        static_cast<int>(g.row_bytes));
            }
          }
        }
        c.in = const_cast<char*>(m.inputs[0]), c.out = m.outputs[0];  // MPI names every row
        return Execute<AlltoallvOp>(c, device, rows, described("alltoall", false, false));
      }
      return Execute<AlltoallvOp>(c, device, memory, described("alltoall", false, false));
    case kMeetPermute: {
      const PermuteSlots slots(g);
      m.counts.assign(1, static_cast<int64_t>(row));
      m.counts.insert(m.counts.end(), slots.send_counts.begin(), slots.send_counts.end());
      m.counts.insert(m.counts.end(), slots.receive_counts.begin(), slots.receive_counts.end());
      c.args = m.counts.data(), c.nargs = m.counts.size();
      c.in = m.send.data(), c.out = m.receive.data();
      c.in_count = m.send.size() / c.elem_bytes, c.out_count = m.receive.size() / c.elem_bytes;
      c.name = AlltoallvOp::kName, c.mpi_op = MPI_OP_NULL;
      if (RowsGoDirect(g)) {  // in the packed buffers' order: by rank, then source row
        std::vector<std::pair<int64_t, int64_t>> crossing;  // (source, destination) rows
        for (size_t i = 0; i + 1 < g.pairs.size(); i += 2) {
          if (g.pairs[i] / g.local != g.pairs[i + 1] / g.local) {
            crossing.emplace_back(g.pairs[i], g.pairs[i + 1]);
          }
        }
        std::sort(crossing.begin(), crossing.end());
        RowsInPlace rows(g.ranks);
        size_t sends = 0, receives = 0;
        for (const auto& [source, destination] : crossing) {
          if (source / g.local == g.rank) {
            rows.to[destination / g.local].emplace_back(m.inputs[source % g.local],
                                                       static_cast<int>(g.row_bytes));
            ++sends;
          } else if (destination / g.local == g.rank) {
            rows.from[source / g.local].emplace_back(m.outputs[destination % g.local],
                                                     static_cast<int>(g.row_bytes));
            ++receives;
          }
        }
        c.in = const_cast<char*>(m.inputs[0]), c.out = m.outputs[0];  // MPI names every row
        c.in_count = sends * row, c.out_count = receives * row;
        return Execute<AlltoallvOp>(c, device, rows, described("permute", false, false));
      }
      return Execute<AlltoallvOp>(c, device, memory, described("permute", false, false));
    }
    case kMeetBcast:
      c.in = c.out = m.send.data();
      c.in_count = c.out_count = row;
      c.root = static_cast<int>(g.root / g.local);
      c.name = BcastOp::kName, c.mpi_op = MPI_OP_NULL;
      return Execute<BcastOp>(c, device, memory, described("bcast", false, true));
    case kMeetReduce:
      c.in = m.send.data(), c.out = m.receive.data();
      c.in_count = c.out_count = row;
      c.root = static_cast<int>(g.root / g.local);
      c.name = ReduceOp::kName;
      return Execute<ReduceOp>(c, device, memory, described("reduce", true, true));
  }
  return ffi::Error::InvalidArgument("mpicoll: unknown local meeting kind");
}

// This thread's part after the MPI call.
void Unpack(const LocalMeeting& m, const Meeting& g, char* output, size_t out_bytes) {
  const size_t row = g.row_bytes;
  const int L = g.local;
  switch (g.kind) {
    case kMeetAllreduce:
    case kMeetBcast:
      std::memcpy(output, m.send.data(), out_bytes);
      break;
    case kMeetAllgather:  // copied piece by piece while the leader gathered (CopyGathered)
      break;
    case kMeetReduce:
      if (g.root == static_cast<int64_t>(g.rank) * L + g.part) {
        std::memcpy(output, m.receive.data(), out_bytes);
      } else {
        std::memset(output, 0, out_bytes);
      }
      break;
    case kMeetReduceScatter:
      std::memcpy(output, m.receive.data() + g.part * row, row);
      break;
    case kMeetAlltoall:  // this rank's own rows arrived while packing
      if (RowsGoDirect(g)) break;  // and the others' in MPI_Alltoallw
      for (int r = 0; r < g.ranks; ++r) {
        if (r == g.rank) continue;
        const size_t other = r < g.rank ? r : r - 1;
        for (int k = 0; k < L; ++k) {
          std::memcpy(output + (static_cast<size_t>(r) * L + k) * row,
                      m.receive.data() + ((other * L + k) * L + g.part) * row, row);
        }
      }
      break;
    case kMeetPermute: {
      const int64_t me = static_cast<int64_t>(g.rank) * L + g.part;
      bool sent_to = false;
      for (size_t i = 0; i + 1 < g.pairs.size(); i += 2) {
        if (g.pairs[i + 1] != me) continue;
        sent_to = true;
        if (g.pairs[i] / L == g.rank) continue;  // from a device of this rank, while packing
        if (RowsGoDirect(g)) continue;           // from another rank, by MPI
        std::memcpy(output,
                    m.receive.data() + PermuteSlots::ReceiveSlot(g, g.pairs[i], me) * row, row);
      }
      if (!sent_to) std::memset(output, 0, out_bytes);  // zeros, as lax.ppermute
      break;
    }
  }
}

// allgather, on a device other than the leader: copies every piece of the
// leader's output as it lands, until the leader publishes the call's end
// (called and returning with the lock held).
void CopyGathered(LocalMeeting& m, const Meeting& g, std::unique_lock<std::mutex>& lock,
                  uint64_t generation, char* output, size_t elem_bytes) {
  const size_t block = static_cast<size_t>(g.local) * g.row_bytes;  // bytes per rank
  size_t copied = 0;  // bytes of every rank block
  for (;;) {
    AwaitLocal(m, lock, [&] {
      return m.gathered.load() * elem_bytes > copied || m.generation.load() != generation;
    });
    // The end first: once it is published, so is every piece before it.
    const bool ended = m.generation.load() != generation;
    const size_t upto = m.gathered.load() * elem_bytes;
    if (upto > copied) {
      lock.unlock();
      for (int r = 0; r < g.ranks; ++r) {
        const size_t at = r * block + copied;
        std::memcpy(output + at, g.gathered + at, upto - copied);
      }
      lock.lock();
      copied = upto;
    }
    if (ended) return;
  }
}

// Sizes the shared buffers for a call (by the last arrival, when no thread of
// the previous call still reads them).
void SizeBuffers(LocalMeeting& m, const Meeting& g, size_t in_bytes) {
  const size_t row = g.row_bytes, L = g.local, P = g.ranks;
  switch (g.kind) {
    case kMeetAllreduce:
    case kMeetBcast:
      m.send.resize(row), m.receive.clear();
      break;
    case kMeetReduce:
      m.send.resize(row), m.receive.resize(row);
      break;
    case kMeetAllgather:  // none: the rows meet in the leader's output
      m.send.clear(), m.receive.clear();
      break;
    case kMeetReduceScatter:
      m.send.resize(in_bytes), m.receive.resize(L * row);
      break;
    case kMeetAlltoall:
      if (RowsGoDirect(g)) {
        m.send.clear(), m.receive.clear();
      } else {
        m.send.resize((P - 1) * L * L * row), m.receive.resize((P - 1) * L * L * row);
      }
      break;
    case kMeetPermute: {
      if (RowsGoDirect(g)) {
        m.send.clear(), m.receive.clear();
        break;
      }
      const PermuteSlots slots(g);
      int64_t sends = 0, receives = 0;
      for (int64_t n : slots.send_counts) sends += n;
      for (int64_t n : slots.receive_counts) receives += n;
      m.send.resize(sends * row), m.receive.resize(receives * row);
      break;
    }
  }
}

// What a queued meeting call keeps of XLA's call frame.
struct MeetingCall {
  Call c{};
  Meeting g{};
  std::vector<int64_t> dims, pairs;
  int64_t group = 0, comm_slot = 0;
};

// One device's part of a meeting, on its progress thread.
ffi::Error RunMeeting(MeetingCall& call, int32_t device, int64_t op, size_t in_bytes,
                      size_t out_bytes) {
  Call& c = call.c;
  Meeting& g = call.g;
  const int64_t kind = g.kind, local = g.local;
  const ffi::Span<const int64_t> dims(call.dims);
  const KindFacts* facts = FactsOf(kind);
  LocalMeeting& m = MeetingFor(call.comm_slot, call.group);
  std::unique_lock<std::mutex> lock(m.mutex);
  const uint64_t generation = m.generation.load();
  const int index = m.arrived.load();
  if (index == 0) {
    m.expected = static_cast<int>(local);
    m.bytes = in_bytes;
    m.kind = kind;
    m.dtype = c.dtype;
    m.op = op;
    m.mismatch.clear();
  } else if (m.expected != local || m.bytes != in_bytes || m.kind != kind ||
             m.dtype != c.dtype || m.op != op) {
    m.mismatch = std::string("mpicoll.") + KindName(kind) +
                 ": the local devices called different collectives on one communicator at "
                 "once (local device " + std::to_string(device) + ")";
  }
  m.inputs[index] = c.in;
  m.outputs[index] = c.out;
  m.devices[index] = device;
  if (index + 1 == m.expected) {
    // Every thread of the previous call has arrived here, so none still reads
    // its error or buffers.  The arrivals go in device order, the leader first.
    m.error.clear();
    m.gathered.store(0);
    if (m.mismatch.empty()) SizeBuffers(m, g, in_bytes);
    std::tuple<int32_t, const char*, char*> arrivals[kMaxLocalDevices];
    for (int i = 0; i < m.expected; ++i) arrivals[i] = {m.devices[i], m.inputs[i], m.outputs[i]};
    std::sort(arrivals, arrivals + m.expected);
    for (int i = 0; i < m.expected; ++i) {
      std::tie(m.devices[i], m.inputs[i], m.outputs[i]) = arrivals[i];
    }
  }
  m.arrived.store(index + 1);
  m.changed.notify_all();
  Call waiting = c;
  waiting.name = facts->name;  // reports.h: WaitInsideCall says what it waits for
  {
    InFlightScope watched(waiting, device, /*new_call=*/false);
    AwaitLocal(m, lock, [&] {
      return m.arrived.load() == m.expected || m.generation.load() != generation;
    });
  }
  if (m.generation.load() == generation) {  // everyone is here, nobody has published yet
    const int32_t leader = m.devices[0];
    g.part = static_cast<int>(std::find(m.devices, m.devices + m.expected, device) - m.devices);
    g.gathered = m.outputs[0];  // read now: the next call's arrivals rewrite m.outputs
    std::string failed = m.mismatch;
    if (failed.empty()) {
      lock.unlock();
      ffi::Error err = Pack(m, c, g, c.in);
      if (!err.failure() && g.split) err = AllreduceOwnSlice(m, c, g, device, dims);
      lock.lock();
      if (err.failure()) failed = std::string(err.message());
    }
    if (!failed.empty() && m.error.empty()) m.error = failed;
    m.packed.store(m.packed.load() + 1);
    m.changed.notify_all();
    if (device == leader) {
      {
        InFlightScope watched(waiting, device, /*new_call=*/false);
        AwaitLocal(m, lock, [&] { return m.packed.load() == m.expected; });
      }
      if (m.error.empty()) {
        lock.unlock();
        ffi::Error err = Lead(m, c, g, device, dims);
        lock.lock();
        if (err.failure()) m.error = std::string(err.message());
      }
      m.packed.store(0);
      m.arrived.store(0);
      m.generation.store(generation + 1);
      m.changed.notify_all();
    } else {
      InFlightScope watched(waiting, device, /*new_call=*/false);
      if (kind == kMeetAllgather) {
        CopyGathered(m, g, lock, generation, c.out, c.elem_bytes);
      } else {
        AwaitLocal(m, lock, [&] { return m.generation.load() != generation; });
      }
    }
  } else {
    g.part = static_cast<int>(std::find(m.devices, m.devices + m.expected, device) - m.devices);
  }
  // Until this thread arrives at the next call, nobody writes the buffers or m.error.
  const std::string error = m.error;
  const int others = m.expected - 1;
  lock.unlock();
  if (!error.empty()) return ffi::Error::Internal(error);
  Unpack(m, g, c.out, out_bytes);
  if (kind == kMeetAllgather && others > 0) {
    // The others copy from the leader's output: it stays XLA's until they have.
    lock.lock();
    if (g.part != 0) {
      m.copied.store(m.copied.load() + 1);
      m.changed.notify_all();
    } else {
      InFlightScope watched(waiting, device, /*new_call=*/false);
      AwaitLocal(m, lock, [&] { return m.copied.load() == others; });
      m.copied.store(0);  // before the leader's next call, so before anyone's next copy
    }
  }
  return ffi::Error::Success();
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
  c.name = KindName(kind);
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
  call->group = group;
  call->comm_slot = comm_slot;
  // The meeting runs on the device's progress thread (core/progress.h), in this
  // device's program order after its queued calls, and XLA holds none of its
  // own threads while the devices wait for each other: so a pool with fewer
  // threads than devices cannot starve the devices still computing (on 2
  // cores, 2 ranks x 2 devices, a 4 MiB gradient step hung about half its
  // runs when the meeting blocked XLA's thread; issue 43).
  return Overlap(device, [call, device, op, in_bytes, out_bytes] {
    return RunMeeting(*call, device, op, in_bytes, out_bytes);
  });
}
}  // namespace

void SetGatherPieces(int pieces) { gather_pieces_asked.store(pieces); }

std::vector<MeetingKindRow> MeetingKindRows() {
  return {
#define MPICOLL_MEETING_ROW(Enum, name, code, rows_in, reduces, mpi) {name, code, rows_in},
      MPICOLL_MEETING_KINDS(MPICOLL_MEETING_ROW)
#undef MPICOLL_MEETING_ROW
  };
}

// A collective whose local devices meet in this process (CPU only; see above).
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuLocalMeeting, CpuLocalMeetingEntry,
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

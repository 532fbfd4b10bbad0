// The local meeting's kinds, one struct each (the rows of kinds.def name
// them), shaped alike so that the meeting (meeting.cc) runs every kind the
// same way and asks nothing else about which kind it is:
//   Size(m, g, in_bytes)  sizes the shared buffers (by the last arrival)
//   Pack(turn)            this device's part before the MPI call, every device
//                         at once (for the split allreduce, its own MPI call too)
//   Lead(turn)            the leader's MPI call on the packed data
//   Unpack(turn, bytes)   this device's part after it
// What each packs, calls and takes: the table at the top of meeting.cc.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../engine/collectives.h"
#include "../engine/execute.h"
#include "../memory/host.h"
#include "../memory/rows_in_place.h"
#include "meeting.h"

namespace mpicoll {
namespace meeting {

// The leader's MPI call: its own Call (communicator, dtype, op) with the
// buffers and counts the kind sets, run by Execute (check mode, timeout,
// serialized lock, records, as for any call), described as the kind over the
// L local devices.
struct LeadCall {
  const Turn& turn;
  Call c;
  HostMemory memory;
  size_t row, L, P;  // row: elements
  explicit LeadCall(const Turn& t)
      : turn(t), c(t.c), row(t.g.row_bytes / t.c.elem_bytes), L(t.g.local), P(t.g.ranks) {
    memory.advise_huge_pages = false;
  }
  // On XLA's thread (turn.gate->here) the call may hand itself off instead of
  // running (gate->handed_off, nothing called but the barrier's start): a Lead
  // is run again whole on the progress thread, so it must not change what it
  // computes the call from before this returns.
  template <typename Op, typename Memory>
  ffi::Error Run(Memory& with, const char* described_as) {
    auto describe = [this, described_as] {
      Call named = c;
      named.name = described_as;
      return Describe(named, named.dtype, turn.dims, Op::kReduces, Op::kRooted) + ", over " +
             std::to_string(L) + " local devices";
    };
    LeadGate& gate = *turn.gate;
    if (gate.here && gate.HandsOff(c, PlanCheck(c, turn.device, describe).check)) {
      return ffi::Error::Success();
    }
    return Execute<Op>(c, turn.device, with, describe, gate);
  }
  template <typename Op>
  ffi::Error Run(const char* described_as) {
    return Run<Op>(memory, described_as);
  }
};

// Slice `part` of the reduction of the L inputs (in device order, so the
// result does not depend on who arrived first) into `into`, with MPI's own
// operators (every op and dtype the MPI collective takes).  The slices are
// disjoint: every thread reduces its own at once.
inline ffi::Error ReduceLocalSlice(const LocalMeeting& m, const Call& c, int part, char* into) {
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


// allgather's pipeline.  Every device but the leader copies the whole gathered
// output out of the leader's (L - 1 copies of the result: each device's output
// is its own), and done after MPI, that copy adds to the call: 4 MiB per
// process over 2 processes x 2 devices, MPI's 1.2-1.4 ms and then 1.1 ms of
// copying.  So the leader can gather in pieces (each piece an element range of
// every rank's block: a chunk, as for counts above INT_MAX or the GPU staging
// pipeline, engine/execute.h), publishing each as it lands, and the others copy
// piece k while MPI moves piece k + 1.  That pays only where the copying
// threads have cores of their own: each piece is an MPI call (4 pieces cost
// MPICH 1.17x one call's time in shared memory), and on the 2-core machine,
// where 2 processes x 2 devices share 2 cores, pieces made a 2 x 2 gather of
// 4 MiB per process 10-15% slower in shared memory (and 15-25% faster at 2 x 4
// over TCP between simulated hosts).  So by default (MPICOLL_GATHER_PIECES=0)
// pieces are used where this process may run on two cores per local device;
// MPICOLL_GATHER_PIECES=N asks for N pieces (1: whole).  A piece is never
// under kGatherPieceBytes of every block.
inline constexpr int kGatherPieces = 4;
inline constexpr size_t kGatherPieceBytes = size_t{256} << 10;
inline std::atomic<int> gather_pieces_asked{0};

inline int GatherPieces(int local) {
  if (const int asked = gather_pieces_asked.load(std::memory_order_relaxed); asked > 0) {
    return asked;
  }
  return CoresHere() >= 2 * local ? kGatherPieces : 1;
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


// alltoall's and permute's rows from and to the devices' own buffers.  Packed,
// every row for another process is copied into the send buffer and every row
// from one out of the receive buffer: alltoall at 4 MiB per process over 2 x 2
// devices spent 0.2 ms packing and 0.1 ms unpacking per device around MPI's
// 1.5 ms.  Large rows instead go to one MPI_Alltoallw whose datatypes name
// them where they are (absolute addresses from MPI_BOTTOM), in the order the
// packed buffers would hold them.  Every device is still in the call while
// the leader runs it.  Small rows keep the packed path, where a datatype per
// process per call would cost more than the copies.
inline constexpr size_t kDirectRowBytes = size_t{64} << 10;

// (alltoall and permute only.)
inline bool RowsGoDirect(const Meeting& g) {
  return g.row_bytes >= kDirectRowBytes &&
         g.row_bytes * g.local <= static_cast<size_t>(INT_MAX);
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


// allreduce: every device reduces its 1/L slice of the L inputs into the send
// buffer; then the leader's one MPI_Allreduce on the whole of it, or (split)
// every device's own MPI_Allreduce on its slice, on its own device's
// communicator, all at once.  Every device copies the whole result out.
struct AllreduceKind {
  static void Size(LocalMeeting& m, const Meeting& g, size_t) {
    m.send.resize(g.row_bytes), m.receive.clear();
  }
  static ffi::Error Pack(const Turn& t) {
    if (ffi::Error err = ReduceLocalSlice(t.m, t.c, t.g.part, t.m.send.data()); err.failure()) {
      return err;
    }
    return t.g.split ? AllreduceOwnSlice(t) : ffi::Error::Success();
  }
  static ffi::Error Lead(const Turn& t) {
    if (t.g.split) return ffi::Error::Success();  // every device allreduced its slice
    LeadCall lead(t);
    lead.c.in = lead.c.out = t.m.send.data();
    lead.c.in_count = lead.c.out_count = lead.row;
    return lead.Run<AllreduceOp>("allreduce");
  }
  static void Unpack(const Turn& t, size_t out_bytes) {
    std::memcpy(t.c.out, t.m.send.data(), out_bytes);
  }

 private:
  // The split: this device's slice of the local reduction across the ranks,
  // while every device is still in the meeting (so its MPI calls follow the
  // meeting order on every rank).  Above local_combine_bytes(L) per device
  // this takes the node's link traffic over L streams instead of one (Python
  // decides: ops/ranks_devices.py).
  static ffi::Error AllreduceOwnSlice(const Turn& t) {
    const auto [begin, end] = SliceOf(t.c.in_count, t.g.part, t.g.local);
    if (begin == end) return ffi::Error::Success();  // alike on every rank
    Call c = t.c;
    c.in = c.out = t.m.send.data() + begin * c.elem_bytes;
    c.in_count = c.out_count = end - begin;
    HostMemory memory;
    memory.advise_huge_pages = false;
    return Execute<AllreduceOp>(c, t.device, memory, [&c, &t] {
      return Describe(c, c.dtype, t.dims, /*reduces=*/true, /*rooted=*/false) + ", slice " +
             std::to_string(t.g.part) + " of " + std::to_string(t.g.local) + " local devices";
    });
  }
};

// allgather: every device's row goes straight into the leader's output, where
// MPI gathers in place, in pieces; the others copy each piece as it lands
// (meeting.cc, CopyGathered), and the leader waits for that.
struct AllgatherKind {
  static void Size(LocalMeeting& m, const Meeting&, size_t) {
    m.send.clear(), m.receive.clear();  // the rows meet in the leader's output
  }
  static ffi::Error Pack(const Turn& t) {
    std::memcpy(t.m.outputs[0] + (static_cast<size_t>(t.g.rank) * t.g.local + t.g.part) *
                                     t.g.row_bytes,
                t.c.in, t.g.row_bytes);
    return ffi::Error::Success();
  }
  static ffi::Error Lead(const Turn& t) {
    LeadCall lead(t);
    lead.c.in = lead.c.out = t.m.outputs[0];
    lead.c.in_count = lead.L * lead.row, lead.c.out_count = lead.P * lead.L * lead.row;
    lead.c.name = AllgatherOp::kName, lead.c.mpi_op = MPI_OP_NULL;
    GatherPipeline pipeline(t.m, lead.c, lead.L * lead.row, t.g.local);
    return lead.Run<AllgatherOp>(pipeline, "allgather");
  }
  static void Unpack(const Turn&, size_t) {}  // copied while the leader gathered
};

// reduce_scatter: the local reduction (as allreduce's), then one
// reduce-scatter of blocks of L rows; device k takes row k of its rank's block.
struct ReduceScatterKind {
  static void Size(LocalMeeting& m, const Meeting& g, size_t in_bytes) {
    m.send.resize(in_bytes), m.receive.resize(g.local * g.row_bytes);
  }
  static ffi::Error Pack(const Turn& t) {
    return ReduceLocalSlice(t.m, t.c, t.g.part, t.m.send.data());
  }
  static ffi::Error Lead(const Turn& t) {
    LeadCall lead(t);
    lead.c.in = t.m.send.data(), lead.c.out = t.m.receive.data();
    lead.c.in_count = lead.P * lead.L * lead.row, lead.c.out_count = lead.L * lead.row;
    lead.c.name = ReduceScatterOp::kName;
    return lead.Run<ReduceScatterOp>("reduce_scatter");
  }
  static void Unpack(const Turn& t, size_t) {
    std::memcpy(t.c.out, t.m.receive.data() + t.g.part * t.g.row_bytes, t.g.row_bytes);
  }
};

// alltoall: device k's row for (r, k') goes to ((r' * L + k) * L + k') of the
// send buffer, r' the place of r among the OTHER ranks; its rows for this
// rank go straight into device k''s output.  One MPI_Alltoallv of L * L rows
// to and from every other rank (large rows in place: RowsGoDirect).
struct AlltoallKind {
  static void Size(LocalMeeting& m, const Meeting& g, size_t) {
    const size_t L = g.local, P = g.ranks;
    if (RowsGoDirect(g)) {
      m.send.clear(), m.receive.clear();
    } else {
      m.send.resize((P - 1) * L * L * g.row_bytes), m.receive.resize((P - 1) * L * L * g.row_bytes);
    }
  }
  static ffi::Error Pack(const Turn& t) {
    const Meeting& g = t.g;
    const size_t row = g.row_bytes;
    const int L = g.local;
    // Rows for this rank's own devices go straight into their outputs: every
    // device is still in the call, and no output is any device's input.
    for (int r = 0; r < g.ranks; ++r) {
      const size_t other = r < g.rank ? r : r - 1;  // r's place among the other ranks
      if (r != g.rank && RowsGoDirect(g)) continue;  // MPI reads them where they are
      for (int k = 0; k < L; ++k) {
        const char* from = t.c.in + (static_cast<size_t>(r) * L + k) * row;
        char* to = r == g.rank
                       ? t.m.outputs[k] + (static_cast<size_t>(g.rank) * L + g.part) * row
                       : t.m.send.data() + ((other * L + g.part) * L + k) * row;
        std::memcpy(to, from, row);
      }
    }
    return ffi::Error::Success();
  }
  static ffi::Error Lead(const Turn& t) {  // L * L rows to and from every other rank
    LeadCall lead(t);
    LocalMeeting& m = t.m;
    const Meeting& g = t.g;
    const size_t L = lead.L, P = lead.P, row = lead.row;
    Call& c = lead.c;
    m.counts.assign(1, static_cast<int64_t>(L * L * row));
    for (int side = 0; side < 2; ++side) {
      for (size_t r = 0; r < P; ++r) m.counts.push_back(static_cast<int>(r) != g.rank);
    }
    c.args = m.counts.data(), c.nargs = m.counts.size();
    c.in = m.send.data(), c.out = m.receive.data();
    c.in_count = c.out_count = (P - 1) * L * L * row;
    c.name = AlltoallvOp::kName, c.mpi_op = MPI_OP_NULL;
    if (!RowsGoDirect(g)) return lead.Run<AlltoallvOp>("alltoall");
    RowsInPlace rows(g.ranks);  // to rank r: device k's rows for r's devices, contiguous
    for (size_t r = 0; r < P; ++r) {  // from r: its device k's row for each device here
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
    return lead.Run<AlltoallvOp>(rows, "alltoall");
  }
  static void Unpack(const Turn& t, size_t) {  // this rank's own rows arrived while packing
    const Meeting& g = t.g;
    if (RowsGoDirect(g)) return;  // and the others' in MPI_Alltoallw
    const size_t row = g.row_bytes;
    const int L = g.local;
    for (int r = 0; r < g.ranks; ++r) {
      if (r == g.rank) continue;
      const size_t other = r < g.rank ? r : r - 1;
      for (int k = 0; k < L; ++k) {
        std::memcpy(t.c.out + (static_cast<size_t>(r) * L + k) * row,
                    t.m.receive.data() + ((other * L + k) * L + g.part) * row, row);
      }
    }
  }
};

// permute (ppermute): device k's row, once per pair that sends from it to
// another rank (by destination rank, then source row: PermuteSlots), or
// straight into the output of a device of this rank.  One MPI_Alltoallv of the
// pairs' rows (large rows in place); a device no pair sends to gets zeros, as
// lax.ppermute.
struct PermuteKind {
  static void Size(LocalMeeting& m, const Meeting& g, size_t) {
    if (RowsGoDirect(g)) {
      m.send.clear(), m.receive.clear();
      return;
    }
    const PermuteSlots slots(g);
    int64_t sends = 0, receives = 0;
    for (int64_t n : slots.send_counts) sends += n;
    for (int64_t n : slots.receive_counts) receives += n;
    m.send.resize(sends * g.row_bytes), m.receive.resize(receives * g.row_bytes);
  }
  static ffi::Error Pack(const Turn& t) {
    const Meeting& g = t.g;
    const int64_t L = g.local, me = static_cast<int64_t>(g.rank) * L + g.part;
    for (size_t i = 0; i + 1 < g.pairs.size(); i += 2) {
      if (g.pairs[i] != me) continue;
      const int64_t to = g.pairs[i + 1];
      if (to / L != g.rank && RowsGoDirect(g)) continue;  // MPI reads it where it is
      std::memcpy(to / L == g.rank
                      ? t.m.outputs[to % L]  // a device of this rank
                      : t.m.send.data() + PermuteSlots::SendSlot(g, me, to) * g.row_bytes,
                  t.c.in, g.row_bytes);
    }
    return ffi::Error::Success();
  }
  static ffi::Error Lead(const Turn& t) {
    LeadCall lead(t);
    LocalMeeting& m = t.m;
    const Meeting& g = t.g;
    Call& c = lead.c;
    const PermuteSlots slots(g);
    m.counts.assign(1, static_cast<int64_t>(lead.row));
    m.counts.insert(m.counts.end(), slots.send_counts.begin(), slots.send_counts.end());
    m.counts.insert(m.counts.end(), slots.receive_counts.begin(), slots.receive_counts.end());
    c.args = m.counts.data(), c.nargs = m.counts.size();
    c.in = m.send.data(), c.out = m.receive.data();
    c.in_count = m.send.size() / c.elem_bytes, c.out_count = m.receive.size() / c.elem_bytes;
    c.name = AlltoallvOp::kName, c.mpi_op = MPI_OP_NULL;
    if (!RowsGoDirect(g)) return lead.Run<AlltoallvOp>("permute");
    // In the packed buffers' order: by rank, then source row.
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
    c.in_count = sends * lead.row, c.out_count = receives * lead.row;
    return lead.Run<AlltoallvOp>(rows, "permute");
  }
  static void Unpack(const Turn& t, size_t out_bytes) {
    const Meeting& g = t.g;
    const int64_t L = g.local, me = static_cast<int64_t>(g.rank) * L + g.part;
    bool sent_to = false;
    for (size_t i = 0; i + 1 < g.pairs.size(); i += 2) {
      if (g.pairs[i + 1] != me) continue;
      sent_to = true;
      if (g.pairs[i] / L == g.rank) continue;  // from a device of this rank, while packing
      if (RowsGoDirect(g)) continue;           // from another rank, by MPI
      std::memcpy(t.c.out,
                  t.m.receive.data() + PermuteSlots::ReceiveSlot(g, g.pairs[i], me) * g.row_bytes,
                  g.row_bytes);
    }
    if (!sent_to) std::memset(t.c.out, 0, out_bytes);  // zeros, as lax.ppermute
  }
};

// bcast: the root participant's row (root rank, root device) into the send
// buffer, one MPI_Bcast from the root's rank; every device copies it out.
struct BcastKind {
  static void Size(LocalMeeting& m, const Meeting& g, size_t) {
    m.send.resize(g.row_bytes), m.receive.clear();
  }
  static ffi::Error Pack(const Turn& t) {
    if (t.g.root == static_cast<int64_t>(t.g.rank) * t.g.local + t.g.part) {
      std::memcpy(t.m.send.data(), t.c.in, t.g.row_bytes);
    }
    return ffi::Error::Success();
  }
  static ffi::Error Lead(const Turn& t) {
    LeadCall lead(t);
    lead.c.in = lead.c.out = t.m.send.data();
    lead.c.in_count = lead.c.out_count = lead.row;
    lead.c.root = static_cast<int>(t.g.root / t.g.local);
    lead.c.name = BcastOp::kName, lead.c.mpi_op = MPI_OP_NULL;
    return lead.Run<BcastOp>("bcast");
  }
  static void Unpack(const Turn& t, size_t out_bytes) {
    std::memcpy(t.c.out, t.m.send.data(), out_bytes);
  }
};

// reduce (bcast's transpose): the local reduction, one MPI_Reduce to the root's
// rank; the root participant takes the sum, the others zeros.
struct ReduceKind {
  static void Size(LocalMeeting& m, const Meeting& g, size_t) {
    m.send.resize(g.row_bytes), m.receive.resize(g.row_bytes);
  }
  static ffi::Error Pack(const Turn& t) {
    return ReduceLocalSlice(t.m, t.c, t.g.part, t.m.send.data());
  }
  static ffi::Error Lead(const Turn& t) {
    LeadCall lead(t);
    lead.c.in = t.m.send.data(), lead.c.out = t.m.receive.data();
    lead.c.in_count = lead.c.out_count = lead.row;
    lead.c.root = static_cast<int>(t.g.root / t.g.local);
    lead.c.name = ReduceOp::kName;
    return lead.Run<ReduceOp>("reduce");
  }
  static void Unpack(const Turn& t, size_t out_bytes) {
    if (t.g.root == static_cast<int64_t>(t.g.rank) * t.g.local + t.g.part) {
      std::memcpy(t.c.out, t.m.receive.data(), out_bytes);
    } else {
      std::memset(t.c.out, 0, out_bytes);
    }
  }
};

// f(Kind{}) for the kind with code `kind` (kinds.def); the code is checked by
// the handler before any call reaches here.
template <typename F>
auto WithKind(int64_t kind, F&& f) {
  switch (kind) {
#define MPICOLL_MEETING_CASE(Enum, Type, name, code, rows_in, reduces) \
  case Enum:                                                                \
    return f(Type{});
    MPICOLL_MEETING_KINDS(MPICOLL_MEETING_CASE)
#undef MPICOLL_MEETING_CASE
  }
  return f(AllreduceKind{});  // unreachable
}

}  // namespace meeting
}  // namespace mpicoll

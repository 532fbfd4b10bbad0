// The algorithms: the MPI calls each collective makes, one chunk at a time
// (equal rank blocks) or on whole buffers (vector collectives, point-to-point),
// on whatever memory the strategy handed over in the Call.  Rows of ops.def
// name these bodies.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "call.h"
#include "dtypes.h"
#include "../watch/guard.h"

namespace mpicoll {

// The collectives, one MPI call per chunk.  Zeroing the output off root
// (reduce, gather) and bcast's copy of its input are done by the memory
// strategy, which knows where the buffers live.

inline int BcastChunk(const Call& c, const Chunk& k) {
  return MPI_Bcast(c.out + k.at(c), k.count, c.type, c.root, c.comm);
}

inline int AllreduceChunk(const Call& c, const Chunk& k) {
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Allreduce(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.comm);
}

inline int ReduceChunk(const Call& c, const Chunk& k) {
  const void* send = (InPlace(c) && c.rank == c.root) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Reduce(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.root, c.comm);
}

inline int GatherChunk(const Call& c, const Chunk& k) {
  RankBlocks out(c, k);
  if (out.rc != MPI_SUCCESS) return out.rc;
  return MPI_Gather(c.in + k.at(c), k.count, c.type, c.out + k.at(c), out.count, out.type,
                    c.root, c.comm);
}

inline int AllgatherChunk(const Call& c, const Chunk& k) {
  RankBlocks out(c, k);
  if (out.rc != MPI_SUCCESS) return out.rc;
  // In place (the local meeting): this rank's block is already at its place in out.
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Allgather(send, k.count, c.type, c.out + k.at(c), out.count, out.type, c.comm);
}

inline int ScatterChunk(const Call& c, const Chunk& k) {
  RankBlocks in(c, k);
  if (in.rc != MPI_SUCCESS) return in.rc;
  return MPI_Scatter(c.in + k.at(c), in.count, in.type, c.out + k.at(c), k.count, c.type, c.root,
                     c.comm);
}

inline int AlltoallChunk(const Call& c, const Chunk& k) {
  RankBlocks blocks(c, k);
  if (blocks.rc != MPI_SUCCESS) return blocks.rc;
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Alltoall(send, blocks.count, blocks.type, c.out + k.at(c), blocks.count, blocks.type,
                      c.comm);
}

// reduce_scatter: rank r gets the reduction of every rank's block r.  Large
// blocks go to mpicoll's own pairwise exchange (below).  A chunk
// that is not the whole block cannot be one MPI_Reduce_scatter_block (one
// datatype serves both buffers, and only the input's blocks are strided), so it
// is reduced rank block by rank block to that rank.
inline int PairwiseReduceScatter(const Call& c, const Chunk& k);
inline bool UsesPairwiseReduceScatter(const Call& c, const Chunk& k);

inline int ReduceScatterChunk(const Call& c, const Chunk& k) {
  if (UsesPairwiseReduceScatter(c, k)) return PairwiseReduceScatter(c, k);
  if (static_cast<size_t>(k.count) == k.block) {
    return MPI_Reduce_scatter_block(c.in, c.out, k.count, c.type, c.mpi_op, c.comm);
  }
  for (int r = 0; r < c.size; ++r) {
    int rc = MPI_Reduce(c.in + (r * k.block + k.offset) * c.elem_bytes, c.out + k.at(c), k.count,
                        c.type, c.mpi_op, r, c.comm);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

// mpicoll's own reduce-scatter for large blocks.  Open MPI 4.1's
// MPI_Reduce_scatter_block reduces the whole buffer to one rank and scatters
// it (64 MiB at 2 ranks: 55-57 ms, against 29-38 ms for a whole in-place
// MPI_Allreduce), so an allreduce written as reduce_scatter + allgather cost
// 2.3x the allreduce.  A pairwise exchange moves the (size - 1)/size of the
// data a reduce-scatter must move, and each rank reduces only its own block:
// in step s = 1 .. size-1, rank r sends its block r+s to rank r+s and receives
// rank r-s's block r, which it reduces into its output with MPI_Reduce_local
// (MPI's own operators, so every op and dtype MPI_Reduce_scatter_block takes,
// the 16-bit and wrapping ones included).  The first step receives straight
// into the output; later ones go through a scratch segment.  Blocks are cut into
// segments so that the received segment is still in cache when it is reduced,
// and the scratch stays small.  All ops are commutative, so the order of the
// operands (which differs between the ranks' blocks) is free.  The messages go
// on the communicator's internal duplicate, never on the user's.
// From 256 KiB blocks: at 2 ranks (Open MPI 4.1, shared memory) the exchange
// took 0.6x MPI_Reduce_scatter_block's time there, 0.2x at 1-32 MiB, and the
// same at 1-16 KiB, where both are dominated by the call; each message is then
// large enough that the size - 1 steps' latencies matter little on any network.
// The segment size made no measurable difference from 256 KiB to whole blocks.
// Both sizes are settable (pairwise_reduce_scatter()) for tests and for
// measuring; every rank must use the same (each decides alone).
inline std::atomic<size_t> pairwise_min_block_bytes{size_t{256} << 10};
inline std::atomic<size_t> pairwise_segment_bytes{size_t{1} << 20};
constexpr int kPairwiseTag = 0;

inline bool UsesPairwiseReduceScatter(const Call& c, const Chunk& k) {
  return c.size > 1 && !c.device_buffers && c.internal_comm != MPI_COMM_NULL &&
         static_cast<size_t>(k.count) * c.elem_bytes >=
             pairwise_min_block_bytes.load(std::memory_order_relaxed);
}

inline int PairwiseReduceScatter(const Call& c, const Chunk& k) {
  const size_t bytes = c.elem_bytes;
  const size_t segment =
      std::max<size_t>(1, pairwise_segment_bytes.load(std::memory_order_relaxed) / bytes);
  const size_t total = static_cast<size_t>(k.count);
  thread_local std::vector<char> scratch;
  if (c.size > 2) scratch.resize(std::min(segment, total) * bytes);
  // Element `at` of chunk k in rank block r of the input.
  auto input = [&](int r, size_t at) { return c.in + (r * k.block + k.offset + at) * bytes; };
  for (size_t at = 0; at < total; at += segment) {
    const int n = static_cast<int>(std::min(segment, total - at));
    char* const out = c.out + (k.offset + at) * bytes;
    for (int step = 1; step < c.size; ++step) {
      const int dest = (c.rank + step) % c.size;
      const int source = (c.rank - step + c.size) % c.size;
      char* const received = step == 1 ? out : scratch.data();
      int rc = MPI_Sendrecv(input(dest, at), n, c.type, dest, kPairwiseTag, received, n, c.type,
                            source, kPairwiseTag, c.internal_comm, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return rc;
      // inout = in op inout: the first step folds in this rank's own block.
      rc = MPI_Reduce_local(step == 1 ? input(c.rank, at) : received, out, n, c.type, c.mpi_op);
      if (rc != MPI_SUCCESS) return rc;
    }
  }
  return MPI_SUCCESS;
}

inline int ScanChunk(const Call& c, const Chunk& k) {
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Scan(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.comm);
}

// MPI leaves rank 0's result undefined; the memory strategy zeroes it.
inline int ExscanChunk(const Call& c, const Chunk& k) {
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Exscan(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.comm);
}

inline int Barrier(const Call& c) { return MPI_Barrier(c.comm); }

// ---------------------------------------------------------------------------
// Beyond equal rank blocks: variable-size collectives (counts per rank) and
// point-to-point.  Each makes one MPI call for the whole buffers (no chunks),
// with what Python passes in `args`:
//   vector ops      [row elements, counts per rank (in rows)...]; alltoallv:
//                   [row elements, send counts..., recv counts...]
//   point-to-point  [source, dest, send tag, recv tag]
// (A body's own check that fails returns kCheckFailed with c.failure set.)

// `count` elements as one MPI call's (type, count): the element type up to
// INT_MAX elements, above that one element of a struct type (2^30-element
// blocks and the rest).
struct Message {
  MPI_Datatype type;
  int count;
  int rc = MPI_SUCCESS;
  MPI_Datatype parts_[2] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};
  Message(const Call& c, size_t elements) : type(c.type), count(static_cast<int>(elements)) {
    if (elements <= static_cast<size_t>(INT_MAX)) return;
    const size_t blocks = elements / kMaxChunk, rest = elements % kMaxChunk;
    rc = MPI_Type_contiguous(static_cast<int>(kMaxChunk), c.type, &parts_[0]);
    int lengths[2] = {static_cast<int>(blocks), static_cast<int>(rest)};
    MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(blocks * kMaxChunk * c.elem_bytes)};
    MPI_Datatype types[2] = {parts_[0], c.type};
    if (rc == MPI_SUCCESS) rc = MPI_Type_create_struct(2, lengths, displacements, types, &parts_[1]);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&parts_[1]);
    type = parts_[1];
    count = 1;
  }
  ~Message() {
    for (MPI_Datatype& t : parts_) {
      if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
    }
  }
};

// One row of the leading axis as an MPI type (counts are in rows).
struct RowType {
  MPI_Datatype type;
  int rc = MPI_SUCCESS;
  MPI_Datatype made_ = MPI_DATATYPE_NULL;
  explicit RowType(const Call& c) : type(c.type) {
    const size_t row = static_cast<size_t>(c.args[0]);
    if (row == 1) return;
    Message whole(c, row);
    rc = whole.rc;
    if (rc == MPI_SUCCESS) rc = MPI_Type_contiguous(whole.count, whole.type, &made_);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&made_);
    type = made_;
  }
  ~RowType() {
    if (made_ != MPI_DATATYPE_NULL) MPI_Type_free(&made_);
  }
};

// Counts per rank and their displacements, as MPI's int vectors (Python keeps
// the totals within INT_MAX rows).
struct RankCounts {
  std::vector<int> counts, displacements;
  RankCounts(const int64_t* values, int size) : counts(size), displacements(size) {
    int64_t at = 0;
    for (int r = 0; r < size; ++r) {
      counts[r] = static_cast<int>(values[r]);
      displacements[r] = static_cast<int>(at);
      at += values[r];
    }
  }
};

inline int GathervWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts rows(c.args + 1, c.size);
  return MPI_Gatherv(c.in, rows.counts[c.rank], row.type, c.out, rows.counts.data(),
                     rows.displacements.data(), row.type, c.root, c.comm);
}

inline int AllgathervWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts rows(c.args + 1, c.size);
  return MPI_Allgatherv(c.in, rows.counts[c.rank], row.type, c.out, rows.counts.data(),
                        rows.displacements.data(), row.type, c.comm);
}

inline int ScattervWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts rows(c.args + 1, c.size);
  return MPI_Scatterv(c.in, rows.counts.data(), rows.displacements.data(), row.type, c.out,
                      rows.counts[c.rank], row.type, c.root, c.comm);
}

// A rank's rows to itself are copied here, not sent: MPICH moves them through
// its transport like any message (2 ranks, one 2 MiB row each way plus one to
// itself: 22 ms over TCP between simulated hosts, 1.6 ms with the copy here; in
// shared memory 0.53-0.77 ms against 0.23 ms).  Unequal counts (a user error)
// and device buffers stay with MPI, which reports or handles them.
inline int AlltoallvWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts sends(c.args + 1, c.size), receives(c.args + 1 + c.size, c.size);
  const int self = c.rank;
  if (!c.device_buffers && sends.counts[self] == receives.counts[self] && sends.counts[self]) {
    const size_t row_bytes = static_cast<size_t>(c.args[0]) * c.elem_bytes;
    std::memmove(static_cast<char*>(c.out) + receives.displacements[self] * row_bytes,
                 static_cast<const char*>(c.in) + sends.displacements[self] * row_bytes,
                 sends.counts[self] * row_bytes);
    sends.counts[self] = receives.counts[self] = 0;
  }
  return MPI_Alltoallv(c.in, sends.counts.data(), sends.displacements.data(), row.type, c.out,
                       receives.counts.data(), receives.displacements.data(), row.type, c.comm);
}

// Point-to-point.  Each body records the source and tag it received from.
struct Peers {
  int source, dest, send_tag, recv_tag;
  explicit Peers(const Call& c)
      : source(static_cast<int>(c.args[0])), dest(static_cast<int>(c.args[1])),
        send_tag(static_cast<int>(c.args[2])), recv_tag(static_cast<int>(c.args[3])) {}
};

// Checks for point-to-point: a communicator-wide fingerprint does not apply
// (only two ranks take part), so with every-call checks each message is
// preceded by a header with the sender's dtype and element count, which the
// receiver compares with its own.  (First-run checks leave messages alone: a
// sender's and a receiver's call sites need not run equally often, so they
// could not agree on which messages carry a header.)
struct Header {
  int64_t bytes;
  char description[120];
};

inline Header HeaderFor(const Call& c, size_t elements) {
  Header h{static_cast<int64_t>(elements * c.elem_bytes), {}};
  std::snprintf(h.description, sizeof(h.description), "%s[%zu]", DtypeName(c.dtype), elements);
  return h;
}

// After a header mismatch: consume the message into scratch memory (so its
// sender completes), and say what differed.
inline int HeaderMismatch(const Call& c, const Header& theirs, const Header& mine, int source, int tag,
                   const void* send, const Message* outgoing, int dest) {
  std::vector<char> scratch(static_cast<size_t>(theirs.bytes));
  MPI_Status status;
  const int rc = outgoing == nullptr
      ? MPI_Recv(scratch.data(), static_cast<int>(theirs.bytes), MPI_BYTE, source, tag, c.comm,
                 &status)
      : MPI_Sendrecv(send, outgoing->count, outgoing->type, dest, Peers(c).send_tag,
                     scratch.data(), static_cast<int>(theirs.bytes), MPI_BYTE, source, tag,
                     c.comm, &status);
  if (rc != MPI_SUCCESS) return rc;
  c.failure = std::string("mpicoll check mode: ") + c.name + " on rank " +
              std::to_string(c.rank) + " of " + CommName(c.comm) + " received " +
              theirs.description + " from rank " + std::to_string(source) + " (tag " +
              std::to_string(tag) + ") into " + mine.description;
  return kCheckFailed;
}

// The source and tag received from; a message shorter than the buffer fails
// (MPI itself fails a longer one: MPI_ERR_TRUNCATE).
inline int Received(const Call& c, const MPI_Status& status, const Message& expected) {
  c.status[0] = status.MPI_SOURCE;
  c.status[1] = status.MPI_TAG;
  if (status.MPI_SOURCE == MPI_PROC_NULL) return MPI_SUCCESS;
  int count = 0;
  if (MPI_Get_count(&status, expected.type, &count) == MPI_SUCCESS && count == expected.count) {
    return MPI_SUCCESS;
  }
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  c.failure = std::string("mpicoll.") + c.name + " on rank " + std::to_string(c.rank) + " of " +
              CommName(c.comm) + ": received " + std::to_string(bytes) + " bytes from rank " +
              std::to_string(status.MPI_SOURCE) + " (tag " + std::to_string(status.MPI_TAG) +
              "), but the buffer holds " + std::to_string(c.out_count * c.elem_bytes) +
              " (the sender's array is smaller)";
  return kCheckFailed;
}

inline int SendWhole(const Call& c, const Chunk&) {
  const Peers p(c);
  Message outgoing(c, c.in_count);
  if (outgoing.rc != MPI_SUCCESS) return outgoing.rc;
  c.status[0] = p.dest;
  c.status[1] = p.send_tag;
  if (watch_settings.check_mode.load(std::memory_order_relaxed) == kCheckEveryCall) {
    Header mine = HeaderFor(c, c.in_count);
    int rc = MPI_Send(&mine, sizeof(Header), MPI_BYTE, p.dest, p.send_tag, c.comm);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_Send(c.in, outgoing.count, outgoing.type, p.dest, p.send_tag, c.comm);
}

// Receives (and, with `outgoing`, sends in the same call: sendrecv).
inline int ReceiveWhole(const Call& c, const Message* outgoing) {
  const Peers p(c);
  Message incoming(c, c.out_count);
  if (incoming.rc != MPI_SUCCESS) return incoming.rc;
  int source = p.source, tag = p.recv_tag;
  MPI_Status status;
  if (watch_settings.check_mode.load(std::memory_order_relaxed) == kCheckEveryCall) {
    // The header fixes the source and tag, so that the data that follows comes
    // from the same message pair even with ANY_SOURCE/ANY_TAG.
    const Header mine = HeaderFor(c, c.out_count), sent = HeaderFor(c, c.in_count);
    Header theirs{};
    int rc = outgoing == nullptr
        ? MPI_Recv(&theirs, sizeof(Header), MPI_BYTE, source, tag, c.comm, &status)
        : MPI_Sendrecv(&sent, sizeof(Header), MPI_BYTE, p.dest, p.send_tag, &theirs,
                       sizeof(Header), MPI_BYTE, source, tag, c.comm, &status);
    if (rc != MPI_SUCCESS) return rc;
    if (status.MPI_SOURCE != MPI_PROC_NULL) {
      source = status.MPI_SOURCE;
      tag = status.MPI_TAG;
      theirs.description[sizeof(theirs.description) - 1] = '\0';
      if (theirs.bytes != mine.bytes || std::strcmp(theirs.description, mine.description) != 0) {
        return HeaderMismatch(c, theirs, mine, source, tag, c.in, outgoing, p.dest);
      }
    }
  }
  const int rc = outgoing == nullptr
      ? MPI_Recv(c.out, incoming.count, incoming.type, source, tag, c.comm, &status)
      : MPI_Sendrecv(c.in, outgoing->count, outgoing->type, p.dest, p.send_tag, c.out,
                     incoming.count, incoming.type, source, tag, c.comm, &status);
  if (rc != MPI_SUCCESS) return rc;
  return Received(c, status, incoming);
}

inline int RecvWhole(const Call& c, const Chunk&) { return ReceiveWhole(c, nullptr); }

inline int SendrecvWhole(const Call& c, const Chunk&) {
  Message outgoing(c, c.in_count);
  if (outgoing.rc != MPI_SUCCESS) return outgoing.rc;
  return ReceiveWhole(c, &outgoing);
}

// ---------------------------------------------------------------------------
// Before an overlapped collective moves data, it waits until every rank of
// the communicator has reached it, testing an MPI_Ibarrier and sleeping in
// between.  MPI's blocking calls spin while they wait for a late rank, and
// that spinning would take a core from the computation that runs meanwhile on
// this rank (on a machine with no spare core, the case where overlap matters
// most).  Once everyone is there the collective itself runs at full speed.
// Costs one barrier per overlapped call, and up to one sleep (kArrivalSleepUs)
// of latency after the last rank arrives.
//
// The barrier may be started by one thread and finished by another: XLA's
// thread starts it and tests it for a moment (a call that runs here once every
// rank has arrived, entries/cpu.cc), the device's progress thread waits for
// the rest.
constexpr int64_t kArrivalSpinNs = 20000;
// How long XLA's thread tests whether every rank has arrived before it hands a
// call that may run there to the progress thread (a sharded array's per-device
// call, entries/cpu.cc; a local meeting's turn, meeting/meeting.cc, which also
// bounds each wait for this process's other devices by it).  Any bound keeps
// the argument (docs/design.md, "Ranks x devices"); this one is long enough for
// the skew of a balanced job on a machine with no spare core (2 ranks x 2
// devices on 2 cores, 4 MiB sharded allreduces: 30% of calls handed off at
// 100 us, 9% at 1 ms), and the test yields, so the late rank's threads get the
// core meanwhile.
constexpr int64_t kArrivedHereNs = 1000000;
constexpr int kArrivalSleepUs = 50;

class Arrival {
 public:
  // Starts the barrier (with one rank, everyone has arrived).
  void Start(const Call& c) {
    if (c.size > 1) rc_ = MPI_Ibarrier(c.comm, &request_);
    done_ = c.size == 1 || rc_ != MPI_SUCCESS;
  }

  // Tests for up to spin_ns: whether every rank has arrived (or the barrier failed).
  bool Within(int64_t spin_ns) {
    const int64_t until = NowNs() + spin_ns;
    while (!done_) {
      Test();
      if (done_ || NowNs() > until) break;
      // Let a thread that has work run first: on a machine with no spare core
      // it may be the very thread a late rank, or another local device, waits for.
      std::this_thread::yield();
    }
    return done_;
  }

  // Returns once every rank has arrived: spins kArrivalSpinNs, then sleeps between tests.
  int Wait() {
    Within(kArrivalSpinNs);
    while (!done_) {
      std::this_thread::sleep_for(std::chrono::microseconds(kArrivalSleepUs));
      Test();
    }
    return rc_;
  }

 private:
  void Test() {
    int flag = 0;
    rc_ = MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    done_ = flag || rc_ != MPI_SUCCESS;
  }

  MPI_Request request_ = MPI_REQUEST_NULL;
  int rc_ = MPI_SUCCESS;
  bool done_ = false;
};

inline int WaitForArrivals(const Call& c) {
  Arrival arrival;
  arrival.Start(c);
  return arrival.Wait();
}

}  // namespace mpicoll

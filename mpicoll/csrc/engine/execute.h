// Running a collective: decode the call (Prepare), guard it (check mode,
// timeout, serialized lock, the device's queued overlapped calls), and run
// the one chunk loop over a memory strategy (RunCollective).
//
// Every data collective has the same FFI signature, (token, x) -> (token, out)
// plus the attributes comm/root/op, so one binding serves them all
// (entries/entries.h).  Each collective is a row of facts and a short chunk
// body (ops.def); one loop (RunCollective) runs any of them over any memory
// strategy: XLA's host buffers on CPU (memory/host.h), and on GPUs either
// device pointers handed to a CUDA-aware MPI (memory/cuda_aware.h) or pinned
// host staging with a copy pipeline (memory/staged.h).  Errors travel one
// path: a failed MPI call becomes an ffi::Error naming the op, the MPI error
// string, the rank and the communicator, raised in Python as a runtime error.
//
// Counts above INT_MAX elements are handled by chunking: each MPI call moves
// one element range of every rank block, with a datatype whose extent is the
// whole block where a buffer has several blocks.  The GPU pipeline uses the
// same chunks.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "algorithms.h"
#include "call.h"
#include "collectives.h"
#include "comm_table.h"
#include "dtypes.h"
#include "../watch/guard.h"
#include "progress.h"
#include "reduce_ops.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// Overlap (progress.h): overlapped calls run on one progress thread per local
// device, in the order their handlers were invoked; synchronous calls drain it
// first.
// Never destroyed: a progress thread may still wait on its queue's condition
// variable when static destructors run at exit, and destroying it under the
// thread hangs the exit.
inline mpicoll_progress::ProgressThread* const progress_threads =
    new mpicoll_progress::ProgressThread[kMaxLocalDevices];

// What Execute runs between the check and the collective (overlapped calls:
// WaitForArrivals).
struct NothingBeforeRun {
  int operator()(const Call&) const { return MPI_SUCCESS; }
};

// Check mode for alltoallv, whose counts are each rank's own: rank j's send
// count to rank r must be rank r's receive count from j.  Every rank learns
// whether any pair disagrees, so all of them fail together.
inline int VerifyPairCounts(const Call& c) {
  std::vector<int64_t> incoming(c.size);
  // On the checks' communicator, like every check (watch/check.h's CheckComm).
  const MPI_Comm comm = c.internal_comm != MPI_COMM_NULL ? c.internal_comm : c.comm;
  int rc = MPI_Alltoall(c.args + 1, 1, MPI_INT64_T, incoming.data(), 1, MPI_INT64_T, comm);
  int wrong = -1;
  for (int j = 0; rc == MPI_SUCCESS && j < c.size && wrong < 0; ++j) {
    if (incoming[j] != c.args[1 + c.size + j]) wrong = j;
  }
  int any = wrong >= 0;
  if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, comm);
  if (rc != MPI_SUCCESS || !any) return rc;
  c.failure = std::string("mpicoll check mode: ") + c.name + " counts disagree on " +
              CommName(c.comm) + " (this is rank " + std::to_string(c.rank) + "): " +
              (wrong < 0 ? std::string("between other ranks (see their errors)")
                         : "rank " + std::to_string(wrong) + " sends " +
                               std::to_string(incoming[wrong]) + " rows here, but recv_counts[" +
                               std::to_string(wrong) + "] = " +
                               std::to_string(c.args[1 + c.size + wrong]));
  return kCheckFailed;
}

// The check before a call (see CheckMode and CheckSameCall).  Point-to-point
// ops take no part (only two ranks of the communicator are in a message):
// with every-call checks their bodies check each message instead.  alltoallv
// also compares its counts pairwise.
template <typename Op>
ffi::Error CheckCall(const Call& c, int32_t device, const CheckPlan& plan,
                     const InFlightScope& watched) {
  if constexpr (Op::kFamily == kPeer) return ffi::Error::Success();
  if (!plan.check) return ffi::Error::Success();
  if (ffi::Error err = CheckSameCall(c, device, plan, watched); err.failure()) return err;
  if constexpr (Op::kFamily == kVectorPairs) {
    if (int rc = VerifyPairCounts(c); rc == kCheckFailed) {
      return ffi::Error::Internal(c.failure);
    } else if (rc != MPI_SUCCESS) {
      return MpiFailure(c, rc);
    }
  }
  return ffi::Error::Success();
}

// Every-call checks of a small allreduce on host memory carry its data: the
// check's records (watch/check.h) hold every rank's block, and each rank reduces them
// in rank order with MPI's own operators (MPI_Reduce_local), so the check is
// the collective: no second MPI call per call (a jitted loop of 4-byte
// allreduces, MPICH, 2 ranks: 1.0-1.1x the unchecked loop, against 2.5x as two
// collectives; docs/failures.md).  Every rank reduces in the same order,
// so every rank gets the same bits.  A rank whose block does not fit a record
// checks the usual way, and its record meets the others' alike.
template <typename Memory, typename = void>
struct HostBuffersOf : std::false_type {};
template <typename Memory>  // a strategy whose buffers are MPI's host memory says so
struct HostBuffersOf<Memory, std::void_t<decltype(Memory::kHostBuffers)>>
    : std::bool_constant<Memory::kHostBuffers> {};

template <typename Op, typename Memory, typename BeforeRun>
bool ChecksWithData(const Call& c, const CheckPlan& plan) {
  if constexpr (!kEveryRankGetsTheReduction<Op> || !HostBuffersOf<Memory>::value ||
                !std::is_same_v<std::decay_t<BeforeRun>, NothingBeforeRun>) {
    return false;
  } else {
    return plan.check &&
           watch_settings.check_mode.load(std::memory_order_relaxed) == kCheckEveryCall &&
           !c.device_buffers && c.in_count > 0 &&
           16 + c.in_count * c.elem_bytes <= CheckRecordBytes(c.size);
  }
}

inline ffi::Error AllreduceCheckedWithData(Call& c, int32_t device, const CheckPlan& plan,
                                           const InFlightScope& watched) {
  const size_t bytes = c.in_count * c.elem_bytes, stride = CheckRecordBytes(c.size);
  thread_local std::vector<char> records;  // per device thread
  watched.slot->phase.store(kPhaseChecking, std::memory_order_relaxed);
  const std::string mismatch = CompareAcrossRanks(
      CheckComm(c), CommName(c.comm), c.rank, c.size, Fingerprint(plan, watched),
      [&] { return CheckedCallText(c, plan, watched); }, c.in, bytes, &records);
  PauseAfterMismatchForTests(mismatch);
  watched.slot->phase.store(kPhaseRunning, std::memory_order_relaxed);
  watched.counter->checked.store(watched.sequence, std::memory_order_relaxed);
  if (!mismatch.empty()) return ffi::Error::Internal(mismatch);
  MarkAgreed(c, device, plan.facts);
  std::memcpy(c.out, records.data() + 16, bytes);
  int rc = MPI_SUCCESS;
  for (int r = 1; r < c.size && rc == MPI_SUCCESS; ++r) {
    rc = MPI_Reduce_local(records.data() + r * stride + 16, c.out, static_cast<int>(c.in_count),
                          c.type, c.mpi_op);
  }
  if (rc != MPI_SUCCESS) return MpiFailure(c, rc);
  NormalizeLogical<AllreduceOp>(c, Chunk{0, static_cast<int>(c.in_count), c.in_count});
  return ffi::Error::Success();
}

// The call's communicator, root, op and MPI types, from the attributes and dtype.
template <typename Op>
ffi::Error Prepare(Call& c, int32_t device, int64_t comm_slot, int64_t root, int64_t op,
                   int64_t site, ffi::DataType dtype) {
  c.name = Op::kName;
  c.site = site;
  if (ffi::Error err = Resolve(c, device, comm_slot); err.failure()) return err;
  c.root = static_cast<int>(root);
  c.op = op;
  c.type = MpiType(dtype);
  c.mpi_op = Op::kReduces ? ReductionOp(dtype, op) : MPI_OP_NULL;
  if (c.type == MPI_DATATYPE_NULL || (Op::kReduces && c.mpi_op == MPI_OP_NULL)) {
    // Python validates dtype and op first; this guards direct misuse.
    return ffi::Error::InvalidArgument(std::string("mpicoll.") + Op::kName +
                                       ": unsupported dtype/op");
  }
  c.elem_bytes = ffi::ByteWidth(dtype);
  c.dtype = dtype;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Memory strategies.  One implementation of each collective serves every
// platform and transport; a strategy says where the bytes MPI touches live
// and moves them there:
//   Begin<Op>(c)          before the first chunk (may point c.in/c.out at
//                         staging buffers)
//   ChunkElements(c, b)   elements of each block per MPI call
//   BeforeChunk(c, k)     chunk k's input must be in c.in when it returns
//   AfterChunk(c, k)      chunk k's output in c.out is final
//   Finish<Op>(c, ok)     after the last chunk: zeros off root, hand-back
// Each returns an MPI code, or kTransportFailed with `error` set.  A strategy
// with kCallsMpi false does the whole collective in Begin.
// The strategies are in memory/: host.h (XLA's CPU buffers, or any host
// buffers, are MPI's), staged.h (GPU data through pinned host buffers, in a
// copy pipeline), cuda_aware.h (device pointers to a CUDA-aware MPI).

// The one loop every collective runs, on any memory.
template <typename Op, typename Memory>
int RunCollective(Call& c, Memory& memory) {
  int rc = memory.template Begin<Op>(c);
  if constexpr (!Memory::kCallsMpi) return rc;  // the strategy did all of it
  const size_t block = BlockElements<Op>(c);
  if constexpr (!Op::kChunked) {  // one MPI call on the whole buffers
    const Chunk whole{0, 0, block};
    if (rc == MPI_SUCCESS) rc = memory.BeforeChunk(c, whole);
    if (rc == MPI_SUCCESS) rc = Op::Run(c, whole);
    if (rc == MPI_SUCCESS) rc = memory.AfterChunk(c, whole);
    const int finished = memory.template Finish<Op>(c, rc == MPI_SUCCESS);
    return rc == MPI_SUCCESS ? finished : rc;
  }
  const size_t step = std::max<size_t>(1, std::min(memory.ChunkElements(c, block), kMaxChunk));
  for (size_t offset = 0; rc == MPI_SUCCESS && offset < block; offset += step) {
    const Chunk k{offset, static_cast<int>(std::min(step, block - offset)), block};
    rc = memory.BeforeChunk(c, k);
    if (rc == MPI_SUCCESS) rc = Op::Run(c, k);
    if (rc == MPI_SUCCESS && Op::kReduces) NormalizeLogical<Op>(c, k);
    if (rc == MPI_SUCCESS) rc = memory.AfterChunk(c, k);
  }
  const int finished = memory.template Finish<Op>(c, rc == MPI_SUCCESS);
  return rc == MPI_SUCCESS ? finished : rc;
}

// The MPI part, once c's buffers are set: watched by the timeout, checked
// across ranks in check mode (`describe()` says what this rank calls).
// A synchronous call first lets the device's queued overlapped calls finish
// (they come earlier in program order), then takes the serialized mode's lock
// (where MPI is not MPI_THREAD_MULTIPLE: one MPI call at a time in the process).

template <typename Op, typename Memory, typename Describe, typename BeforeRun = NothingBeforeRun>
ffi::Error Execute(Call& c, int32_t device, Memory& memory, Describe&& describe,
                   BeforeRun&& before_run = {}) {
  progress_threads[device].Drain();
  SerializedMpiScope serialized;
  CheckPlan plan = PlanCheck(c, device, describe);
  if constexpr (Op::kFamily == kPeer) plan.check = false;
  InFlightScope watched(c, device, /*new_call=*/true, c.queued_ns, plan.facts,
                        /*collective=*/Op::kFamily != kPeer);
  ffi::Error result = [&] {
    if (ChecksWithData<Op, Memory, BeforeRun>(c, plan)) {
      return AllreduceCheckedWithData(c, device, plan, watched);
    }
    if (ffi::Error err = CheckCall<Op>(c, device, plan, watched); err.failure()) return err;
    // Rank blocks have the same shapes on every rank, so an empty array skips MPI
    // on every rank (counts and messages may be empty on one rank only).
    if (Op::kFamily == kBlocks && c.in_count == 0 && c.out_count == 0) {
      return ffi::Error::Success();
    }
    if (int rc = before_run(c); rc != MPI_SUCCESS) return MpiFailure(c, rc);
    const int rc = RunCollective<Op>(c, memory);
    if (rc == kCheckFailed) return ffi::Error::Internal(c.failure);
    if (rc == kTransportFailed) {
      return ffi::Error::Internal(std::string("mpicoll.") + c.name + " on rank " +
                                  std::to_string(c.rank) + ": " + memory.error);
    }
    if (rc != MPI_SUCCESS) return MpiFailure(c, rc);
    return ffi::Error::Success();
  }();
  watched.failed = result.failure();
  return result;
}

template <typename Op>
ffi::Error PrepareArray(Call& c, ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& out,
                        int32_t device, int64_t comm_slot, int64_t root, int64_t op,
                        int64_t site, ffi::Span<const int64_t> args) {
  if (ffi::Error err = Prepare<Op>(c, device, comm_slot, root, op, site, x.element_type());
      err.failure()) {
    return err;
  }
  // Python always passes what the family needs; this guards direct misuse.
  const size_t needed = Op::kFamily == kPeer ? 4
                        : Op::kFamily == kVector ? 1 + static_cast<size_t>(c.size)
                        : Op::kFamily == kVectorPairs ? 1 + 2 * static_cast<size_t>(c.size)
                        : 0;
  if (args.size() != needed) {
    return ffi::Error::InvalidArgument(std::string("mpicoll.") + Op::kName + ": expected " +
                                       std::to_string(needed) + " args, got " +
                                       std::to_string(args.size()));
  }
  c.args = args.begin();
  c.nargs = args.size();
  c.in = static_cast<char*>(x.untyped_data());
  c.out = static_cast<char*>(out->untyped_data());
  c.in_count = x.element_count();
  c.out_count = out->element_count();
  c.dims = x.dimensions().begin();
  c.ndims = static_cast<int>(x.dimensions().size());
  return ffi::Error::Success();
}

// Vector ops: the leading axis is this rank's count (it differs between
// ranks), so the description has the row shape and, where they are the same
// on every rank, the counts.
template <typename Op>
std::string DescribeShape(const Call& c, ffi::DataType dtype, ffi::Span<const int64_t> dims) {
  if constexpr (Op::kFamily == kVector || Op::kFamily == kVectorPairs) {
    std::string text = Describe(c, dtype, dims.last(dims.size() - 1), Op::kReduces,
                                Op::kRooted);
    text.insert(text.find('[') + 1, dims.size() > 1 ? "*," : "*");
    if constexpr (Op::kFamily == kVector) {
      text.pop_back();
      text += ", counts=(";
      for (size_t r = 1; r < c.nargs; ++r) text += (r > 1 ? "," : "") + std::to_string(c.args[r]);
      text += "))";
    }
    return text;
  }
  return Describe(c, dtype, dims, Op::kReduces, Op::kRooted);
}

template <typename Op>
std::string DescribeArray(const Call& c, const ffi::AnyBuffer& x) {
  return DescribeShape<Op>(c, x.element_type(), x.dimensions());
}

// The source and tag each local device's last point-to-point call received
// from (send: its dest and tag), read by the status handler that follows it in
// program order.
inline int32_t last_status[kMaxLocalDevices][2];

template <typename Op>
void RecordStatus(const Call& c, int32_t device) {
  if constexpr (Op::kFamily == kPeer) {
    last_status[device][0] = c.status[0];
    last_status[device][1] = c.status[1];
  }
}

}  // namespace mpicoll

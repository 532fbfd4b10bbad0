// The CPU entry points: XLA's host buffers are MPI's (HostMemory), one
// handler per collective and kind (data, fused, overlapped), instantiated
// from ops.def; the barrier, which every platform shares; the registrations.
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../engine/algorithms.h"
#include "../engine/call.h"
#include "../engine/collectives.h"
#include "../engine/comm_table.h"
#include "../engine/execute.h"
#include "../watch/guard.h"
#include "../memory/host.h"
#include "../ops.def"
#include "entries.h"
#include "fused.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
namespace {

template <typename Op>
ffi::Error CpuEntry(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> out, int32_t device, int64_t comm_slot,
                    int64_t root, int64_t op, int64_t site, ffi::Span<const int64_t> args) {
  Call c{};
  if (ffi::Error err = PrepareArray<Op>(c, x, out, device, comm_slot, root, op, site, args);
      err.failure()) {
    return err;
  }
  HostMemory memory;
  ffi::Error err = Execute<Op>(c, device, memory, [&] { return DescribeArray<Op>(c, x); });
  if (err.success()) RecordStatus<Op>(c, device);
  return err;
}

ffi::Error CpuStatusEntry(ffi::Token, ffi::Result<ffi::Token>,
                          ffi::Result<ffi::Buffer<ffi::S32>> out, int32_t device) {
  if (device < 0 || device >= kMaxLocalDevices || out->element_count() != 2) {
    return ffi::Error::InvalidArgument("mpicoll status: bad device or output shape");
  }
  progress_threads[device].Drain();  // an overlapped recv writes last_status
  std::memcpy(out->typed_data(), last_status[device], sizeof(last_status[device]));
  return ffi::Error::Success();
}

template <typename Op>
ffi::Error CpuFusedEntry(ffi::Token, ffi::RemainingArgs xs, ffi::Result<ffi::Token>,
                         ffi::RemainingRets outs, int32_t device, int64_t comm_slot, int64_t root,
                         int64_t op, int64_t site) {
  Call c{};
  thread_local FusedArrays arrays;
  if (ffi::Error err = PrepareFused<Op>(c, arrays, xs, outs, device, comm_slot, root, op, site);
      err.failure()) {
    return err;
  }
  thread_local std::vector<char> packed_in, packed_out;
  return RunFused<Op>(c, arrays, packed_in, packed_out, device, "");
}

// ---------------------------------------------------------------------------
// Overlapped handlers (see progress.h): the same calls, run on the device's
// progress thread while XLA goes on with work that does not need the result.
// The handler decodes the call on XLA's thread (a freed communicator fails at
// once), copies what the job needs out of XLA's call frame, which does not
// outlive the handler, queues the job and returns a future the job completes.
// XLA keeps the buffers alive, and runs nothing that reads the output or the
// token, until then.  The check's description says "overlapped", so ranks
// that disagree on overlapping a call get the mismatch error, not a hang.
constexpr const char* kOverlappedSuffix = ", overlapped";


// Point-to-point calls have only two ranks in a message: no barrier over the
// communicator before them.
template <typename Op>
struct ArrivalWait {
  int operator()(const Call& c) const {
    if constexpr (Op::kFamily == kPeer) return MPI_SUCCESS;
    return WaitForArrivals(c);
  }
};

// The arrival barrier XLA's thread started, finished where the call runs.
struct FinishArrival {
  std::shared_ptr<Arrival> arrival;
  int operator()(const Call&) const { return arrival->Wait(); }
};

// Runs a prepared overlapped call: run(before_run) executes it, before_run
// waiting for the other ranks' arrival.
//
// here_once_arrived = 0 (mpicoll.overlap()): always queued on the progress
// thread, which waits for every rank and then runs it.
//
// here_once_arrived = 1 (each device's call on its shard of a sharded array,
// where the point is that no XLA thread waits for a rank, not overlap): XLA's
// thread starts the arrival barrier and tests it for up to kArrivedHereNs.
// If every rank has arrived, it runs the call itself: each peer is inside the
// same call and moves its data at once, waiting on nothing of XLA's, so this
// thread waits for the transfer only.  Otherwise the progress thread finishes
// the wait and runs it, as for a queued call.  Either way no XLA thread waits
// for a rank that has not arrived (docs/design.md, "Ranks x devices"), and a
// balanced job pays no hop to the progress thread.
//
// Queued whole instead: a call while the device's queue holds an earlier call
// (it must not overtake it on the communicator: the queue's order is the MPI
// order); a call that first compares itself across ranks (check mode: the
// check meets before any barrier, so ranks that disagree get the mismatch
// error); point-to-point calls (no barrier); and any call where MPI runs
// serialized (one device per process, so no sharded arrays: the lock would be
// held through the test).
template <typename Op, typename Describe, typename Run>
ffi::Future RunOverlapped(const Call& c, int32_t device, int64_t here_once_arrived,
                          Describe&& describe, Run run) {
  if (!here_once_arrived || Op::kFamily == kPeer || progress_threads[device].Pending() != 0 ||
      serialized_mpi.on.load(std::memory_order_relaxed) ||
      PlanCheck(c, device, describe).check) {
    return Overlap(device, [run]() mutable { return run(ArrivalWait<Op>{}); });
  }
  auto arrival = std::make_shared<Arrival>();
  arrival->Start(c);
  if (arrival->Within(kArrivedHereNs)) return CompletedFuture(run(FinishArrival{arrival}));
  return Overlap(device, [run, arrival]() mutable { return run(FinishArrival{arrival}); });
}

struct OverlappedArray {
  Call c{};
  std::vector<int64_t> args, dims;
  ffi::DataType dtype;

  template <typename Op>
  std::string Describe() const {
    return DescribeShape<Op>(c, dtype, dims) + kOverlappedSuffix;
  }
};

template <typename Op>
ffi::Future CpuOverlappedEntry(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                               ffi::Result<ffi::AnyBuffer> out, int32_t device,
                               int64_t comm_slot, int64_t root, int64_t op, int64_t site,
                               ffi::Span<const int64_t> args, int64_t here_once_arrived) {
  auto call = std::make_shared<OverlappedArray>();
  if (ffi::Error err =
          PrepareArray<Op>(call->c, x, out, device, comm_slot, root, op, site, args);
      err.failure()) {
    return CompletedFuture(err);
  }
  call->args.assign(args.begin(), args.end());
  call->c.args = call->args.data();
  call->dims.assign(x.dimensions().begin(), x.dimensions().end());
  call->c.dims = call->dims.data();  // x's own dims are gone when the call runs
  call->c.queued_ns = Recording() ? NowNs() : 0;
  call->dtype = x.element_type();
  return RunOverlapped<Op>(
      call->c, device, here_once_arrived, [&] { return call->template Describe<Op>(); },
      [call, device](auto before_run) {
        HostMemory memory;
        ffi::Error err = Execute<Op>(
            call->c, device, memory, [&] { return call->template Describe<Op>(); }, before_run);
        if (err.success()) RecordStatus<Op>(call->c, device);
        return err;
      });
}

// A fused call packs into buffers of its own (the synchronous path's are per
// thread, and several overlapped calls may be queued at once).
struct OverlappedFused {
  Call c{};
  FusedArrays arrays;
  std::vector<char> packed_in, packed_out;
};

template <typename Op>
ffi::Future CpuOverlappedFusedEntry(ffi::Token, ffi::RemainingArgs xs, ffi::Result<ffi::Token>,
                                    ffi::RemainingRets outs, int32_t device, int64_t comm_slot,
                                    int64_t root, int64_t op, int64_t site,
                                    int64_t here_once_arrived) {
  auto call = std::make_shared<OverlappedFused>();
  if (ffi::Error err =
          PrepareFused<Op>(call->c, call->arrays, xs, outs, device, comm_slot, root, op, site);
      err.failure()) {
    return CompletedFuture(err);
  }
  call->c.queued_ns = Recording() ? NowNs() : 0;
  return RunOverlapped<Op>(
      call->c, device, here_once_arrived,
      [&] {
        return DescribeFused<Op>(call->c, call->arrays.in.size(), call->c.dtype) +
               kOverlappedSuffix;
      },
      [call, device](auto before_run) {
        return RunFused<Op>(call->c, call->arrays, call->packed_in, call->packed_out, device,
                            kOverlappedSuffix, before_run);
      });
}

ffi::Error BarrierEntry(ffi::Token, ffi::Result<ffi::Token>, int32_t device, int64_t comm_slot,
                        int64_t site) {
  Call c{};
  c.name = "barrier";
  c.site = site;
  if (ffi::Error err = Resolve(c, device, comm_slot); err.failure()) return err;
  progress_threads[device].Drain();
  const CheckPlan plan = PlanCheck(c, device, [] { return std::string("barrier()"); });
  InFlightScope watched(c, device, /*new_call=*/true, /*queued_ns=*/0, plan.facts);
  if (ffi::Error err = CheckSameCall(c, device, plan, watched); err.failure()) return err;
  if (int rc = Barrier(c); rc != MPI_SUCCESS) return MpiFailure(c, rc);
  return ffi::Error::Success();
}

#define MPICOLL_CPU_HANDLERS(Type, ...)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuData_##Type, CpuEntry<Type>,                           \
                                MPICOLL_DATA_BINDING(MPICOLL_NO_CONTEXT));                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuFused_##Type, CpuFusedEntry<Type>,                     \
                                MPICOLL_FUSED_BINDING(MPICOLL_NO_CONTEXT));               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuOverlappedData_##Type, CpuOverlappedEntry<Type>,       \
                                MPICOLL_DATA_BINDING(MPICOLL_NO_CONTEXT)                  \
                                    .Attr<int64_t>("here_once_arrived"));                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuOverlappedFused_##Type, CpuOverlappedFusedEntry<Type>, \
                                MPICOLL_FUSED_BINDING(MPICOLL_NO_CONTEXT)                 \
                                    .Attr<int64_t>("here_once_arrived"));
MPICOLL_OPS(MPICOLL_CPU_HANDLERS)
#undef MPICOLL_CPU_HANDLERS

XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuStatusHandler, CpuStatusEntry,
                              MPICOLL_STATUS_BINDING(MPICOLL_NO_CONTEXT));

}  // namespace

// The barrier has no buffers and no stream work: one handler for every platform.
XLA_FFI_DEFINE_HANDLER_SYMBOL(BarrierHandler, BarrierEntry,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Token>()
                                  .Ctx<LocalDevice>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("site"));

#define MPICOLL_CPU_REGISTRATION(Type, text, ...) MPICOLL_REGISTRATION(Cpu, Type, text)
// Overlapped handlers are CPU-only for now: mpicoll_<op>_overlapped[_fused].
#define MPICOLL_CPU_OVERLAPPED_REGISTRATION(Type, text, ...)                           \
  registrations.push_back({std::string("mpicoll_") + text + "_overlapped",            \
                           CpuOverlappedData_##Type});                                \
  if (Type::kFamily == kBlocks) {                                                      \
    registrations.push_back({std::string("mpicoll_") + text + "_overlapped_fused",    \
                             CpuOverlappedFused_##Type});                              \
  }
std::vector<Registration> CpuRegistrations() {
  std::vector<Registration> registrations{{"mpicoll_barrier", BarrierHandler},
                                          {"mpicoll_status", CpuStatusHandler},
                                          {"mpicoll_local_meeting", CpuLocalMeeting}};
  MPICOLL_OPS(MPICOLL_CPU_REGISTRATION)
  MPICOLL_OPS(MPICOLL_CPU_OVERLAPPED_REGISTRATION)
  return registrations;
}
#undef MPICOLL_CPU_OVERLAPPED_REGISTRATION
#undef MPICOLL_CPU_REGISTRATION


}  // namespace mpicoll

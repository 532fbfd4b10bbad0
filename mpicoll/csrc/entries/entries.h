// What the entry points share: the FFI bindings (one per handler kind, the
// platform's context added), the registration list handed to Python, and the
// handlers and functions one file defines and another uses.
#pragma once

#include <mpi.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../engine/comm_table.h"
#include "../engine/execute.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
// A handler's `device`: its local device index, XLA's device ordinal mapped
// by LocalDeviceIndex (engine/comm_table.h).  Bound as .Ctx<LocalDevice>().
struct LocalDevice {};
}  // namespace mpicoll

template <>
struct xla::ffi::CtxDecoding<mpicoll::LocalDevice> {
  using Type = int32_t;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
    std::optional<int32_t> ordinal = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    if (!ordinal) return std::nullopt;
    return mpicoll::LocalDeviceIndex(*ordinal);
  }
};

namespace mpicoll {

namespace ffi = xla::ffi;

// Handlers: every data collective has one FFI signature per platform, so one
// binding serves all of them; `Extra` adds the platform's context (the CUDA
// stream).  A handler's symbol is <Platform><Kind>_<Op>.
#define MPICOLL_DATA_BINDING(Extra)                                                    \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Token>()                                                               \
      .Arg<ffi::AnyBuffer>()                                                           \
      .Ret<ffi::Token>()                                                               \
      .Ret<ffi::AnyBuffer>() Extra                                                     \
      .Ctx<LocalDevice>()                                                       \
      .Attr<int64_t>("comm")                                                           \
      .Attr<int64_t>("root")                                                           \
      .Attr<int64_t>("op")                                                             \
      .Attr<int64_t>("site")                                                         \
      .Attr<ffi::Span<const int64_t>>("args")
#define MPICOLL_FUSED_BINDING(Extra)                                                   \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Token>()                                                               \
      .RemainingArgs()                                                                 \
      .Ret<ffi::Token>()                                                               \
      .RemainingRets() Extra                                                           \
      .Ctx<LocalDevice>()                                                       \
      .Attr<int64_t>("comm")                                                           \
      .Attr<int64_t>("root")                                                           \
      .Attr<int64_t>("op")                                                             \
      .Attr<int64_t>("site")
#define MPICOLL_NO_CONTEXT

#define MPICOLL_STATUS_BINDING(Extra)                                                  \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Token>()                                                               \
      .Ret<ffi::Token>()                                                               \
      .Ret<ffi::Buffer<ffi::S32>>() Extra                                              \
      .Ctx<LocalDevice>()

// An FFI target: its name (mpicoll_<op>[_overlapped][_fused], ...) and handler.
struct Registration {
  std::string name;
  XLA_FFI_Handler* handler;
};

// Every op's handler, and the fused one for the rank-block family (pytrees).
#define MPICOLL_REGISTRATION(Platform, Type, text)                                    \
  registrations.push_back({std::string("mpicoll_") + text, Platform##Data_##Type});   \
  if (Type::kFamily == kBlocks) {                                                      \
    registrations.push_back({std::string("mpicoll_") + text + "_fused",                \
                             Platform##Fused_##Type});                                 \
  }

// An asynchronous handler's result: a future already completed with `err`.
inline ffi::Future CompletedFuture(const ffi::Error& err) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (err.failure()) {
    promise.SetError(err);
  } else {
    promise.SetAvailable();
  }
  return future;
}

// Queues run() (returning ffi::Error) on the device's progress thread
// (engine/progress.h) and returns the future it completes: XLA holds none of its
// threads while the job waits.
template <typename Run>
ffi::Future Overlap(int32_t device, Run&& run) {
  ffi::Promise promise;
  ffi::Future future(promise);
  progress_threads[device].Enqueue([promise, run = std::forward<Run>(run)]() mutable {
    ffi::Error err = run();
    if (err.failure()) {
      promise.SetError(std::move(err));
    } else {
      promise.SetAvailable();
    }
  });
  return future;
}

// entries/cpu.cc: the CPU targets; the barrier, which serves every platform.
std::vector<Registration> CpuRegistrations();
XLA_FFI_DECLARE_HANDLER_SYMBOL(BarrierHandler);

// meeting/meeting.cc: collectives whose local devices meet in this process, and
// the pieces its allgather is gathered in (MPICOLL_GATHER_PIECES; 0 = automatic).
XLA_FFI_DECLARE_HANDLER_SYMBOL(CpuLocalMeeting);
void SetGatherPieces(int pieces);
// This process's meeting turns so far: (ended on XLA's thread, handed to the
// progress thread, queued whole).
std::array<int64_t, 3> MeetingTurns();

// entries/host_staged.cc: the GPU staging pipeline on host memory, for tests.
// Runs collective `name` (a rank-block one) on `comm` from `in` to `out`
// through StagedMemory with memcpy copies, `chunk_bytes` a pipeline chunk;
// "" or what failed.
std::string RunStagedOnHost(const char* name, MPI_Comm comm, ffi::DataType dtype, char* in,
                            size_t in_count, char* out, size_t out_count, int root, int64_t op,
                            size_t chunk_bytes);

#ifdef MPICOLL_CUDA
// entries/cuda.cc: the CUDA targets, and the GPU memory strategy they use:
// CUDA-aware MPI or pinned staging with `chunk_bytes` pipeline chunks.
std::vector<Registration> CudaRegistrations();
void SetGpuTransport(bool cuda_aware, size_t chunk_bytes);
#endif

}  // namespace mpicoll

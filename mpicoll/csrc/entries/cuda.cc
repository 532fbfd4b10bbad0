// The CUDA entry points: the same collectives on XLA's GPU buffers, through
// one of the GPU memory strategies, chosen once at start-up (Python:
// MPICOLL_GPU_TRANSPORT, MPIX_Query_cuda_support): CudaAwareMemory
// (memory/cuda_aware.h) or StagedMemory over pinned host buffers
// (memory/staged.h), and SingleRankMemory on one rank.  The collectives, the
// chunk loop, check mode and the timeout are the ones the CPU handlers use.
// Compiled only with MPICOLL_CUDA (setup.py), like everything that includes cuda.h.
#ifdef MPICOLL_CUDA

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "../engine/call.h"
#include "../engine/collectives.h"
#include "../engine/comm_table.h"
#include "../engine/execute.h"
#include "../memory/cuda_aware.h"
#include "../memory/cuda_driver.h"
#include "../memory/host.h"
#include "../memory/staged.h"
#include "staged_entry.h"
#include "../ops.def"
#include "entries.h"
#include "fused.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
namespace {

// Which memory strategy the CUDA handlers use (set_gpu_transport).
enum GpuTransport : int { kStaged = 0, kCudaAware = 1 };
std::atomic<int> gpu_transport{kStaged};
// Bytes per pipelined chunk (MPICOLL_GPU_CHUNK_BYTES); 0 = no pipelining.
std::atomic<size_t> gpu_chunk_bytes{size_t{4} << 20};

DeviceStaging<CudaCopier> device_staging[kMaxLocalDevices];

ffi::Error CudaScopeError(const Call& c, const CudaScope& scope) {
  return ffi::Error::Internal(std::string("mpicoll.") + c.name + " on a GPU: " + scope.error);
}

template <typename Op>
ffi::Error CudaExecute(Call& c, const ffi::AnyBuffer& x, CUstream stream, int32_t device) {
  auto describe = [&] { return DescribeArray<Op>(c, x); };
  const CudaCopier copier{stream};
  if (!CopiesOnDevice<Op>(c) && !NeedsTruthValues<Op>(c) &&
      gpu_transport.load(std::memory_order_relaxed) == kCudaAware) {
    CudaAwareMemory memory(copier);
    return Execute<Op>(c, device, memory, describe);
  }
  return ExecuteStaged<Op>(c, device, copier, device_staging[device],
                           gpu_chunk_bytes.load(std::memory_order_relaxed), describe);
}

template <typename Op>
ffi::Error CudaEntry(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                     ffi::Result<ffi::AnyBuffer> out, CUstream stream, int32_t device,
                     int64_t comm_slot, int64_t root, int64_t op, int64_t site,
                     ffi::Span<const int64_t> args) {
  Call c{};
  if (ffi::Error err = PrepareArray<Op>(c, x, out, device, comm_slot, root, op, site, args);
      err.failure()) {
    return err;
  }
  CudaScope scope(stream);
  if (!scope.error.empty()) return CudaScopeError(c, scope);
  ffi::Error err = CudaExecute<Op>(c, x, stream, device);
  if (err.success()) RecordStatus<Op>(c, device);
  return err;
}

// The status of the last point-to-point call, written to the GPU on the stream.
ffi::Error CudaStatusEntry(ffi::Token, ffi::Result<ffi::Token>,
                           ffi::Result<ffi::Buffer<ffi::S32>> out, CUstream stream,
                           int32_t device) {
  if (device < 0 || device >= kMaxLocalDevices || out->element_count() != 2) {
    return ffi::Error::InvalidArgument("mpicoll status: bad device or output shape");
  }
  CudaScope scope(stream);
  if (!scope.error.empty()) return ffi::Error::Internal("mpicoll status on a GPU: " + scope.error);
  const CUdeviceptr words = reinterpret_cast<CUdeviceptr>(out->typed_data());
  for (int i = 0; i < 2; ++i) {
    CUresult r = Driver().cuMemsetD32Async(
        words + i * sizeof(int32_t), static_cast<unsigned int>(last_status[device][i]), 1, stream);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal(CudaErrorText("cuMemsetD32Async", r));
  }
  return ffi::Error::Success();
}

// Fused calls always stage: their arrays are small (Python fuses only arrays
// under 256 KiB, at most 4 MiB a message), and packing them is a copy anyway,
// so it goes straight to pinned host memory, one strided copy per array.
template <typename Op>
ffi::Error CudaFusedEntry(ffi::Token, ffi::RemainingArgs xs, ffi::Result<ffi::Token>,
                          ffi::RemainingRets outs, CUstream stream, int32_t device,
                          int64_t comm_slot, int64_t root, int64_t op, int64_t site) {
  Call c{};
  thread_local FusedArrays arrays;
  if (ffi::Error err = PrepareFused<Op>(c, arrays, xs, outs, device, comm_slot, root, op, site);
      err.failure()) {
    return err;
  }
  CudaScope scope(stream);
  if (!scope.error.empty()) return CudaScopeError(c, scope);
  DeviceStaging<CudaCopier>& staging = device_staging[device];
  std::lock_guard<std::mutex> lock(staging.mutex);
  const CudaCopier copier{stream};
  std::string error;
  auto copy = [&](char* dst, size_t dst_pitch, const char* src, size_t src_pitch, size_t width,
                  size_t height) {
    return copier.Copy2D(error, dst, dst_pitch, src, src_pitch, width, height);
  };
  auto failed = [&] {
    return ffi::Error::Internal(std::string("mpicoll.") + c.name + " on rank " +
                                std::to_string(c.rank) + ": " + error);
  };
  int rc = staging.Reserve(0, c.in_count * c.elem_bytes, error);
  if (rc == MPI_SUCCESS && !Op::kInPlace) rc = staging.Reserve(1, c.out_count * c.elem_bytes, error);
  if (rc == MPI_SUCCESS) rc = staging.WaitReleased(error);
  if (rc != MPI_SUCCESS) return failed();
  c.in = staging.pinned[0];
  c.out = Op::kInPlace ? c.in : staging.pinned[1];
  if (ReadsInput<Op>(c)) {
    rc = CopyPacked(true, arrays.in, arrays.in_row, arrays.in_rows, c.in, c.elem_bytes, copy);
    if (rc == MPI_SUCCESS) {
      rc = copier.Synchronize(error);
    }
    if (rc != MPI_SUCCESS) return failed();
  }
  HostMemory memory;  // on the pinned buffers
  memory.advise_huge_pages = false;
  const ffi::DataType dtype = xs.get<ffi::AnyBuffer>(0)->element_type();
  ffi::Error err = Execute<Op>(c, device, memory,
                               [&] { return DescribeFused<Op>(c, xs.size(), dtype); });
  if (err.failure()) return err;
  rc = CopyPacked(false, arrays.out, arrays.out_row, arrays.out_rows, c.out, c.elem_bytes, copy);
  if (rc == MPI_SUCCESS) {
    rc = copier.Record(staging.released, error);
  }
  return rc == MPI_SUCCESS ? ffi::Error::Success() : failed();
}

#define MPICOLL_CUDA_CONTEXT .Ctx<ffi::PlatformStream<CUstream>>()
#define MPICOLL_CUDA_HANDLERS(Type, ...)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaData_##Type, CudaEntry<Type>,                     \
                                MPICOLL_DATA_BINDING(MPICOLL_CUDA_CONTEXT));          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaFused_##Type, CudaFusedEntry<Type>,               \
                                MPICOLL_FUSED_BINDING(MPICOLL_CUDA_CONTEXT));
MPICOLL_OPS(MPICOLL_CUDA_HANDLERS)
#undef MPICOLL_CUDA_HANDLERS

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaStatusHandler, CudaStatusEntry,
                              MPICOLL_STATUS_BINDING(MPICOLL_CUDA_CONTEXT));

}  // namespace

#define MPICOLL_CUDA_REGISTRATION(Type, text, ...) MPICOLL_REGISTRATION(Cuda, Type, text)
std::vector<Registration> CudaRegistrations() {
  std::vector<Registration> registrations{{"mpicoll_barrier", BarrierHandler},
                                          {"mpicoll_status", CudaStatusHandler}};
  MPICOLL_OPS(MPICOLL_CUDA_REGISTRATION)
  return registrations;
}
#undef MPICOLL_CUDA_REGISTRATION


void SetGpuTransport(bool cuda_aware, size_t chunk_bytes) {
  gpu_transport.store(cuda_aware ? kCudaAware : kStaged);
  gpu_chunk_bytes.store(chunk_bytes);
}

}  // namespace mpicoll

#endif  // MPICOLL_CUDA

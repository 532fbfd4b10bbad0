// The CUDA driver, loaded at run time, and the copies the GPU memory
// strategies make with it (CudaCopier, the copier policy of memory/staged.h).
//
// The CUDA driver API is loaded with dlopen when first needed, so a build
// with CUDA support imports on a machine without a driver (nothing calls it
// there), and the extension does not link against any CUDA library.  No host
// code ever reads or writes a device pointer: every copy and every memset of
// XLA's buffers is a CUDA operation on XLA's stream.
#pragma once

#include <cuda.h>
#include <dlfcn.h>
#include <mpi.h>

#include <cstddef>
#include <string>

#include "../engine/call.h"

namespace mpicoll {
#define MPICOLL_CU_FUNCTIONS(X)                                                         \
  X(cuInit) X(cuGetErrorString) X(cuDriverGetVersion) X(cuDeviceGetCount)             \
  X(cuStreamGetCtx) X(cuCtxPushCurrent) X(cuCtxPopCurrent) X(cuStreamSynchronize)     \
  X(cuEventCreate) X(cuEventRecord) X(cuEventSynchronize) X(cuMemcpyAsync)            \
  X(cuMemcpy2DAsync) X(cuMemsetD8Async) X(cuMemsetD32Async) X(cuMemHostAlloc)         \
  X(cuMemFreeHost)

// cuda.h maps names to versioned symbols (cuMemcpy2DAsync -> cuMemcpy2DAsync_v2);
// expanding before stringizing looks up the symbol the header means.
#define MPICOLL_CU_STRING(name) MPICOLL_CU_STRING_(name)
#define MPICOLL_CU_STRING_(name) #name

struct CudaDriver {
#define MPICOLL_CU_POINTER(name) decltype(&::name) name = nullptr;
  MPICOLL_CU_FUNCTIONS(MPICOLL_CU_POINTER)
#undef MPICOLL_CU_POINTER
  std::string error;  // empty once loaded
  int version = 0;
};

inline const CudaDriver& Driver() {
  static CudaDriver* driver = [] {
    auto* d = new CudaDriver;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d->error = std::string("cannot load the CUDA driver (libcuda.so.1): ") + dlerror();
      return d;
    }
#define MPICOLL_CU_LOAD(name)                                                          \
    d->name = reinterpret_cast<decltype(d->name)>(dlsym(lib, MPICOLL_CU_STRING(name))); \
    if (!d->name && d->error.empty()) d->error = "libcuda.so.1 lacks " MPICOLL_CU_STRING(name);
    MPICOLL_CU_FUNCTIONS(MPICOLL_CU_LOAD)
#undef MPICOLL_CU_LOAD
    if (d->error.empty() && d->cuInit(0) != CUDA_SUCCESS) d->error = "cuInit failed";
    if (d->error.empty()) d->cuDriverGetVersion(&d->version);
    return d;
  }();
  return *driver;
}

inline std::string CudaErrorText(const char* what, CUresult result) {
  const char* text = nullptr;
  if (Driver().cuGetErrorString) Driver().cuGetErrorString(result, &text);
  return std::string(what) + " failed: " + (text ? text : "CUDA error " + std::to_string(result));
}

// A CUDA result as an MPI-style code: MPI_SUCCESS, or kTransportFailed with
// `error` saying what failed.
inline int Checked(CUresult result, const char* what, std::string& error) {
  if (result == CUDA_SUCCESS) return MPI_SUCCESS;
  error = CudaErrorText(what, result);
  return kTransportFailed;
}

// Makes the context of XLA's stream current for this scope (the driver API
// acts on the current context; XLA's thread need not have one).
struct CudaScope {
  std::string error;
  bool pushed = false;
  explicit CudaScope(CUstream stream) {
    const CudaDriver& cu = Driver();
    if (!cu.error.empty()) {
      error = cu.error;
      return;
    }
    CUcontext context = nullptr;
    if (CUresult r = cu.cuStreamGetCtx(stream, &context); r != CUDA_SUCCESS) {
      error = CudaErrorText("cuStreamGetCtx", r);
    } else if (CUresult r = cu.cuCtxPushCurrent(context); r != CUDA_SUCCESS) {
      error = CudaErrorText("cuCtxPushCurrent", r);
    } else {
      pushed = true;
    }
  }
  ~CudaScope() {
    CUcontext popped;
    if (pushed) Driver().cuCtxPopCurrent(&popped);
  }
};

// A strided copy on `stream` between any two of host (pinned) and device
// memory (unified addressing tells them apart): `height` rows of `width`
// bytes.  Returns an MPI-style code; `error` says what failed.
inline int CudaCopy2D(CUstream stream, std::string& error, char* dst, size_t dst_pitch,
                      const char* src, size_t src_pitch, size_t width, size_t height) {
  const CudaDriver& cu = Driver();
  if (width == 0 || height == 0) return MPI_SUCCESS;
  CUresult r;
  if (height == 1 || (dst_pitch == width && src_pitch == width)) {
    r = cu.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src),
                         width * height, stream);
  } else {
    CUDA_MEMCPY2D copy{};
    copy.srcMemoryType = CU_MEMORYTYPE_UNIFIED;
    copy.srcDevice = reinterpret_cast<CUdeviceptr>(src);
    copy.srcPitch = src_pitch;
    copy.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
    copy.dstDevice = reinterpret_cast<CUdeviceptr>(dst);
    copy.dstPitch = dst_pitch;
    copy.WidthInBytes = width;
    copy.Height = height;
    r = cu.cuMemcpy2DAsync(&copy, stream);
    if (r == CUDA_ERROR_INVALID_VALUE) {  // a pitch beyond the device's limit: row by row
      r = CUDA_SUCCESS;
      for (size_t row = 0; r == CUDA_SUCCESS && row < height; ++row) {
        r = cu.cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst + row * dst_pitch),
                             reinterpret_cast<CUdeviceptr>(src + row * src_pitch), width, stream);
      }
    }
  }
  if (r == CUDA_SUCCESS) return MPI_SUCCESS;
  error = CudaErrorText("copying between the GPU and pinned host memory", r);
  return kTransportFailed;
}

// The staging strategies' copies (memory/staged.h) as CUDA operations on
// XLA's stream; events order the pinned buffers' reuse.
struct CudaCopier {
  using Event = CUevent;
  CUstream stream;

  // A strided copy between device and pinned host memory (see CudaCopy2D).
  int Copy2D(std::string& error, char* dst, size_t dst_pitch, const char* src, size_t src_pitch,
             size_t width, size_t height) const {
    return CudaCopy2D(stream, error, dst, dst_pitch, src, src_pitch, width, height);
  }
  // Device-to-device copy and zeroing of XLA's buffers.
  int Copy(std::string& error, char* dst, const char* src, size_t bytes) const {
    return Checked(Driver().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst),
                                          reinterpret_cast<CUdeviceptr>(src), bytes, stream),
                   "cuMemcpyAsync", error);
  }
  int Zero(std::string& error, char* dst, size_t bytes) const {
    return Checked(Driver().cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dst), 0, bytes, stream),
                   "cuMemsetD8Async", error);
  }
  // Until what the stream has queued so far is done.
  int Synchronize(std::string& error) const {
    return Checked(Driver().cuStreamSynchronize(stream), "cuStreamSynchronize", error);
  }
  int Record(Event event, std::string& error) const {
    return Checked(Driver().cuEventRecord(event, stream), "cuEventRecord", error);
  }
  static int Wait(Event event, const char* what, std::string& error) {
    return Checked(Driver().cuEventSynchronize(event), what, error);
  }
  static int CreateEvent(Event* event, std::string& error) {
    return Checked(Driver().cuEventCreate(event, CU_EVENT_DISABLE_TIMING), "cuEventCreate", error);
  }
  static int AllocateStaging(size_t bytes, char** memory, std::string& error) {
    void* pinned = nullptr;
    if (CUresult r = Driver().cuMemHostAlloc(&pinned, bytes, CU_MEMHOSTALLOC_PORTABLE);
        r != CUDA_SUCCESS) {
      error = CudaErrorText(("allocating " + std::to_string(bytes) +
                             " bytes of pinned staging memory (cuMemHostAlloc)").c_str(), r);
      return kTransportFailed;
    }
    *memory = static_cast<char*>(pinned);
    return MPI_SUCCESS;
  }
  static void FreeStaging(char* memory) { Driver().cuMemFreeHost(memory); }
};

}  // namespace mpicoll

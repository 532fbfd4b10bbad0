// GPU support: the CUDA handlers and the two GPU memory strategies.
//
// Included by collectives.cc when built with MPICOLL_CUDA.  The collectives,
// the chunk loop, check mode and the timeout are the ones the CPU handlers
// use; only where the bytes live differs:
//   CudaAwareMemory  MPI gets XLA's device pointers (after the stream is
//                    synchronized): for an MPI built with CUDA support.
//   StagedMemory     MPI works on pinned host buffers, one pair per local
//                    device, reused across calls.  A message larger than the
//                    chunk size is pipelined: chunk k+1 is copied out of the
//                    GPU and chunk k-1 back into it while MPI moves chunk k.
// No host code ever reads or writes a device pointer: every copy and every
// memset of XLA's buffers is a CUDA operation on XLA's stream.
//
// The CUDA driver API is loaded with dlopen when first needed, so a build
// with CUDA support imports on a machine without a driver (nothing calls it
// there), and the extension does not link against any CUDA library.

// (Included inside collectives.cc's anonymous namespace, after the CPU
// handlers; cuda.h, dlfcn.h and mutex are included at its top.)

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

const CudaDriver& Driver() {
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

std::string CudaErrorText(const char* what, CUresult result) {
  const char* text = nullptr;
  if (Driver().cuGetErrorString) Driver().cuGetErrorString(result, &text);
  return std::string(what) + " failed: " + (text ? text : "CUDA error " + std::to_string(result));
}

// A CUDA result as an MPI-style code: MPI_SUCCESS, or kTransportFailed with
// `error` saying what failed.
int Checked(CUresult result, const char* what, std::string& error) {
  if (result == CUDA_SUCCESS) return MPI_SUCCESS;
  error = CudaErrorText(what, result);
  return kTransportFailed;
}

// Device-to-device copy and zeroing of XLA's buffers, on its stream.
int CopyOnStream(CUstream stream, std::string& error, char* dst, const char* src, size_t bytes) {
  return Checked(Driver().cuMemcpyAsync(reinterpret_cast<CUdeviceptr>(dst),
                                        reinterpret_cast<CUdeviceptr>(src), bytes, stream),
                 "cuMemcpyAsync", error);
}

int ZeroOnStream(CUstream stream, std::string& error, char* dst, size_t bytes) {
  return Checked(Driver().cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dst), 0, bytes, stream),
                 "cuMemsetD8Async", error);
}

// Which memory strategy the CUDA handlers use, chosen once in Python at import
// (MPICOLL_GPU_TRANSPORT, MPIX_Query_cuda_support) and reported by `info`.
enum GpuTransport : int { kStaged = 0, kCudaAware = 1 };
std::atomic<int> gpu_transport{kStaged};
// Bytes per pipelined chunk (MPICOLL_GPU_CHUNK_BYTES); 0 = no pipelining.
std::atomic<size_t> gpu_chunk_bytes{size_t{4} << 20};

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
int CudaCopy2D(CUstream stream, std::string& error, char* dst, size_t dst_pitch, const char* src,
               size_t src_pitch, size_t width, size_t height) {
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

// The staging state of one local device: two pinned buffers (input, output),
// reused and grown as needed, and the events that order them.
struct DeviceStaging {
  std::mutex mutex;  // one collective at a time per device
  char* pinned[2] = {nullptr, nullptr};
  size_t capacity[2] = {0, 0};
  CUevent chunk_copied_in[2] = {nullptr, nullptr};  // alternate between chunks
  CUevent released = nullptr;  // recorded after a call's last copy back to the GPU

  // Before the host writes a pinned buffer that a previous call's copy to
  // the GPU may still be reading.
  int WaitReleased(std::string& error) {
    if (!released) return MPI_SUCCESS;
    return Checked(Driver().cuEventSynchronize(released), "cuEventSynchronize", error);
  }

  int Reserve(int which, size_t bytes, std::string& error) {
    const CudaDriver& cu = Driver();
    for (CUevent* event : {&chunk_copied_in[0], &chunk_copied_in[1], &released}) {
      if (*event) continue;
      if (int rc = Checked(cu.cuEventCreate(event, CU_EVENT_DISABLE_TIMING), "cuEventCreate",
                           error);
          rc != MPI_SUCCESS) {
        return rc;
      }
    }
    if (bytes <= capacity[which]) return MPI_SUCCESS;
    if (int rc = WaitReleased(error); rc != MPI_SUCCESS) return rc;
    if (pinned[which]) cu.cuMemFreeHost(pinned[which]);
    pinned[which] = nullptr;
    capacity[which] = 0;
    constexpr size_t kGranule = size_t{2} << 20;
    const size_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
    void* memory = nullptr;
    if (CUresult r = cu.cuMemHostAlloc(&memory, rounded, CU_MEMHOSTALLOC_PORTABLE);
        r != CUDA_SUCCESS) {
      error = CudaErrorText(("allocating " + std::to_string(rounded) +
                             " bytes of pinned staging memory (cuMemHostAlloc)").c_str(), r);
      return kTransportFailed;
    }
    pinned[which] = static_cast<char*>(memory);
    capacity[which] = rounded;
    return MPI_SUCCESS;
  }
};
DeviceStaging device_staging[kMaxLocalDevices];

// MPI works on pinned host buffers; copies run on XLA's stream, so they are
// ordered after the kernels that produced the input and before those that
// read the output, and the handler returns without waiting for the last
// copy back.  Same-shape collectives (bcast, reduce, allreduce) run in place
// in one pinned buffer.
class StagedMemory {
 public:
  static constexpr bool kCallsMpi = true;
  std::string error;

  StagedMemory(DeviceStaging& staging, CUstream stream) : staging_(staging), stream_(stream) {}

  template <typename Op>
  int Begin(Call& c) {
    device_in_ = c.in;
    device_out_ = c.out;
    out_bytes_ = c.out_count * c.elem_bytes;
    elem_bytes_ = c.elem_bytes;
    rows_in_ = RowsIn<Op>(c);
    rows_out_ = RowsOut<Op>(c);
    block_ = BlockElements<Op>(c);
    copy_in_ = ReadsInput<Op>(c);
    copy_out_ = !OutputIsZeros<Op>(c);
    whole_ = !Op::kChunked;  // one MPI call: everything in before, everything out after
    const size_t rows = std::max(rows_in_, rows_out_);
    const size_t chunk_bytes = gpu_chunk_bytes.load(std::memory_order_relaxed);
    step_ = chunk_bytes == 0 || whole_ ? block_
                             : std::max<size_t>(1, chunk_bytes / (rows * elem_bytes_));
    int rc = staging_.Reserve(0, c.in_count * c.elem_bytes, error);
    if (rc == MPI_SUCCESS && !Op::kInPlace) rc = staging_.Reserve(1, out_bytes_, error);
    if (rc != MPI_SUCCESS) return rc;
    c.in = staging_.pinned[0];
    c.out = Op::kInPlace ? c.in : staging_.pinned[1];
    host_in_ = c.in;
    host_out_ = c.out;
    // With a copy in, the stream orders this call after the previous one's
    // copies back; without one, MPI writes the buffers right away.
    if (!copy_in_) return staging_.WaitReleased(error);
    return CopyIn(0, std::min(step_, block_), 0);
  }

  size_t ChunkElements(const Call&, size_t) const { return step_; }

  // Starts copying the next chunk in, then waits for this one.
  int BeforeChunk(const Call&, const Chunk& k) {
    if (!copy_in_) return MPI_SUCCESS;
    const size_t next = k.offset + k.count;
    if (!whole_ && next < block_) {
      if (int rc = CopyIn(next, std::min(step_, block_ - next), chunk_ + 1); rc != MPI_SUCCESS) {
        return rc;
      }
    }
    return Checked(Driver().cuEventSynchronize(staging_.chunk_copied_in[chunk_++ % 2]),
                   "waiting for the copy from the GPU", error);
  }

  int AfterChunk(const Call&, const Chunk& k) {
    if (!copy_out_) return MPI_SUCCESS;
    if (whole_) return CudaCopy2D(stream_, error, device_out_, out_bytes_, host_out_, out_bytes_,
                                  out_bytes_, 1);
    const size_t at = k.offset * elem_bytes_, pitch = block_ * elem_bytes_;
    return CudaCopy2D(stream_, error, device_out_ + at, pitch, host_out_ + at, pitch,
                      k.count * elem_bytes_, rows_out_);
  }

  template <typename Op>
  int Finish(const Call&, bool ok) {
    if (ok && !copy_out_) {
      if (int rc = ZeroOnStream(stream_, error, device_out_, out_bytes_); rc != MPI_SUCCESS) {
        return rc;
      }
    }
    return Checked(Driver().cuEventRecord(staging_.released, stream_), "cuEventRecord", error);
  }

 private:
  int CopyIn(size_t offset, size_t count, size_t chunk) {
    const size_t at = offset * elem_bytes_, pitch = block_ * elem_bytes_;
    int rc = CudaCopy2D(stream_, error, host_in_ + at, pitch, device_in_ + at, pitch,
                        count * elem_bytes_, rows_in_);
    if (rc != MPI_SUCCESS) return rc;
    return Checked(Driver().cuEventRecord(staging_.chunk_copied_in[chunk % 2], stream_),
                   "cuEventRecord", error);
  }

  DeviceStaging& staging_;
  CUstream stream_;
  char *device_in_ = nullptr, *device_out_ = nullptr, *host_in_ = nullptr, *host_out_ = nullptr;
  size_t out_bytes_ = 0, elem_bytes_ = 0, rows_in_ = 1, rows_out_ = 1, block_ = 0, step_ = 0;
  size_t chunk_ = 0;
  bool copy_in_ = true, copy_out_ = true, whole_ = false;
};

// CUDA-aware MPI: XLA's device pointers go to MPI once the stream has
// finished the kernels that produce the input.
class CudaAwareMemory : public WholeBuffers {
 public:

  explicit CudaAwareMemory(CUstream stream) : stream_(stream) {}

  template <typename Op>
  int Begin(Call& c) {
    c.device_buffers = true;  // no host-side algorithm (PairwiseReduceScatter) on these
    // bcast sends from its output buffer.
    if (std::is_same_v<Op, BcastOp> && !InPlace(c) && c.rank == c.root) {
      if (int rc = CopyOnStream(stream_, error, c.out, c.in, c.out_count * c.elem_bytes);
          rc != MPI_SUCCESS) {
        return rc;
      }
    }
    return Checked(Driver().cuStreamSynchronize(stream_), "cuStreamSynchronize", error);
  }
  template <typename Op>
  int Finish(const Call& c, bool ok) {
    if (!ok || !OutputIsZeros<Op>(c)) return MPI_SUCCESS;
    return ZeroOnStream(stream_, error, c.out, c.out_count * c.elem_bytes);
  }

 private:
  CUstream stream_;
};

// A communicator of one rank: every collective's output holds its input's
// bytes (bcast, reduce, allreduce, alltoall keep the shape; scatter drops and
// gather/allgather add a leading axis of 1; the vector ops' counts are the
// whole array), or zeros (exscan), so the collective is one copy on
// the GPU, or nothing where XLA gave both the same buffer.  Staging it through
// host memory would only cost two copies across PCIe.
class SingleRankMemory : public WholeBuffers {
 public:
  static constexpr bool kCallsMpi = false;

  explicit SingleRankMemory(CUstream stream) : stream_(stream) {}

  template <typename Op>
  int Begin(Call& c) {
    if (OutputIsZeros<Op>(c)) return ZeroOnStream(stream_, error, c.out, c.out_count * c.elem_bytes);
    if (InPlace(c)) return MPI_SUCCESS;
    return CopyOnStream(stream_, error, c.out, c.in, c.out_count * c.elem_bytes);
  }
  template <typename Op>
  int Finish(const Call&, bool) { return MPI_SUCCESS; }

 private:
  CUstream stream_;
};

ffi::Error CudaScopeError(const Call& c, const CudaScope& scope) {
  return ffi::Error::Internal(std::string("mpicoll.") + c.name + " on a GPU: " + scope.error);
}

template <typename Op>
ffi::Error CudaExecute(Call& c, const ffi::AnyBuffer& x, CUstream stream, int32_t device) {
  auto describe = [&] { return DescribeArray<Op>(c, x); };
  // The 0/1 fix-up of logical ops runs on host bytes: staged.  Point-to-point
  // on one rank is a message to itself, not a copy.
  if (c.size == 1 && Op::kFamily != kPeer && !NeedsTruthValues<Op>(c)) {
    SingleRankMemory memory(stream);
    return Execute<Op>(c, device, memory, describe);
  }
  if (gpu_transport.load(std::memory_order_relaxed) == kCudaAware && !NeedsTruthValues<Op>(c)) {
    CudaAwareMemory memory(stream);
    return Execute<Op>(c, device, memory, describe);
  }
  DeviceStaging& staging = device_staging[device];
  std::lock_guard<std::mutex> lock(staging.mutex);
  StagedMemory memory(staging, stream);
  return Execute<Op>(c, device, memory, describe);
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
  DeviceStaging& staging = device_staging[device];
  std::lock_guard<std::mutex> lock(staging.mutex);
  std::string error;
  auto copy = [&](char* dst, size_t dst_pitch, const char* src, size_t src_pitch, size_t width,
                  size_t height) {
    return CudaCopy2D(stream, error, dst, dst_pitch, src, src_pitch, width, height);
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
      rc = Checked(Driver().cuStreamSynchronize(stream), "cuStreamSynchronize", error);
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
    rc = Checked(Driver().cuEventRecord(staging.released, stream), "cuEventRecord", error);
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

#define MPICOLL_CUDA_REGISTRATION(Type, text, ...) MPICOLL_REGISTRATION(Cuda, Type, text)
std::vector<Registration> CudaRegistrations() {
  std::vector<Registration> registrations{{"mpicoll_barrier", BarrierHandler},
                                          {"mpicoll_status", CudaStatusHandler}};
  MPICOLL_OPS(MPICOLL_CUDA_REGISTRATION)
  return registrations;
}
#undef MPICOLL_CUDA_REGISTRATION

// Python: set_gpu_transport(cuda_aware: bool, chunk_bytes: int).
PyObject* SetGpuTransport(PyObject*, PyObject* args) {
  int cuda_aware;
  unsigned long long chunk_bytes;
  if (!PyArg_ParseTuple(args, "pK", &cuda_aware, &chunk_bytes)) return nullptr;
  gpu_transport.store(cuda_aware ? kCudaAware : kStaged);
  gpu_chunk_bytes.store(static_cast<size_t>(chunk_bytes));
  Py_RETURN_NONE;
}

// Python: cuda_driver() -> {"error": str or None, "version": int, "devices": int}.
PyObject* CudaDriverInfo(PyObject*, PyObject*) {
  const CudaDriver& cu = Driver();
  int devices = 0;
  if (cu.error.empty()) cu.cuDeviceGetCount(&devices);
  if (!cu.error.empty()) {
    return Py_BuildValue("{s:s,s:i,s:i}", "error", cu.error.c_str(), "version", 0, "devices", 0);
  }
  return Py_BuildValue("{s:O,s:i,s:i}", "error", Py_None, "version", cu.version, "devices",
                       devices);
}

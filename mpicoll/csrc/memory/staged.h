// StagedMemory: MPI works on staging buffers in host memory, one pair per
// local device, reused across calls; the data is copied between them and the
// device's buffers by a copier policy.  A message larger than the chunk size
// is pipelined: chunk k+1 is copied out of the device and chunk k-1 back into
// it while MPI moves chunk k.  SingleRankMemory: a communicator of one rank
// needs no MPI, only a copy on the device.
//
// The copier is CudaCopier (memory/cuda_driver.h: pinned buffers, copies on
// XLA's stream) for the CUDA handlers, and HostCopier (memory/host_copier.h:
// memcpy) for the test that runs this pipeline's logic on every machine
// (entries/host_staged.cc).  A Copier has:
//   Event                                  orders a staging buffer's reuse
//   Copy2D(error, dst, dst_pitch, src, src_pitch, width, height)
//                                          between device and staging memory
//   Copy(error, dst, src, bytes), Zero(error, dst, bytes)   on device memory
//   Record(event, error)                   after the copies queued so far
//   static Wait(event, what, error), CreateEvent(&event, error),
//   static AllocateStaging(bytes, &memory, error), FreeStaging(memory)
// each returning an MPI code, or kTransportFailed with `error` set.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "../engine/call.h"
#include "../engine/collectives.h"
#include "host.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// The staging state of one local device: two staging buffers (input,
// output), reused and grown as needed, and the events that order them.
template <typename Copier>
struct DeviceStaging {
  using Event = typename Copier::Event;
  std::mutex mutex;  // one collective at a time per device
  char* pinned[2] = {nullptr, nullptr};
  size_t capacity[2] = {0, 0};
  Event chunk_copied_in[2] = {};  // alternate between chunks
  Event released = {};  // recorded after a call's last copy back to the device

  // Before the host writes a staging buffer that a previous call's copy to
  // the device may still be reading.
  int WaitReleased(std::string& error) {
    if (!released) return MPI_SUCCESS;
    return Copier::Wait(released, "cuEventSynchronize", error);
  }

  int Reserve(int which, size_t bytes, std::string& error) {
    for (Event* event : {&chunk_copied_in[0], &chunk_copied_in[1], &released}) {
      if (*event) continue;
      if (int rc = Copier::CreateEvent(event, error); rc != MPI_SUCCESS) return rc;
    }
    if (bytes <= capacity[which]) return MPI_SUCCESS;
    if (int rc = WaitReleased(error); rc != MPI_SUCCESS) return rc;
    if (pinned[which]) Copier::FreeStaging(pinned[which]);
    pinned[which] = nullptr;
    capacity[which] = 0;
    constexpr size_t kGranule = size_t{2} << 20;
    const size_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
    if (int rc = Copier::AllocateStaging(rounded, &pinned[which], error); rc != MPI_SUCCESS) {
      return rc;
    }
    capacity[which] = rounded;
    return MPI_SUCCESS;
  }
};

// MPI works on the staging buffers; copies are queued in order with the
// device's work (CUDA: on XLA's stream, so they are ordered after the kernels
// that produced the input and before those that read the output, and the
// handler returns without waiting for the last copy back).  Same-shape
// collectives (bcast, reduce, allreduce) run in place in one staging buffer.
template <typename Copier>
class StagedMemory {
 public:
  static constexpr bool kCallsMpi = true;
  std::string error;

  // chunk_bytes: bytes of every rank block per pipelined chunk; 0 = one chunk.
  StagedMemory(DeviceStaging<Copier>& staging, const Copier& copier, size_t chunk_bytes)
      : staging_(staging), copier_(copier), chunk_bytes_(chunk_bytes) {}

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
    step_ = chunk_bytes_ == 0 || whole_ ? block_
                              : std::max<size_t>(1, chunk_bytes_ / (rows * elem_bytes_));
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
    return Copier::Wait(staging_.chunk_copied_in[chunk_++ % 2],
                        "waiting for the copy from the GPU", error);
  }

  int AfterChunk(const Call&, const Chunk& k) {
    if (!copy_out_) return MPI_SUCCESS;
    if (whole_) {
      return copier_.Copy2D(error, device_out_, out_bytes_, host_out_, out_bytes_, out_bytes_, 1);
    }
    const size_t at = k.offset * elem_bytes_, pitch = block_ * elem_bytes_;
    return copier_.Copy2D(error, device_out_ + at, pitch, host_out_ + at, pitch,
                          k.count * elem_bytes_, rows_out_);
  }

  template <typename Op>
  int Finish(const Call&, bool ok) {
    if (ok && !copy_out_) {
      if (int rc = copier_.Zero(error, device_out_, out_bytes_); rc != MPI_SUCCESS) return rc;
    }
    return copier_.Record(staging_.released, error);
  }

 private:
  int CopyIn(size_t offset, size_t count, size_t chunk) {
    const size_t at = offset * elem_bytes_, pitch = block_ * elem_bytes_;
    int rc = copier_.Copy2D(error, host_in_ + at, pitch, device_in_ + at, pitch,
                            count * elem_bytes_, rows_in_);
    if (rc != MPI_SUCCESS) return rc;
    return copier_.Record(staging_.chunk_copied_in[chunk % 2], error);
  }

  DeviceStaging<Copier>& staging_;
  Copier copier_;
  size_t chunk_bytes_;
  char *device_in_ = nullptr, *device_out_ = nullptr, *host_in_ = nullptr, *host_out_ = nullptr;
  size_t out_bytes_ = 0, elem_bytes_ = 0, rows_in_ = 1, rows_out_ = 1, block_ = 0, step_ = 0;
  size_t chunk_ = 0;
  bool copy_in_ = true, copy_out_ = true, whole_ = false;
};

// A communicator of one rank: every collective's output holds its input's
// bytes (bcast, reduce, allreduce, alltoall keep the shape; scatter drops and
// gather/allgather add a leading axis of 1; the vector ops' counts are the
// whole array), or zeros (exscan), so the collective is one copy on
// the device, or nothing where XLA gave both the same buffer.  Staging it
// through host memory would only cost two copies across PCIe.
template <typename Copier>
class SingleRankMemory : public WholeBuffers {
 public:
  static constexpr bool kCallsMpi = false;

  explicit SingleRankMemory(const Copier& copier) : copier_(copier) {}

  template <typename Op>
  int Begin(Call& c) {
    if (OutputIsZeros<Op>(c)) return copier_.Zero(error, c.out, c.out_count * c.elem_bytes);
    if (InPlace(c)) return MPI_SUCCESS;
    return copier_.Copy(error, c.out, c.in, c.out_count * c.elem_bytes);
  }
  template <typename Op>
  int Finish(const Call&, bool) { return MPI_SUCCESS; }

 private:
  Copier copier_;
};

}  // namespace mpicoll

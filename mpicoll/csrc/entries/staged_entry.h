// Entering the engine with device buffers through the staged strategy
// (memory/staged.h): the choice between a copy on the device (one rank) and
// the staging pipeline, made here so that no strategy calls the engine.
// Used by the CUDA handlers (cuda.cc) and the host-memory test of the
// pipeline (host_staged.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "../engine/call.h"
#include "../engine/collectives.h"
#include "../engine/execute.h"
#include "../memory/staged.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

// Whether a call on a one-rank communicator is a copy on the device
// (SingleRankMemory): the 0/1 fix-up of logical ops runs on host bytes, so it
// is staged; point-to-point on one rank is a message to itself, not a copy.
template <typename Op>
bool CopiesOnDevice(const Call& c) {
  return c.size == 1 && Op::kFamily != kPeer && !NeedsTruthValues<Op>(c);
}

// Runs a call whose buffers are device memory through the staging buffers
// (or, on one rank, as a copy on the device).
template <typename Op, typename Copier, typename Describe>
ffi::Error ExecuteStaged(Call& c, int32_t device, const Copier& copier,
                         DeviceStaging<Copier>& staging, size_t chunk_bytes,
                         Describe&& describe) {
  if (CopiesOnDevice<Op>(c)) {
    SingleRankMemory<Copier> memory(copier);
    return Execute<Op>(c, device, memory, describe);
  }
  std::lock_guard<std::mutex> lock(staging.mutex);
  StagedMemory<Copier> memory(staging, copier, chunk_bytes);
  return Execute<Op>(c, device, memory, describe);
}

}  // namespace mpicoll

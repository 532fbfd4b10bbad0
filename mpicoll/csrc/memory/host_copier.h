// HostCopier: the staging strategies' copier policy (memory/staged.h) on host
// memory, with memcpy.  The "device" buffers are then ordinary host arrays, so
// the staged pipeline's logic (chunks, 2-D copies across rank blocks, staging
// buffers reused across calls, the single-rank path) runs, and is tested, on
// machines without a GPU (entries/host_staged.cc).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../engine/call.h"
#include "host.h"

namespace mpicoll {

struct HostCopier {
  using Event = bool;  // a memcpy is complete when it returns: events only exist

  int Copy2D(std::string&, char* dst, size_t dst_pitch, const char* src, size_t src_pitch,
             size_t width, size_t height) const {
    return HostCopy2D(dst, dst_pitch, src, src_pitch, width, height);
  }
  int Copy(std::string&, char* dst, const char* src, size_t bytes) const {
    std::memcpy(dst, src, bytes);
    return MPI_SUCCESS;
  }
  int Zero(std::string&, char* dst, size_t bytes) const {
    std::memset(dst, 0, bytes);
    return MPI_SUCCESS;
  }
  int Synchronize(std::string&) const { return MPI_SUCCESS; }
  int Record(Event, std::string&) const { return MPI_SUCCESS; }
  static int Wait(Event, const char*, std::string&) { return MPI_SUCCESS; }
  static int CreateEvent(Event* event, std::string&) {
    *event = true;
    return MPI_SUCCESS;
  }
  // Filled with a pattern, so that bytes the pipeline forgets to copy show.
  static int AllocateStaging(size_t bytes, char** memory, std::string& error) {
    *memory = static_cast<char*>(std::malloc(bytes));
    if (*memory == nullptr) {
      error = "allocating " + std::to_string(bytes) + " bytes of staging memory failed";
      return kTransportFailed;
    }
    std::memset(*memory, 0xA5, bytes);
    return MPI_SUCCESS;
  }
  static void FreeStaging(char* memory) { std::free(memory); }
};

}  // namespace mpicoll

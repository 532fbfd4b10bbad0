// The serialized-MPI lock: at MPI_THREAD_SERIALIZED every MPI call of
// mpicoll's takes it (guard.h's callers, the progress threads).
#pragma once

#include <atomic>
#include <mutex>

namespace mpicoll {

// Serialized MPI (one local device per process; native.SERIALIZED): at
// MPI_THREAD_SERIALIZED, MPI allows calls from several threads (XLA's,
// Python's) but never two at once, and skips the locking MPI_THREAD_MULTIPLE
// costs every call.  mpicoll's own MPI calls take this one lock while the
// mode is on; Python makes each dispatch of a program with collectives
// complete before it returns, so the user's mpi4py calls never overlap them.
// Any other thread of mpicoll's that calls MPI (a progress thread) must hold
// it too.  Off (MULTIPLE): no lock, MPI does its own.
struct SerializedMpi {
  std::mutex mutex;
  std::atomic<bool> on{false};
};
inline SerializedMpi serialized_mpi;

// Holds serialized_mpi.mutex for one scope when the mode is on.
class SerializedMpiScope {
 public:
  SerializedMpiScope() {
    if (serialized_mpi.on.load(std::memory_order_relaxed)) {
      lock_ = std::unique_lock<std::mutex>(serialized_mpi.mutex);
    }
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace mpicoll

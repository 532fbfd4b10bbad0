// The communicator table: what a compiled program's `comm` attribute refers to.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

namespace mpicoll {

// Communicator table.  Python registers each communicator once (per local
// device) and the compiled program refers to it by a key, so the hot path is
// an array index, not a handle conversion.  key = generation * kMaxComms +
// slot: a slot is reused after its communicator is freed, but with a new
// generation, so a program compiled for the freed communicator finds a
// mismatch and fails instead of running on another communicator.  Rows are
// allocated at registration and never moved or freed.
constexpr int kMaxComms = 1024;
constexpr int kMaxLocalDevices = 256;
// Rank and size are looked up once, at registration, not on every call.
struct DeviceComm {
  MPI_Comm comm = MPI_COMM_NULL;
  // A duplicate for mpicoll's own algorithms built of point-to-point messages
  // (PairwiseReduceScatter): its own context, so their messages never match a
  // user's send/recv on `comm`, even one with MPI_ANY_TAG.
  MPI_Comm internal = MPI_COMM_NULL;
  int rank = -1;
  int size = 0;
};
struct CommRow {
  std::atomic<int64_t> key{-1};
  DeviceComm devices[kMaxLocalDevices];
};
inline std::atomic<CommRow*> comm_table[kMaxComms];

inline const DeviceComm* LookupComm(int64_t key, int32_t device) {
  if (key < 0 || device < 0 || device >= kMaxLocalDevices) return nullptr;
  CommRow* row = comm_table[key % kMaxComms].load(std::memory_order_acquire);
  if (!row || row->key.load(std::memory_order_acquire) != key) return nullptr;
  const DeviceComm* entry = &row->devices[device];
  return entry->comm == MPI_COMM_NULL ? nullptr : entry;
}

// mpi4py's `Comm.handle` is the MPI_Comm value as an integer: an int in
// MPICH, a pointer in Open MPI.
template <typename Handle>
Handle HandleFromInteger(unsigned long long value) {
  if constexpr (std::is_pointer_v<Handle>) {
    return reinterpret_cast<Handle>(static_cast<uintptr_t>(value));
  } else {
    return static_cast<Handle>(value);
  }
}

}  // namespace mpicoll

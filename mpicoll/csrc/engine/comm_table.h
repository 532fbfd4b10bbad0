// The communicator table: what a compiled program's `comm` attribute refers to.
#pragma once

#include <mpi.h>

#include <algorithm>
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
// The slots the watch (watch/guard.h) and the flight recorder keep state in:
// each local device's, then XLA's own collectives' where JAX's CPU collectives
// run on mpicoll's MPI (mpiabi/jax_calls.cc), one per XLA communicator (taken
// in turn from kXlaSlot up): a communicator's collectives come one at a time,
// so its slot has one call in it, and its sequence numbers are the
// communicator's alone.
constexpr int kXlaSlot = kMaxLocalDevices;
constexpr int kXlaSlots = kMaxLocalDevices;
constexpr int kCallSlots = kMaxLocalDevices + kXlaSlots;
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
// Whether a communicator's local meetings start their turns on XLA's thread
// (meeting/meeting.cc), by slot: agreed by its ranks when it is registered
// (runtime/comm.py), since where turns may start there, every leader passes an
// arrival barrier before its MPI call, and the ranks must all do so or none.
inline std::atomic<bool> meetings_start_here[kMaxComms];

inline const DeviceComm* LookupComm(int64_t key, int32_t device) {
  if (key < 0 || device < 0 || device >= kMaxLocalDevices) return nullptr;
  CommRow* row = comm_table[key % kMaxComms].load(std::memory_order_acquire);
  if (!row || row->key.load(std::memory_order_acquire) != key) return nullptr;
  const DeviceComm* entry = &row->devices[device];
  return entry->comm == MPI_COMM_NULL ? nullptr : entry;
}

// XLA's device ordinal -> mpicoll's local device index (the device's position
// in jax.local_devices(), which is how Python registers a communicator's
// per-device duplicates).  In one process they are the same.  After
// jax.distributed.initialize a CPU device's ordinal is its global id (process
// << 11 | local), so Python registers the map (SetDeviceOrdinals) before the
// first collective; the pairs are searched in order (the local hardware ids
// first: a GPU's ordinal is its CUDA device number).  Without a map the
// ordinal is the index: one relaxed load on the hot path.
inline std::atomic<int> device_ordinal_pairs{0};
inline int32_t device_ordinal_map[2 * kMaxLocalDevices][2];  // (ordinal, local index)

inline int32_t LocalDeviceIndex(int32_t ordinal) {
  int pairs = device_ordinal_pairs.load(std::memory_order_acquire);
  for (int i = 0; i < pairs; ++i) {
    if (device_ordinal_map[i][0] == ordinal) return device_ordinal_map[i][1];
  }
  return ordinal;  // not mapped: LookupComm refuses what is out of range
}

// Sets the map once (the same pairs every time Python registers a
// communicator); false if it differs from one set before or is too long.
inline bool SetDeviceOrdinals(const int32_t (*pairs)[2], int count) {
  if (count < 0 || count > 2 * kMaxLocalDevices) return false;
  int set = device_ordinal_pairs.load(std::memory_order_acquire);
  if (set != 0) {
    return set == count && std::equal(&pairs[0][0], &pairs[0][0] + 2 * count,
                                      &device_ordinal_map[0][0]);
  }
  std::copy(&pairs[0][0], &pairs[0][0] + 2 * count, &device_ordinal_map[0][0]);
  device_ordinal_pairs.store(count, std::memory_order_release);
  return true;
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

template <typename Handle>
unsigned long long IntegerFromHandle(Handle handle) {
  if constexpr (std::is_pointer_v<Handle>) {
    return static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(handle));
  } else {
    return static_cast<unsigned long long>(handle);
  }
}

// Stores `comm` as (key, device), with its rank, size and internal duplicate.
// Collective over `comm`, like the Python MPI_Comm_dup this follows (same
// order on every rank).  Returns an MPI code.
inline int RegisterDeviceComm(int64_t key, int device, MPI_Comm comm) {
  DeviceComm entry;
  entry.comm = comm;
  int rc = MPI_Comm_rank(entry.comm, &entry.rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(entry.comm, &entry.size);
  if (rc == MPI_SUCCESS && entry.size > 1) rc = MPI_Comm_dup(entry.comm, &entry.internal);
  if (rc != MPI_SUCCESS) return rc;
  CommRow* row = comm_table[key % kMaxComms].load();
  if (!row) {
    row = new CommRow;
    comm_table[key % kMaxComms].store(row, std::memory_order_release);
  }
  if (row->key.load() != key) {  // a new generation of this slot
    row->key.store(-1);
    std::fill(row->devices, row->devices + kMaxLocalDevices, DeviceComm{});
  }
  row->devices[device] = entry;
  row->key.store(key, std::memory_order_release);
  return MPI_SUCCESS;
}

// Empties `key`'s slot (its communicators are being freed) and frees the
// internal duplicates; Python frees the communicators it duplicated right
// after this, in the same order.
inline void UnregisterDeviceComms(int64_t key) {
  if (key < 0) return;
  if (CommRow* row = comm_table[key % kMaxComms].load()) {
    int64_t expected = key;
    if (row->key.compare_exchange_strong(expected, -1)) {
      for (DeviceComm& entry : row->devices) {
        if (entry.internal != MPI_COMM_NULL) MPI_Comm_free(&entry.internal);
      }
    }
  }
}

}  // namespace mpicoll

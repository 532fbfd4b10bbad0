// The guard around every MPI call mpicoll makes: check mode (the ranks agree
// on what they call), the timeout watchdog, and the serialized-MPI lock.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "call.h"
#include "comm_table.h"
#include "dtypes.h"
#include "flight.h"
#include "reduce_ops.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------
// Checks: the ranks compare a fingerprint of what they are about to call (op,
// dtype, shape, root, reduction) on the call's communicator.  On a mismatch
// every rank gets an error listing what each rank called, instead of a hang,
// an MPI abort or garbage.  It costs one small allreduce, so by default
// (kCheckFirstRun) each call site of a compiled program is checked the first
// time it runs on each device, and never again; kCheckEveryCall checks every
// call (MPICOLL_CHECK=1).
enum CheckMode : int { kCheckOff = 0, kCheckFirstRun = 1, kCheckEveryCall = 2 };
inline std::atomic<int> check_mode{kCheckFirstRun};

// Call sites already checked, per local device (each device runs its own copy
// of a program, on its own communicator).  Sites are numbered by Python when
// it lowers a call; 0 is a call with no site (always checked in first-run mode).
struct CheckedSites {
  std::mutex mutex;
  std::unordered_set<int64_t> sites;
};
inline CheckedSites checked_sites[kMaxLocalDevices];

inline bool NeedsCheck(const Call& c, int32_t device) {
  const int mode = check_mode.load(std::memory_order_relaxed);
  if (mode != kCheckFirstRun) return mode == kCheckEveryCall;
  if (c.size == 1) return false;  // nobody to disagree with
  if (c.site == 0) return true;
  CheckedSites& checked = checked_sites[device];
  std::lock_guard<std::mutex> lock(checked.mutex);
  return checked.sites.count(c.site) == 0;
}

// Only once the ranks agreed: a failed check fails on every rank, so every
// rank checks that site again next time.
inline void MarkChecked(const Call& c, int32_t device) {
  if (check_mode.load(std::memory_order_relaxed) != kCheckFirstRun || c.site == 0) return;
  CheckedSites& checked = checked_sites[device];
  std::lock_guard<std::mutex> lock(checked.mutex);
  checked.sites.insert(c.site);
}

constexpr int kDescriptionBytes = 256;
// Every mismatch message starts with this (Python looks for it, and users may).
constexpr const char* kMismatchPrefix = "mpicoll: ranks called different collectives";

// Compares `description` across the ranks of `comm`: "" if every rank has
// the same one, else a message listing every rank's.  Python uses it too, for
// a call that one rank rejects while another may be running it.
inline std::atomic<int64_t> comparisons_made{0};  // by this process (tests and benchmarks read it)

inline std::string CompareAcrossRanks(MPI_Comm comm, int rank, int size,
                                      const std::string& description) {
  comparisons_made.fetch_add(1, std::memory_order_relaxed);
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : description) hash = (hash ^ ch) * 1099511628211ull;
  long long value = static_cast<long long>(hash >> 2);  // keep -value representable
  long long extremes[2] = {value, -value};
  int rc = MPI_Allreduce(MPI_IN_PLACE, extremes, 2, MPI_LONG_LONG, MPI_MIN, comm);
  if (rc != MPI_SUCCESS) return "mpicoll: the check across ranks failed (MPI_Allreduce)";
  if (extremes[0] == -extremes[1]) return "";
  std::string all(static_cast<size_t>(kDescriptionBytes) * size, '\0');
  char mine[kDescriptionBytes] = {};
  std::strncpy(mine, description.c_str(), kDescriptionBytes - 1);
  rc = MPI_Allgather(mine, kDescriptionBytes, MPI_CHAR, all.data(), kDescriptionBytes, MPI_CHAR,
                     comm);
  std::string message = std::string(kMismatchPrefix) + " on " + CommName(comm) +
                        " (this is rank " + std::to_string(rank) + "):";
  for (int r = 0; rc == MPI_SUCCESS && r < size; ++r) {
    message += "\n  rank " + std::to_string(r) + ": " + (all.data() + r * kDescriptionBytes);
  }
  return message;
}

// The check before a call (see CheckMode).  Internal, like every error a
// running collective returns, so that JAX raises one type (JaxRuntimeError)
// whichever path dispatched the program.
inline ffi::Error CheckSameCall(const Call& c, int32_t device, const std::string& description) {
  if (!NeedsCheck(c, device)) return ffi::Error::Success();
  std::string mismatch = CompareAcrossRanks(c.comm, c.rank, c.size, description);
  if (!mismatch.empty()) return ffi::Error::Internal(mismatch);
  MarkChecked(c, device);
  return ffi::Error::Success();
}

inline std::string Describe(const Call& c, ffi::DataType dtype, ffi::Span<const int64_t> dims,
                     bool reduces, bool rooted) {
  std::string text = std::string(c.name) + "(" + DtypeName(dtype) + "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? "," : "") + std::to_string(dims[i]);
  text += "]";
  if (reduces && c.op >= 0 && c.op < kNumOps) text += std::string(", op=") + kReduceOps[c.op].name;
  if (rooted) text += ", root=" + std::to_string(c.root);
  return text + ")";
}

// ---------------------------------------------------------------------------
// What each local device is doing, for the watchdog (core/watchdog.h): the
// collective it is in, since when, its sequence number on its communicator
// and its call site; when it last left one.  A few relaxed atomic stores per
// call, so it is always on.
struct InFlight {
  std::atomic<int64_t> started_ns{0};
  std::atomic<const char*> name{nullptr};
  std::atomic<int> rank{-1};
  std::atomic<MPI_Comm> comm{MPI_COMM_NULL};
  std::atomic<int64_t> site{-1};
  std::atomic<uint64_t> sequence{0};
  std::atomic<int> dtype{0};
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> left_ns{0};  // when this device last left a collective
};
// One slot per local device, plus one for the communicator setup Python does
// collectively at a communicator's first use (MPI_Comm_dup per device): a rank
// that never reaches it would otherwise hang the others outside any collective.
constexpr int kSetupSlot = kMaxLocalDevices;
inline InFlight in_flight[kMaxLocalDevices + 1];
inline std::string setup_description;  // what kSetupSlot waits on (set from Python, under the GIL)
inline std::atomic<double> timeout_seconds{0.0};
inline std::atomic<double> stall_report_seconds{0.0};

inline const int64_t process_start_ns = NowNs();

// Ends the whole job after a report was written to stderr.  The launcher
// forwards a rank's output through a pipe, and on MPI_Abort it may tear the
// job down before reading what is still in it (seen with MPICH's hydra: the
// report, and even MPI_Abort's own line, lost in about one run in ten).  A
// short pause first lets it drain the pipe; the job is ending anyway.
[[noreturn]] inline void AbortJob(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort returned (it should not)
}

// The number of collectives each device has entered on each communicator: a
// collective's sequence number, the same on every rank that has reached it;
// and the communicator's identity for the flight records (made at its first
// collective).  Touched by the device's own (sequential) program only.  Kept
// by the communicator's table key, not its MPI_Comm: MPI reuses a freed
// communicator's handle, and a counter kept by handle would go on numbering
// (and naming) the old communicator's calls on the new one.  A freed key's
// entry stays (a few bytes per communicator freed): erasing it would race with
// the device threads, which take no lock here.
struct CommCounter {
  uint64_t sequence = 0;
  const CommIdentity* identity = nullptr;
};
inline std::unordered_map<int64_t, CommCounter> sequences[kMaxLocalDevices + 1];

// Marks a device as inside a collective for the watchdog, and records it
// (flight.h), for one scope.  new_call=false: a wait inside a call already
// counted (the local devices' meeting of the combined allreduce), which keeps
// its sequence number and is not recorded again.  queued_ns: when an
// overlapped call was queued on the device's progress thread (0: a synchronous
// call, queued when it starts).
struct InFlightScope {
  InFlight* slot = nullptr;
  FlightRecord* record = nullptr;
  bool failed = false;  // set by the caller when the collective returns an error
  InFlightScope(const Call& c, int32_t device, bool new_call = true, int64_t queued_ns = 0) {
    slot = &in_flight[device];
    slot->name.store(c.name, std::memory_order_relaxed);
    slot->rank.store(c.rank, std::memory_order_relaxed);
    slot->comm.store(c.comm, std::memory_order_relaxed);
    slot->site.store(c.site, std::memory_order_relaxed);
    CommCounter& counter = sequences[device][c.comm_key];
    const int64_t now = NowNs();
    if (new_call) {
      ++counter.sequence;
      if (Recording() && device < kMaxLocalDevices) {
        if (!counter.identity) counter.identity = IdentifyComm(c.comm);
        record = BeginRecord(device, c, counter.identity, counter.sequence, queued_ns, now);
      }
    }
    slot->sequence.store(counter.sequence, std::memory_order_relaxed);
    slot->dtype.store(static_cast<int>(c.dtype), std::memory_order_relaxed);
    slot->count.store(static_cast<int64_t>(c.in_count), std::memory_order_relaxed);
    slot->started_ns.store(now, std::memory_order_release);
  }
  ~InFlightScope() {
    const int64_t now = NowNs();
    FinishRecord(record, now, failed);
    slot->left_ns.store(now, std::memory_order_relaxed);
    slot->started_ns.store(0, std::memory_order_release);
  }
};

// ---------------------------------------------------------------------------
// Serialized MPI (one local device per process; _native.SERIALIZED): at
// MPI_THREAD_SERIALIZED, MPI allows calls from several threads (XLA's,
// Python's) but never two at once, and skips the locking MPI_THREAD_MULTIPLE
// costs every call.  mpicoll's own MPI calls take this one lock while the
// mode is on; Python makes each dispatch of a program with collectives
// complete before it returns, so the user's mpi4py calls never overlap them.
// Any other thread of mpicoll's that calls MPI (a progress thread) must hold
// it too.  Off (MULTIPLE): no lock, MPI does its own.
inline std::mutex serialized_mpi_mutex;
inline std::atomic<bool> serialize_mpi_calls{false};

// Holds serialized_mpi_mutex for one scope when the mode is on.
class SerializedMpiScope {
 public:
  SerializedMpiScope() {
    if (serialize_mpi_calls.load(std::memory_order_relaxed)) {
      lock_ = std::unique_lock<std::mutex>(serialized_mpi_mutex);
    }
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace mpicoll

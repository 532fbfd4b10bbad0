// What each local device is in, for the watchdog, the records and the reports:
// its in-flight slot, its sequence number on each communicator, and the scope
// that marks and records one call; and the abort that ends the job.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "../engine/call.h"
#include "../engine/comm_table.h"
#include "check.h"
#include "flight.h"
#include "totals.h"

namespace mpicoll {

// What each local device is doing, for the watchdog (watch/watchdog.h): the
// collective it is in (its facts, its communicator, sequence number and call
// site), whether it is still checking it across ranks, since when; when it
// last left one.  A few relaxed atomic stores per call, so it is always on.
enum CallPhase : int { kPhaseDone = 0, kPhaseChecking = 1, kPhaseRunning = 2, kPhaseSetup = 3 };
struct InFlight {
  std::atomic<int64_t> started_ns{0};
  std::atomic<const char*> name{nullptr};
  std::atomic<int> rank{-1};
  std::atomic<MPI_Comm> comm{MPI_COMM_NULL};
  std::atomic<const CommIdentity*> identity{nullptr};
  std::atomic<const CallFacts*> facts{nullptr};  // nullptr: a wait inside a call (local devices)
  std::atomic<int> phase{kPhaseDone};
  std::atomic<int64_t> site{-1};
  std::atomic<uint64_t> sequence{0};
  std::atomic<int> dtype{0};
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> left_ns{0};  // when this device last left a collective
};
// One slot per local device and XLA's (comm_table.h's kCallSlots), plus one for
// the communicator setup Python does collectively at a communicator's first use
// (MPI_Comm_dup per device): a rank that never reaches it would otherwise hang
// the others outside any collective.
constexpr int kSetupSlot = kCallSlots;
inline InFlight in_flight[kCallSlots + 1];

inline const int64_t process_start_ns = NowNs();

// Ends the whole job after a report was written to stderr.  The launcher
// forwards a rank's output through a pipe, and on MPI_Abort it may tear the
// job down before reading what is still in it (seen with MPICH's hydra: the
// report, and even MPI_Abort's own line, lost in about one run in ten).  A
// short pause first lets it drain the pipe; the job is ending anyway.
// MPI_Abort itself may not end this process: Open MPI 4.1's waits for its
// launcher to acknowledge, and a CI run saw a job outlive the abort's banner by
// minutes.  A process that has not ended kAbortBackstopSeconds later ends
// itself; a rank that ends without MPI_Finalize is one every launcher tears
// the job down for.
constexpr int kAbortBackstopSeconds = 10;
[[noreturn]] inline void AbortJob(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::thread([code] {
    std::this_thread::sleep_for(std::chrono::seconds(kAbortBackstopSeconds));
    std::fprintf(stderr, "mpicoll: MPI_Abort did not end this process in %d s: it exits\n",
                 kAbortBackstopSeconds);
    std::fflush(stderr);
    std::_Exit(code);
  }).detach();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort returned (it should not)
}

// The collectives each device has entered on each communicator: their count
// (a collective's sequence number, the same on every rank that has reached
// it), the last one's facts, and the communicator's identity (its name and
// members, the same on every rank: what the watchdogs compare and the records
// name).  Kept by the communicator's table key, not its MPI_Comm: MPI reuses
// a freed communicator's handle, and a counter kept by handle would go on
// numbering (and naming) the old communicator's calls on the new one.  A
// freed key's entry stays (a few bytes per communicator freed).  The device's
// own (sequential) program writes them; the watchdog reads them under
// `mutex`, which the device takes only to add a communicator.
struct CommCounter {
  std::atomic<uint64_t> sequence{0};
  std::atomic<const CallFacts*> last{nullptr};
  std::atomic<int64_t> last_site{0};  // the last call's site (call_sites.h)
  std::atomic<uint64_t> checked{0};  // the last call whose comparison across ranks ended
  std::atomic<int64_t> used_ns{0};
  const CommIdentity* identity = nullptr;
};
struct DeviceCounters {
  std::mutex mutex;
  std::unordered_map<int64_t, CommCounter> by_comm;
};
inline DeviceCounters counters[kCallSlots];

inline CommCounter& CounterOf(int32_t device, int64_t comm_key, MPI_Comm comm) {
  DeviceCounters& mine = counters[device];
  auto found = mine.by_comm.find(comm_key);  // only this device's thread adds: no lock
  if (found != mine.by_comm.end()) return found->second;
  const CommIdentity* identity = IdentifyComm(comm);
  std::lock_guard<std::mutex> lock(mine.mutex);
  CommCounter& counter = mine.by_comm[comm_key];
  counter.identity = identity;
  return counter;
}

// Marks a device as inside a collective for the watchdog, and records it
// (flight.h), for one scope.  new_call=false: a wait inside a call already
// counted (the local devices' meeting of the combined allreduce), which keeps
// its sequence number and is not recorded again.  queued_ns: when an
// overlapped call was queued on the device's progress thread (0: a synchronous
// call, queued when it starts).
struct InFlightScope {
  InFlight* slot = nullptr;
  CommCounter* counter = nullptr;  // the call's communicator's, on this device
  FlightRecord* record = nullptr;
  uint64_t sequence = 0;
  bool failed = false;  // set by the caller when the collective returns an error
  // The end-of-job summary's part (totals.h): the call's kind, bytes and start.
  Counted counted = Counted::kNo;
  int32_t device = 0;
  const char* kind = nullptr;
  int64_t bytes = 0, begun_ns = 0;
  InFlightScope(const Call& c, int32_t device, bool new_call = true, int64_t queued_ns = 0,
                const CallFacts* facts = nullptr, bool collective = true) {
    slot = &in_flight[device];
    slot->name.store(c.name, std::memory_order_relaxed);
    slot->rank.store(c.rank, std::memory_order_relaxed);
    slot->comm.store(c.comm, std::memory_order_relaxed);
    slot->site.store(c.site, std::memory_order_relaxed);
    slot->facts.store(facts, std::memory_order_relaxed);
    slot->phase.store(kPhaseRunning, std::memory_order_relaxed);
    CommCounter& counter = CounterOf(device, c.comm_key, c.comm);
    this->counter = &counter;
    const int64_t now = NowNs();
    // A point-to-point call (collective=false) involves two ranks of the
    // communicator only: it takes no sequence number (0), or the members'
    // numbers would drift apart.
    sequence = collective ? counter.sequence.load(std::memory_order_relaxed) : 0;
    this->device = device;
    if (new_call && (counted = BeginCounted(device)) != Counted::kNo) {
      kind = c.name;
      bytes = static_cast<int64_t>(c.in_count * c.elem_bytes);
      begun_ns = now;
    }
    if (new_call) {
      if (collective) {
        counter.sequence.store(++sequence, std::memory_order_relaxed);
        if (facts) counter.last.store(facts, std::memory_order_relaxed);
        counter.last_site.store(c.site, std::memory_order_relaxed);
      }
      counter.used_ns.store(now, std::memory_order_relaxed);
      if (Recording()) {
        record = BeginRecord(device, c, counter.identity, sequence, queued_ns, now);
      }
    }
    slot->identity.store(counter.identity, std::memory_order_relaxed);
    slot->sequence.store(sequence, std::memory_order_relaxed);
    slot->dtype.store(static_cast<int>(c.dtype), std::memory_order_relaxed);
    slot->count.store(static_cast<int64_t>(c.in_count), std::memory_order_relaxed);
    slot->started_ns.store(now, std::memory_order_release);
  }
  ~InFlightScope() {
    const int64_t now = NowNs();
    FinishRecord(record, now, failed);
    EndCounted(device, counted, kind, now - begun_ns, bytes);
    slot->left_ns.store(now, std::memory_order_relaxed);
    slot->started_ns.store(0, std::memory_order_release);
  }
};

}  // namespace mpicoll

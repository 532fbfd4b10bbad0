// The guard around every MPI call mpicoll makes: check mode (the ranks agree
// on what they call), the timeout watchdog, and the serialized-MPI lock.
#pragma once

#include <mpi.h>

#include <algorithm>
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
#include <vector>

#include "../engine/call.h"
#include "../engine/comm_table.h"
#include "../engine/dtypes.h"
#include "flight.h"
#include "python_stacks.h"
#include "totals.h"
#include "../engine/reduce_ops.h"
#include "../engine/test_kill.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------
// Checks: the ranks compare a fingerprint of what they are about to call (op,
// dtype, shape, root, reduction, and its sequence number on the communicator)
// before the call.  On a mismatch every rank gets an error listing what each
// rank called, instead of a hang, an MPI abort or garbage.  The comparison
// runs on the communicator's internal duplicate (DeviceComm::internal), never
// on the data communicator: a rank that checks while another does not then
// waits (and the watchdog names both calls within a second, watchdog.h)
// instead of handing its check's bytes to the other rank's data collective.
//
// It costs one small allreduce, so by default (kCheckFirstRun) a call is
// checked when its description is new on its communicator, and never again;
// kCheckEveryCall checks every call (MPICOLL_CHECK=1) and compares the call
// sites too, so two programs called in a different order are caught even
// where their collectives are alike.  "New" is decided by the description,
// not the call site, so that every rank decides alike: a rank that compiled
// a new program around a call the ranks already agreed on does not check it
// while the others skip it.
enum CheckMode : int { kCheckOff = 0, kCheckFirstRun = 1, kCheckEveryCall = 2 };

// The watch's settings (MPICOLL_CHECK, MPICOLL_TIMEOUT, MPICOLL_STALL_REPORT),
// set from Python (module.cc, module_watch.cc) and read by the devices and
// the watchdog at any time.
struct WatchSettings {
  std::atomic<int> check_mode{kCheckFirstRun};
  std::atomic<double> timeout_seconds{0.0};       // 0: none
  std::atomic<double> stall_report_seconds{0.0};  // 0: none
  // Test only (extension._pause_after_mismatch): seconds a rank waits after a
  // comparison that found a mismatch, still in the checking phase, as a rank
  // descheduled there would: the others finish theirs and move on first.
  std::atomic<double> pause_after_mismatch{0.0};
};
inline WatchSettings watch_settings;

inline uint64_t Fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ull) {
  for (unsigned char ch : text) hash = (hash ^ ch) * 1099511628211ull;
  return hash;
}

inline uint64_t MixHash(uint64_t hash, uint64_t value) {
  for (int i = 0; i < 8; ++i) hash = (hash ^ ((value >> (8 * i)) & 0xff)) * 1099511628211ull;
  return hash;
}

// What the ranks compare about a call: its description, e.g.
// "allreduce(float32[4], op=sum)", and that text's hash.  Made once per call
// site and device, interned and kept for the process, so that the watchdog
// reads a waiting call's description through a plain pointer.
struct CallFacts {
  std::string description;
  uint64_t hash;
};

// Per local device (each runs its own copy of a program, on its own
// communicators): the facts of each call site (sites are numbered by Python
// when it lowers a call; 0 is a call with no site, described each time), and
// the descriptions the ranks agreed on, per communicator.
struct SiteChecks {
  const CallFacts* facts = nullptr;
  uint64_t site_hash = 0;  // the site's source line, for every-call checks
  bool agreed = false;     // its call was agreed on (first-run: never checked again)
};
struct DeviceChecks {
  std::mutex mutex;
  std::unordered_map<int64_t, SiteChecks> sites;
  std::unordered_map<uint64_t, CallFacts*> interned;  // description hash -> facts
  std::unordered_set<uint64_t> agreed;                // MixHash(description hash, comm key)
};
inline DeviceChecks device_checks[kCallSlots];

inline const CallFacts* Intern(DeviceChecks& checks, std::string description) {
  const uint64_t hash = Fnv1a(description);
  CallFacts*& facts = checks.interned[hash];
  if (!facts) facts = new CallFacts{std::move(description), hash};  // kept for the process
  return facts;
}

// Whether a call is checked, and its facts (for the check, the watchdog and
// the records).  The description is made at a site's first run only.
struct CheckPlan {
  const CallFacts* facts = nullptr;
  uint64_t site_hash = 0;
  bool check = false;
};

template <typename Describe>
CheckPlan PlanCheck(const Call& c, int32_t device, Describe&& describe) {
  const int mode = watch_settings.check_mode.load(std::memory_order_relaxed);
  DeviceChecks& checks = device_checks[device];
  std::lock_guard<std::mutex> lock(checks.mutex);
  CheckPlan plan;
  SiteChecks* site = nullptr;
  if (c.site != 0) {
    site = &checks.sites[c.site];
    if (!site->facts) {
      // A jax.lax collective is described as the user wrote it, then as mpicoll
      // runs it: "jax.lax.psum over (...) of float32[2] per device: allreduce(...)".
      const std::string written_as = SiteWrittenAs(c.site);
      site->facts = Intern(checks, written_as.empty() ? describe() : written_as + ": " + describe());
      site->site_hash = SiteCompared(c.site) ? Fnv1a(SiteText(c.site)) : 0;
    }
    plan.facts = site->facts;
    plan.site_hash = site->site_hash;
  } else {
    plan.facts = Intern(checks, describe());
  }
  if (c.size == 1 || mode == kCheckOff) return plan;  // nobody to disagree with
  if (mode == kCheckEveryCall) {
    plan.check = true;
  } else if (!(site && site->agreed)) {
    const bool agreed = checks.agreed.count(MixHash(plan.facts->hash, c.comm_key)) != 0;
    if (agreed && site) site->agreed = true;
    plan.check = !agreed;
  }
  return plan;
}

// Only once the ranks agreed: a failed check fails on every rank, so every
// rank checks that call again next time, and the agreed sets stay the same on
// every rank of the communicator.
inline void MarkAgreed(const Call& c, int32_t device, const CallFacts* facts) {
  DeviceChecks& checks = device_checks[device];
  std::lock_guard<std::mutex> lock(checks.mutex);
  checks.agreed.insert(MixHash(facts->hash, c.comm_key));
  if (c.site != 0) checks.sites[c.site].agreed = true;
}

constexpr int kDescriptionBytes = 768;  // a call as written, as run, and its source line
// Every mismatch message starts with this (Python looks for it, and users may).
constexpr const char* kMismatchPrefix = "mpicoll: ranks called different collectives";

// Every rank's description, gathered once a comparison found that the ranks
// differ (every rank of `comm` finds it alike, so every rank takes part).
template <typename DescribeText>
std::string MismatchMessage(MPI_Comm comm, const std::string& comm_name, int rank, int size,
                            DescribeText&& describe) {
  std::string all(static_cast<size_t>(kDescriptionBytes) * size, '\0');
  char mine[kDescriptionBytes] = {};
  std::strncpy(mine, describe().c_str(), kDescriptionBytes - 1);
  const int rc = MPI_Allgather(mine, kDescriptionBytes, MPI_CHAR, all.data(), kDescriptionBytes,
                               MPI_CHAR, comm);
  std::string message = std::string(kMismatchPrefix) + " on " + UserCommName(comm_name) +
                        " (this is rank " + std::to_string(rank) + "):";
  if (rc != MPI_SUCCESS) {  // a rank was lost while the ranks told each other their calls
    return MpiFailureText("mpicoll: the check across ranks (MPI_Allgather of the calls) on " +
                              comm_name + " failed on rank " + std::to_string(rank),
                          comm, rc);
  }
  for (int r = 0; r < size; ++r) {
    message += "\n  rank " + std::to_string(r) + ": " + (all.data() + r * kDescriptionBytes);
  }
  return message;
}

// Every check is one MPI_Allgather of a fixed-size record per rank on the
// checks' communicator: its fingerprint, and, for a small allreduce checked on
// every call, its block (engine/execute.h: the check then is the collective).
// Every rank sends the same size whatever it calls, so any two checks meet
// and compare, and a mismatched shape never truncates a message.
constexpr size_t kCheckRecordsBytes = 4096;  // every rank's records together

inline size_t CheckRecordBytes(int size) {
  return std::max<size_t>(16, kCheckRecordsBytes / static_cast<size_t>(size) / 16 * 16);
}

// Compares `fingerprint` across the ranks of `comm`: "" if every rank has the
// same one, else a message listing every rank's `describe()`.  `block`
// (bytes, at most CheckRecordBytes - 16) travels with it; every rank's
// records are left in `records` (record r at r * CheckRecordBytes(size)).
inline std::atomic<int64_t> comparisons_made{0};  // by this process (tests and benchmarks read it)

template <typename DescribeText>
std::string CompareAcrossRanks(MPI_Comm comm, const std::string& comm_name, int rank, int size,
                               uint64_t fingerprint, DescribeText&& describe,
                               const char* block = nullptr, size_t bytes = 0,
                               std::vector<char>* records = nullptr) {
  comparisons_made.fetch_add(1, std::memory_order_relaxed);
  const size_t stride = CheckRecordBytes(size);
  thread_local std::vector<char> mine, gathered;  // per device thread
  std::vector<char>& all = records ? *records : gathered;
  mine.assign(stride, 0);
  all.resize(stride * size);
  std::memcpy(mine.data(), &fingerprint, sizeof(fingerprint));
  if (bytes) std::memcpy(mine.data() + 16, block, bytes);
  TestKillAt("check");
  const int rc = MPI_Allgather(mine.data(), static_cast<int>(stride), MPI_BYTE, all.data(),
                               static_cast<int>(stride), MPI_BYTE, comm);
  // A failed check is a failed collective: where a rank was lost, the same path
  // (the communicators revoked, so every survivor wakes; then mpicoll.RankLost).
  if (rc != MPI_SUCCESS) {
    return MpiFailureText("mpicoll: the check across ranks (MPI_Allgather) on " + comm_name +
                              " failed on rank " + std::to_string(rank),
                          comm, rc);
  }
  for (int r = 0; r < size; ++r) {
    if (std::memcmp(all.data() + r * stride, &fingerprint, sizeof(fingerprint)) != 0) {
      return MismatchMessage(comm, comm_name, rank, size, describe);
    }
  }
  return "";
}

// Where the checks talk: the internal duplicate (the host-staged test entry
// has none, and checks on its one communicator).
inline MPI_Comm CheckComm(const Call& c) {
  return c.internal_comm != MPI_COMM_NULL ? c.internal_comm : c.comm;
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
  std::atomic<int64_t> last_site{0};  // the last call's site (flight.h's CallSites)
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

// What a check compares, once the call's InFlightScope is open: the
// description's hash and the call's sequence number (two alike calls at
// different places in the ranks' programs do not agree), and in every-call
// mode its call site.
inline uint64_t Fingerprint(const CheckPlan& plan, const InFlightScope& watched) {
  const uint64_t fingerprint = MixHash(plan.facts->hash, watched.sequence);
  return watch_settings.check_mode.load(std::memory_order_relaxed) == kCheckEveryCall
             ? MixHash(fingerprint, plan.site_hash) : fingerprint;
}

// This rank's line of a mismatch message, with the user's source line of the
// call where it is known: a jitted call's; for a site whose lowered line may be
// another call's (an eager call's program was lowered by its first caller), the
// main thread's stack while it waits in the call, else that line.  The error
// surfaces where JAX next waits on the program (often a later line), so the
// message must say where the collective is.
inline std::string CheckedCallText(const Call& c, const CheckPlan& plan,
                                   const InFlightScope& watched) {
  std::string text = plan.facts->description + ", sequence " + std::to_string(watched.sequence);
  std::string site;
  if (c.site != 0 && !SiteCompared(c.site)) site = MainThreadCallerLine();
  if (c.site != 0 && site.empty()) site = SiteText(c.site);
  return site.empty() ? text : text + ", called at " + site;
}

inline void PauseAfterMismatchForTests(const std::string& mismatch) {
  const double seconds = watch_settings.pause_after_mismatch.load(std::memory_order_relaxed);
  if (!mismatch.empty() && seconds > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
}

// The check before a call (see CheckMode).  Internal, like every error a
// running collective returns, so that JAX raises one type (JaxRuntimeError)
// whichever path dispatched the program.
inline ffi::Error CheckSameCall(const Call& c, int32_t device, const CheckPlan& plan,
                                const InFlightScope& watched) {
  if (!plan.check) return ffi::Error::Success();
  watched.slot->phase.store(kPhaseChecking, std::memory_order_relaxed);
  std::string mismatch = CompareAcrossRanks(
      CheckComm(c), CommName(c.comm), c.rank, c.size, Fingerprint(plan, watched),
      [&] { return CheckedCallText(c, plan, watched); });
  PauseAfterMismatchForTests(mismatch);
  watched.slot->phase.store(kPhaseRunning, std::memory_order_relaxed);
  watched.counter->checked.store(watched.sequence, std::memory_order_relaxed);
  if (!mismatch.empty()) return ffi::Error::Internal(mismatch);
  MarkAgreed(c, device, plan.facts);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
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

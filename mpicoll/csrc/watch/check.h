// The check across ranks (check mode): before a call, the ranks agree on what
// they call.  guard.h runs it inside the call's in-flight scope (in_flight.h).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../engine/call.h"
#include "../engine/comm_table.h"
#include "../engine/dtypes.h"
#include "../engine/reduce_ops.h"
#include "../engine/test_kill.h"
#include "call_sites.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

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

}  // namespace mpicoll

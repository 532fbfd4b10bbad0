// The guard around every MPI call mpicoll makes: the call's in-flight scope
// for the watchdog and the records (in_flight.h), the check across ranks
// before it (check.h), and the serialized-MPI lock (serialized.h).  The engine
// enters the watch through it alone.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "../engine/call.h"
#include "call_sites.h"
#include "check.h"
#include "flight.h"
#include "in_flight.h"
#include "python_stacks.h"
#include "serialized.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

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

}  // namespace mpicoll

// What the records and the reports call things: a call site as the user's
// source line (registered from Python when a call is lowered, with the
// collective as written where a jax.lax call was routed to mpicoll), a
// communicator by the user's name, a watch slot by what its calls are.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "../engine/comm_table.h"

namespace mpicoll {

// The user's name of a communicator: mpicoll's duplicates are named
// "mpicoll:<name>:device<k>" (comm.py).  Records keep the full name.
inline std::string UserCommName(std::string name) {
  const std::string prefix = "mpicoll:";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  const size_t device = name.rfind(":device");
  return device == std::string::npos ? name : name.substr(0, device);
}

// Call sites as the user's source lines (set from Python when a call is lowered).
struct CallSites {
  std::mutex mutex;
  std::map<int64_t, std::string> descriptions;  // site -> "file:line (function)"
  std::map<int64_t, std::string> written_as;    // site -> "jax.lax.psum over (...)"
  std::set<int64_t> uncompared;                 // eager calls' (module_watch.cc)
};
inline CallSites call_sites;

// The collective as the user wrote it, where that is not mpicoll's own call
// (a jax.lax collective routed to mpicoll), else "".
inline std::string SiteWrittenAs(int64_t site) {
  std::lock_guard<std::mutex> lock(call_sites.mutex);
  auto found = call_sites.written_as.find(site);
  return found == call_sites.written_as.end() ? std::string() : found->second;
}

inline bool SiteCompared(int64_t site) {
  std::lock_guard<std::mutex> lock(call_sites.mutex);
  return call_sites.uncompared.count(site) == 0;
}

inline std::string SiteText(int64_t site) {
  std::lock_guard<std::mutex> lock(call_sites.mutex);
  auto found = call_sites.descriptions.find(site);
  return found == call_sites.descriptions.end() ? std::string() : found->second;
}

// What a watch slot's calls are, in reports and records: "local device 1", or
// "XLA's own collectives" (from kXlaSlot up).
inline std::string SlotName(int slot) {
  return slot >= kXlaSlot ? "XLA's own collectives" : "local device " + std::to_string(slot);
}

}  // namespace mpicoll

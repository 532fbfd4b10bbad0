// Communication totals for the end-of-job summary (MPICOLL_SUMMARY=1,
// observe/summary.py): per watch slot (a local device, or XLA's own
// collectives) and collective kind, the calls, the time spent in them and the
// bytes given.  Off by default: then a call pays one relaxed load.
//
// A slot's time counts its outermost call only: a call that runs inside
// another on the same slot (the leader's MPI call of a meeting of local
// devices, on the device's thread or its progress thread) is the same time.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "../engine/comm_table.h"

namespace mpicoll {

struct KindTotals {
  const char* kind = nullptr;  // the call's name (a static string)
  int64_t calls = 0, ns = 0, bytes = 0, max_ns = 0;
};

struct SlotTotals {
  std::mutex mutex;                 // the slot's calls add, Python reads at exit
  std::vector<KindTotals> kinds;    // a handful of kinds: a linear search
  std::atomic<int> depth{0};        // calls open on the slot now
};

struct CommunicationTotals {
  std::atomic<bool> on{false};
  SlotTotals slots[kCallSlots];
};
inline CommunicationTotals communication_totals;

// A call's part in the totals: not counted (the summary is off), inside
// another call of its slot, or the slot's outermost (its time is counted).
enum class Counted : uint8_t { kNo, kInner, kOutermost };

inline Counted BeginCounted(int slot) {
  if (!communication_totals.on.load(std::memory_order_relaxed)) return Counted::kNo;
  return communication_totals.slots[slot].depth.fetch_add(1, std::memory_order_relaxed) == 0
             ? Counted::kOutermost : Counted::kInner;
}

inline void EndCounted(int slot, Counted counted, const char* kind, int64_t ns, int64_t bytes) {
  if (counted == Counted::kNo) return;
  SlotTotals& totals = communication_totals.slots[slot];
  totals.depth.fetch_sub(1, std::memory_order_relaxed);
  if (counted != Counted::kOutermost || !kind) return;
  std::lock_guard<std::mutex> lock(totals.mutex);
  KindTotals* found = nullptr;
  for (KindTotals& k : totals.kinds) {
    if (k.kind == kind || std::strcmp(k.kind, kind) == 0) { found = &k; break; }
  }
  if (!found) {
    totals.kinds.push_back(KindTotals{kind});
    found = &totals.kinds.back();
  }
  found->calls += 1;
  found->ns += ns;
  found->bytes += bytes;
  if (ns > found->max_ns) found->max_ns = ns;
}

}  // namespace mpicoll

// XLA's calls under mpicoll's watch (watch/guard.h): each is described for what
// XLA inserted ("all-reduce(float32[8], op=sum), inserted by XLA"), counted in
// XLA's watch slot, recorded, and checked across ranks where check mode says so.
// Only jax_calls.cc includes it.
#pragma once

#include <mpi.h>

#include <atomic>
#include <mutex>
#include <string>

#include "../engine/call.h"
#include "../watch/call_sites.h"
#include "../watch/guard.h"
#include "../watch/rank_state.h"
#include "xla_handles.h"

namespace mpicoll {
namespace jax_mpi {

// A communicator's collectives come one at a time (XLA runs a device's program
// in order; with several devices a group's leader alone calls MPI), so a slot
// has one call in it.  A second call at once (two members' messages of one
// all-to-all, two communicators in one slot) runs unwatched rather than share
// the slot's state, which one thread at a time writes.
inline std::atomic<bool> xla_slot_taken[kXlaSlots];

// What XLA's call is, for the watch: its name and buffers as mpicoll's Call.
inline Call XlaCall(const char* name, const CommBox& comm, const TypeFacts& type, size_t count,
                    const void* in, void* out) {
  Call c{};
  c.name = name;
  c.comm = comm.comm;
  c.internal_comm = comm.internal;
  c.comm_key = comm.key;
  c.rank = comm.rank;
  c.size = comm.size;
  c.root = -1;
  c.op = -1;
  c.type = type.mpi;
  c.mpi_op = MPI_OP_NULL;
  c.elem_bytes = type.bytes;
  c.in = static_cast<char*>(const_cast<void*>(in));
  c.out = static_cast<char*>(out);
  c.in_count = count;
  c.out_count = count;
  c.dtype = type.dtype;
  return c;
}

// "all-reduce(float32[8], op=sum), inserted by XLA": what the ranks compare
// and the reports name.
inline std::string Described(const Call& c, const char* op_name, const std::string& more = "") {
  std::string text = std::string(c.name) + "(" + DtypeName(c.dtype) + "[" +
                     std::to_string(c.in_count) + "]";
  if (op_name) text += std::string(", op=") + op_name;
  return text + more + "), inserted by XLA";
}

// How the watch counts a call: a collective the ranks compare (check mode), one
// they do not (a split: each rank names its own group), or a message between
// two ranks (no sequence number on the communicator).
enum class Kind { kCompared, kCollective, kPointToPoint };

// Runs `run` (its MPI call) as mpicoll runs its own collectives: watched in XLA's
// slot, recorded, and checked across ranks where check mode says so (kCompared).
// Returns MPI_SUCCESS, or kWatchedFailure with failure_text set.
template <typename Run>
inline int Watched(Call& c, const CommBox& box, Kind kind, const std::string& description,
                   Run&& run) {
  const int slot = box.slot;
  std::atomic<bool>& taken = xla_slot_taken[slot - kXlaSlot];
  bool free_slot = false;
  if (!taken.compare_exchange_strong(free_slot, true, std::memory_order_acquire)) return run();
  struct Release {
    std::atomic<bool>& taken;
    ~Release() { taken.store(false, std::memory_order_release); }
  } release{taken};
  SerializedMpiScope serialized;
  CheckPlan plan = PlanCheck(c, slot, [&] { return description; });
  const int mode = watch_settings.check_mode.load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(box.agreed_mutex);
    plan.check = kind == Kind::kCompared && c.size > 1 &&
                 (mode == kCheckEveryCall ||
                  (mode == kCheckFirstRun && box.agreed.count(plan.facts->hash) == 0));
  }
  InFlightScope watched(c, slot, /*new_call=*/true, /*queued_ns=*/0, plan.facts,
                        /*collective=*/kind != Kind::kPointToPoint);
  if (ffi::Error err = CheckSameCall(c, slot, plan, watched); err.failure()) {
    watched.failed = true;
    failure_text = err.message();
    return kWatchedFailure;
  }
  if (plan.check) {
    std::lock_guard<std::mutex> lock(box.agreed_mutex);
    box.agreed.insert(plan.facts->hash);
  }
  const int rc = run();
  if (rc == MPI_SUCCESS) return rc;
  watched.failed = true;
  failure_text = MpiFailureText("mpicoll: XLA's " + description + " failed on rank " +
                                    std::to_string(c.rank) + " of " +
                                    UserCommName(CommName(c.comm)),
                                c.comm, rc,
                                std::string(" (") + kRankLostMarker + ": mpicoll.RankLost)");
  return kWatchedFailure;
}

}  // namespace jax_mpi
}  // namespace mpicoll

// XLA's collectives where a process has several CPU devices (xla_groups.h says
// the design): each device's communicator is its place in a group of devices; the
// group's members meet in the process, and its leader alone calls MPI over the
// group's processes, watched there.  Only jax_calls.cc includes it.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../watch/rank_state.h"
#include "xla_groups.h"
#include "xla_handles.h"
#include "xla_watched.h"

namespace mpicoll {
namespace jax_mpi {

// The watch's box of a group's processes (made once, by its first use: no MPI).
inline CommBox* ProcessesBox(xla_groups::Group& g) {
  if (g.watched) return static_cast<CommBox*>(g.watched);
  auto* box = new CommBox;  // kept with the group
  box->comm = g.processes;
  box->internal = g.checks;
  Key(box);
  MPI_Comm_rank(g.processes, &box->rank);
  MPI_Comm_size(g.processes, &box->size);
  g.watched = box;
  return box;
}

inline int GroupSplit(int color, int key, uintptr_t* made) {
  xla_groups::Place place;
  std::string failure;
  // The round's gather, watched on XLA's COMM_WORLD: a process that never makes
  // its devices' communicators (it does not run the program) is named.
  auto gather = [&](auto&& run, std::string* why) {
    Call c = XlaCall("communicator split", jax_world, TypeFacts{MPI_INT, ffi::DataType::S32, 4},
                     0, nullptr, nullptr);
    const int rc = Watched(c, jax_world, Kind::kCollective, "communicator split(), made by XLA",
                           run);
    if (rc == kWatchedFailure) *why = failure_text;
    return rc;
  };
  // A round whose other local devices do not come: said once at the stall report's
  // time, and the job ended at MPICOLL_TIMEOUT, as for a wait in a collective.
  bool said = false;
  auto waiting = [&](double seconds, int arrived) {
    const double stall = watch_settings.stall_report_seconds.load();
    const double limit = watch_settings.timeout_seconds.load();
    const bool end = limit > 0 && seconds >= limit;
    if (!(end || (!said && stall > 0 && seconds >= stall))) return;
    said = true;
    std::fprintf(stderr,
                 "mpicoll: rank %d: %d of this process's %d CPU devices have waited %.1f s for "
                 "the others to make XLA's communicators for their groups: a program with "
                 "collectives on some of a process's devices only (XLA's MPI path needs every "
                 "device of every process; run it with MPICOLL_JAX_COLLECTIVES=gloo)%s\n",
                 jax_world.rank, arrived, splits.local_devices, seconds,
                 end ? "; aborting the job (MPICOLL_TIMEOUT)" : "");
    std::fflush(stderr);
    if (end) AbortJob(3);
  };
  const int rc = xla_groups::Split(jax_world.comm, splits, color, key, &place, &failure, gather,
                                   waiting);
  if (rc != MPI_SUCCESS) {
    failure_text = failure.empty() ? "mpicoll: making XLA's groups failed" : failure;
    return rc < 0 ? kWatchedFailure : rc;
  }
  if (!place.group) return kUnknownHandle;
  auto* box = new CommBox;
  box->comm = place.group->processes;
  box->place = place;
  box->rank = place.member;
  box->size = place.group->size;
  Key(box);
  box->slot = ProcessesBox(*place.group)->slot;  // its messages share the group's slot
  *made = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

// The leader's MPI call over a group's processes, watched there (`members` of
// the group's devices described), or nothing where the group is all here.
template <typename Run>
inline int OverProcesses(xla_groups::Group& g, const char* name, const TypeFacts& type,
                         size_t count, const char* op_name, Run&& run) {
  CommBox& processes = *ProcessesBox(g);
  if (processes.size == 1) return MPI_SUCCESS;
  Call c = XlaCall(name, processes, type, count, nullptr, nullptr);
  const std::string description =
      Described(c, op_name, ", " + std::to_string(g.size) + " devices");
  const int rc = Watched(c, processes, Kind::kCompared, description, std::forward<Run>(run));
  return rc;
}

// One call of a group's meeting (xla_groups::Meet): `lead(sends, receives)`
// runs in its leader and returns an MPI code, or kWatchedFailure with this
// thread's failure_text set; every member returns the same, its failure text
// copied to its own thread.
template <typename Lead>
inline int GroupMeeting(const CommBox& box, const void* send, void* receive, Lead&& lead) {
  xla_groups::Group& g = *box.place.group;
  std::string failure;
  const int rc = xla_groups::Meet(
      g, g.LocalIndex(box.place.member), send, receive, &failure,
      [&](const std::vector<const void*>& sends, const std::vector<void*>& receives,
          std::string* why) {
        const int rc = lead(sends, receives);
        if (rc == kWatchedFailure) *why = failure_text;
        return rc;
      });
  if (rc == MPI_SUCCESS) return rc;
  if (rc == kWatchedFailure || rc < 0) {
    failure_text = failure;
    return kWatchedFailure;
  }
  return rc;
}

// The local members' inputs reduced into `total` (count elements), then over
// the group's processes (what all-reduce and reduce-scatter share).
inline int ReduceOverGroup(xla_groups::Group& g, const std::vector<const void*>& sends, char* total,
                           int count, const TypeFacts& type, MPI_Op op, const char* name,
                           const char* op_name) {
  if (total != sends[0]) std::memmove(total, sends[0], static_cast<size_t>(count) * type.bytes);
  int rc = MPI_SUCCESS;
  for (size_t i = 1; i < sends.size() && rc == MPI_SUCCESS; ++i) {
    rc = MPI_Reduce_local(sends[i], total, count, type.mpi, op);
  }
  if (rc != MPI_SUCCESS) return rc;
  return OverProcesses(g, name, type, count, op_name, [&] {
    return MPI_Allreduce(MPI_IN_PLACE, total, count, type.mpi, op, g.processes);
  });
}

inline int GroupAllreduce(const CommBox& box, const void* send, void* receive, int count,
                          const TypeFacts& type, MPI_Op op, const char* op_name) {
  xla_groups::Group& g = *box.place.group;
  return GroupMeeting(box, send, receive, [&](const std::vector<const void*>& sends,
                                              const std::vector<void*>& receives) {
    char* total = static_cast<char*>(receives[0]);
    const int rc = ReduceOverGroup(g, sends, total, count, type, op, "all-reduce", op_name);
    for (size_t i = 1; i < receives.size() && rc == MPI_SUCCESS; ++i) {
      std::memcpy(receives[i], total, static_cast<size_t>(count) * type.bytes);
    }
    return rc;
  });
}

inline int GroupAllgather(const CommBox& box, const void* send, int count, const TypeFacts& type,
                          void* receive) {
  xla_groups::Group& g = *box.place.group;
  return GroupMeeting(box, send, receive, [&](const std::vector<const void*>& sends,
                                              const std::vector<void*>& receives) {
    const size_t block = static_cast<size_t>(count) * type.bytes;
    char* whole = static_cast<char*>(receives[0]);
    int rc = MPI_SUCCESS;
    CommBox& processes = *ProcessesBox(g);
    if (processes.size == 1) {
      for (size_t i = 0; i < sends.size(); ++i) {
        std::memcpy(whole + g.local[i] * block, sends[i], block);
      }
    } else {
      // This process's blocks in member order, every process's gathered in
      // process order, then each block put at its member's place.
      std::vector<char>& packed = g.scratch;
      packed.resize(block * (sends.size() + g.size));
      for (size_t i = 0; i < sends.size(); ++i) {
        std::memcpy(packed.data() + i * block, sends[i], block);
      }
      char* gathered = packed.data() + block * sends.size();
      std::vector<int> counts(processes.size), offsets(processes.size);
      for (int p = 0, at = 0; p < processes.size; ++p) {
        counts[p] = static_cast<int>(g.members_of[p].size() * block);
        offsets[p] = at;
        at += counts[p];
      }
      rc = OverProcesses(g, "all-gather", type, count, nullptr, [&] {
        return MPI_Allgatherv(packed.data(), counts[processes.rank], MPI_BYTE, gathered,
                              counts.data(), offsets.data(), MPI_BYTE, g.processes);
      });
      for (int p = 0; rc == MPI_SUCCESS && p < processes.size; ++p) {
        for (size_t k = 0; k < g.members_of[p].size(); ++k) {
          std::memcpy(whole + g.members_of[p][k] * block, gathered + offsets[p] + k * block,
                      block);
        }
      }
    }
    for (size_t i = 1; i < receives.size() && rc == MPI_SUCCESS; ++i) {
      std::memcpy(receives[i], whole, block * g.size);
    }
    return rc;
  });
}

// Each member's block of the sum: the whole reduced once per process (an
// all-reduce over the processes), then each member takes its own block.
inline int GroupReduceScatter(const CommBox& box, const void* send, void* receive,
                              const int* counts, const TypeFacts& type, MPI_Op op,
                              const char* op_name) {
  xla_groups::Group& g = *box.place.group;
  std::vector<size_t> offsets(g.size + 1, 0);
  for (int m = 0; m < g.size; ++m) offsets[m + 1] = offsets[m] + static_cast<size_t>(counts[m]);
  const size_t total = offsets[g.size];
  if (total > static_cast<size_t>(INT32_MAX)) return kUnsupportedType;
  return GroupMeeting(box, send, receive, [&](const std::vector<const void*>& sends,
                                              const std::vector<void*>& receives) {
    std::vector<char>& sum = g.scratch;
    sum.resize(total * type.bytes);
    const int rc = ReduceOverGroup(g, sends, sum.data(), static_cast<int>(total), type, op,
                                   "reduce-scatter", op_name);
    for (size_t i = 0; i < receives.size() && rc == MPI_SUCCESS; ++i) {
      const int m = g.local[i];
      std::memcpy(receives[i], sum.data() + offsets[m] * type.bytes,
                  static_cast<size_t>(counts[m]) * type.bytes);
    }
    return rc;
  });
}

// A message between two members: (process, tag) on the group's messages
// communicator (xla_groups.h).
struct Route {
  int process;
  int tag;
};
// This member's message to `destination` and from `source` (members, or the
// ABI's PROC_NULL, which is not every MPI's); false for a member the group does
// not have.
inline bool RoutesOf(const CommBox& box, int destination, int source, Route* to, Route* from) {
  const xla_groups::Group& g = *box.place.group;
  const int me = box.place.member;
  auto route = [&](int peer, int sender, int receiver, Route* out) {
    if (RankOf(peer) == MPI_PROC_NULL) {
      *out = {MPI_PROC_NULL, 0};
      return true;
    }
    if (peer < 0 || peer >= g.size) return false;
    *out = {g.process_of[peer], sender * g.size + receiver};
    return true;
  };
  return route(destination, me, destination, to) && route(source, source, me, from);
}

}  // namespace jax_mpi
}  // namespace mpicoll

// XLA's groups of devices over P processes × L local devices (L > 1): what lets
// JAX's CPU collectives run on mpicoll's MPI with several devices per process.
//
// XLA's MPI collectives make one communicator per device and group ("clique"):
// each device's own thread calls MPI_Comm_split(COMM_WORLD, color = the group's
// first device id, key = the device's rank in the group), and then calls the
// collectives on it from that thread, as if each device were an MPI process.
// MPI has one rank per process, so here a group is made of its members (the
// devices, ranked by key) over one communicator of the processes that hold them:
//
//   * Splits come in rounds: XLA makes a group's communicators the first time the
//     group's collective runs, and in an SPMD program every device of a process
//     takes part in every collective (in one group each), so each round has one
//     call from each of the L local devices.  The last to arrive gathers every
//     process's (color, key) pairs (one MPI_Allgather on XLA's COMM_WORLD) and
//     makes, in color order, a communicator of the processes of each group this
//     process has members in (MPI_Comm_create_group: only they take part).
//   * A collective on a group is a meeting of its local members: the last to
//     arrive (the leader) combines their buffers, runs the one MPI call over the
//     group's processes, and hands each member its part.  A group whose members
//     are all in this process needs no MPI; one with a single member here skips
//     the meeting.
//   * A message between two members (all-to-all's Sendrecv, collective-permute's
//     Isend/Irecv) goes from the sender's process to the receiver's on the group's
//     own duplicate for messages, tagged sender × size + receiver, so that MPI's
//     order per (process, tag) keeps each pair's messages in order.
//
// Why this cannot deadlock (docs/design.md has the same argument for mpicoll's
// own local meeting): a meeting waits only for this process's members of one
// group, which run the same program in the same order on their own threads, and
// a device in collective k has finished collective k - 1 (a meeting ends for all
// its members at once).  So every local member of the group reaches collective k;
// the leader's MPI call waits for the other processes' leaders of the same group,
// which are in the same position.  Splits are rounds of all L devices, ended the
// same way, and communicators are made in color order on every process.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <tuple>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace mpicoll {
namespace xla_groups {

// One group of XLA's devices, as this process sees it.
struct Group {
  int color = 0;
  int size = 0;                 // members (devices) in the group
  MPI_Comm processes = MPI_COMM_NULL;  // its processes, ordered by their first member; NULL: one
  MPI_Comm messages = MPI_COMM_NULL;   // a duplicate for the members' messages
  MPI_Comm checks = MPI_COMM_NULL;     // a duplicate for the checks across ranks
  void* watched = nullptr;             // jax_calls.cc's box of `processes`, for the watch
  std::vector<int> process_of;          // member -> its process's rank in `processes`
  std::vector<std::vector<int>> members_of;  // process rank in `processes` -> its members
  std::vector<int> local;               // this process's members, ascending

  // The meeting of the local members (one call of the group at a time: its
  // members run its collectives in program order).
  std::mutex mutex;
  std::condition_variable met;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<const void*> sends;  // by local index (position in `local`)
  std::vector<void*> receives;
  int rc = MPI_SUCCESS;
  std::string failure;  // the leader's failure text when rc is not MPI_SUCCESS
  std::vector<char> scratch;

  int LocalIndex(int member) const {
    return static_cast<int>(std::lower_bound(local.begin(), local.end(), member) - local.begin());
  }
};

// What a meeting's leader runs: given every local member's send and receive
// buffer (by local index), returns an MPI code, `failure` set for its own codes.
// Every member returns the leader's code, and copies its failure text.
template <typename Lead>
int Meet(Group& g, int local_index, const void* send, void* receive, std::string* failure,
         Lead&& lead) {
  std::unique_lock<std::mutex> lock(g.mutex);
  g.sends[local_index] = send;
  g.receives[local_index] = receive;
  if (++g.arrived < static_cast<int>(g.local.size())) {
    const uint64_t generation = g.generation;
    g.met.wait(lock, [&] { return g.generation != generation; });
    if (g.rc != MPI_SUCCESS) *failure = g.failure;
    return g.rc;
  }
  lock.unlock();  // the others wait for the generation: nobody touches g meanwhile
  std::string why;
  const int rc = lead(g.sends, g.receives, &why);
  lock.lock();
  g.rc = rc;
  g.failure = why;
  if (rc != MPI_SUCCESS) *failure = why;
  g.arrived = 0;
  ++g.generation;
  lock.unlock();
  g.met.notify_all();
  return rc;
}

// A member's place: its group, and its rank there.
struct Place {
  Group* group = nullptr;
  int member = -1;
};

// The rounds of XLA's splits (see the top): one per process.
struct Splits {
  std::mutex mutex;
  std::condition_variable done;
  int local_devices = 1;  // L, set at connection
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<std::pair<int, int>> asked;  // (color, key) per arrival
  std::vector<Place> made;                 // per arrival
  int rc = MPI_SUCCESS;
  std::string failure;
  int groups_made = 0;  // over every process's rounds: the same on every process
};

// The leader's part of a round: every process's pairs, then this process's
// groups.  `world`: XLA's COMM_WORLD (rank and size of the processes);
// `gather(run, failure)` runs the round's MPI_Allgather (`run`) as the caller
// watches it (and says why it failed).
template <typename Gather>
int MakeGroups(MPI_Comm world, Splits& s, std::string* failure, Gather&& gather) {
  int rank = 0, processes = 0;
  MPI_Comm_rank(world, &rank);
  MPI_Comm_size(world, &processes);
  const int L = s.local_devices;
  std::vector<int> mine(2 * L), all(2 * L * processes);
  for (int i = 0; i < L; ++i) mine[2 * i] = s.asked[i].first, mine[2 * i + 1] = s.asked[i].second;
  int rc = gather([&] {
    return MPI_Allgather(mine.data(), 2 * L, MPI_INT, all.data(), 2 * L, MPI_INT, world);
  }, failure);
  if (rc != MPI_SUCCESS) return rc;
  // color -> (key, process, arrival here or -1)
  std::map<int, std::vector<std::tuple<int, int, int>>> groups;
  for (int p = 0; p < processes; ++p) {
    for (int i = 0; i < L; ++i) {
      const int color = all[2 * (p * L + i)], key = all[2 * (p * L + i) + 1];
      groups[color].emplace_back(key, p, p == rank ? i : -1);
    }
  }
  int tag_limit = 32767, *tag_ub = nullptr, found = 0;
  MPI_Comm_get_attr(world, MPI_TAG_UB, &tag_ub, &found);
  if (found && tag_ub) tag_limit = *tag_ub;
  MPI_Group world_group;
  MPI_Comm_group(world, &world_group);
  for (auto& [color, members] : groups) {  // in color order on every process
    const int number = ++s.groups_made;
    std::sort(members.begin(), members.end());
    bool here = false;
    for (const auto& m : members) here = here || std::get<1>(m) == rank;
    if (!here) continue;
    const int size = static_cast<int>(members.size());
    if (static_cast<int64_t>(size) * size > tag_limit) {
      *failure = "mpicoll: XLA's group of " + std::to_string(size) +
                 " devices is too large for this MPI's tags (MPI_TAG_UB " +
                 std::to_string(tag_limit) + ")";
      rc = -1;
      break;
    }
    auto* g = new Group;  // kept for the process, as XLA keeps its communicators
    g->color = color;
    g->size = size;
    g->process_of.resize(size);
    std::vector<int> order;  // the group's processes, by first member
    for (int m = 0; m < size; ++m) {
      const int p = std::get<1>(members[m]);
      auto at = std::find(order.begin(), order.end(), p);
      if (at == order.end()) {
        order.push_back(p);
        g->members_of.emplace_back();
        at = order.end() - 1;
      }
      const int index = static_cast<int>(at - order.begin());
      g->process_of[m] = index;
      g->members_of[index].push_back(m);
      if (p == rank) g->local.push_back(m);
    }
    g->sends.resize(g->local.size());
    g->receives.resize(g->local.size());
    MPI_Group sub;
    rc = MPI_Group_incl(world_group, static_cast<int>(order.size()), order.data(), &sub);
    if (rc == MPI_SUCCESS) {
      rc = MPI_Comm_create_group(world, sub, color % tag_limit, &g->processes);
      MPI_Group_free(&sub);
    }
    if (rc == MPI_SUCCESS) rc = MPI_Comm_dup(g->processes, &g->messages);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_dup(g->processes, &g->checks);
    if (rc == MPI_SUCCESS) {
      // Numbered over every process's groups, so the same on every member
      // (two groups led by one device are told apart).
      const std::string name = "mpicoll:XLA's communicator " + std::to_string(number) +
                               " (group led by device " + std::to_string(color) + ")";
      MPI_Comm_set_name(g->processes, name.c_str());
      MPI_Comm_set_name(g->messages, (name + " (messages)").c_str());
    }
    if (rc != MPI_SUCCESS) break;
    for (int m = 0; m < size; ++m) {
      const int arrival = std::get<2>(members[m]);
      if (arrival >= 0) s.made[arrival] = Place{g, m};
    }
  }
  MPI_Group_free(&world_group);
  return rc;
}

// One device's split: waits for its round, returns its place (or an MPI code).
// `waiting(seconds, arrived)` is called about once a second while a device waits
// for the round's other local devices (a program with collectives on some of a
// process's devices only never brings them: the caller reports it).
template <typename Gather, typename Waiting>
int Split(MPI_Comm world, Splits& s, int color, int key, Place* place, std::string* failure,
          Gather&& gather, Waiting&& waiting) {
  std::unique_lock<std::mutex> lock(s.mutex);
  if (s.asked.size() != static_cast<size_t>(s.local_devices)) {
    s.asked.resize(s.local_devices);
    s.made.resize(s.local_devices);
  }
  const int arrival = s.arrived++;
  s.asked[arrival] = {color, key};
  if (s.arrived < s.local_devices) {
    const uint64_t generation = s.generation;
    const auto start = std::chrono::steady_clock::now();
    while (!s.done.wait_for(lock, std::chrono::seconds(1),
                            [&] { return s.generation != generation; })) {
      waiting(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              s.arrived);
    }
  } else {
    s.failure.clear();
    std::fill(s.made.begin(), s.made.end(), Place{});
    s.rc = MakeGroups(world, s, &s.failure, gather);
    s.arrived = 0;
    ++s.generation;
    s.done.notify_all();
  }
  *place = s.made[arrival];
  if (s.rc != MPI_SUCCESS) *failure = s.failure;
  return s.rc;
}

}  // namespace xla_groups
}  // namespace mpicoll

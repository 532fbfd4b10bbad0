// What the watchdog (watch/watchdog.h) finds in the ranks' states
// (rank_state.h) and how it says it: a rank's line in a report, the rules
// for a wait that can never end (a divergence), and the stall report.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "call_sites.h"
#include "guard.h"
#include "rank_state.h"

namespace mpicoll {

constexpr double kProbeAfter = 0.5;  // s of waiting before the ranks are first asked

// ---------------------------------------------------------------------------
// How a rank's state reads in a report.

// A local device waiting for the others of its process inside one call (the
// local meeting, meeting/meeting.cc): no description of its own, and no sequence
// on its device's communicator; the call's MPI part is its leader's, which
// the report names instead wherever the leader is in it.
inline bool WaitInsideCall(const CallState& c) { return c.call_hash == 0; }

// Whether a rank is in a call other than such a wait.
inline bool InCallProper(const RankState& s) {
  for (const CallState& c : s.calls) {
    if (c.phase != kPhaseDone && !WaitInsideCall(c)) return true;
  }
  return false;
}

inline std::string Describe(const CallState& c) {
  std::string text = std::string(c.call) + " on " + c.comm;
  if (c.device > 0 && c.device < kXlaSlot) text += " (" + SlotName(c.device) + ")";
  if (WaitInsideCall(c)) text += ", waiting for this process's other local devices to meet";
  if (c.phase == kPhaseSetup) {
    return text + " (its first collective there: the communicator's setup, MPI_Comm_dup)";
  }
  // A wait inside a call has no sequence number of its own (the flight records
  // number the device's meetings instead: meeting.cc, MeetingRecord).
  if (!WaitInsideCall(c)) text += ", sequence " + std::to_string(c.sequence);
  if (c.site[0]) text += std::string(", called at ") + c.site;
  if (c.phase == kPhaseChecking) text += " (comparing it across the ranks)";
  return text;
}

inline std::string Seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

inline std::string EndedLine(const RankState& s) {
  std::string text = s.head.ending == kFinished
      ? std::string("finished its script")
      : "exits with code " + std::to_string(s.head.exit_code);
  if (s.head.ended_at[0]) text += std::string(" at ") + s.head.ended_at;
  return text;
}

// One line per rank: what it is in, or was in last on the communicators that
// matter (`comms`), or that it has ended or not answered.
inline std::string RankLine(int rank, const RankState& s, std::vector<uint64_t> comms) {
  std::sort(comms.begin(), comms.end());
  comms.erase(std::unique(comms.begin(), comms.end()), comms.end());
  if (!s.Answered() && s.head.ending == kAlive) {
    return "  rank " + std::to_string(rank) + " (" + HostOf(rank) + "): no answer within " +
           std::to_string(static_cast<int>(s.head.waited)) +
           " s (its process is gone, stopped, or its host unreachable)\n";
  }
  std::string text = "  rank " + std::to_string(rank) + " (" + s.head.host + "): ";
  std::vector<std::string> parts;
  if (s.head.ending != kAlive) parts.push_back(EndedLine(s));
  const bool in_call_proper = InCallProper(s);
  for (const CallState& c : s.calls) {
    if (c.phase != kPhaseDone && s.head.ending == kAlive &&
        !(in_call_proper && WaitInsideCall(c))) {
      parts.push_back("in " + Describe(c) + " for " + Seconds(c.seconds));
    }
  }
  if (parts.empty()) parts.push_back("not in an mpicoll collective for " +
                                     Seconds(s.head.idle_seconds));
  for (uint64_t comm : comms) {
    const CallState* c = s.On(comm);
    if (c && (c->phase == kPhaseDone || s.head.ending != kAlive)) {
      parts.push_back("its last on " + std::string(c->comm) + ": sequence " +
                      std::to_string(c->sequence) + ", " + c->call +
                      (c->site[0] ? std::string(", called at ") + c->site : std::string()));
    }
  }
  for (size_t i = 0; i < parts.size(); ++i) text += (i ? "; " : "") + parts[i];
  return text + "\n" + s.python_stack;  // where a rank outside a collective is in its code
}

// ---------------------------------------------------------------------------
// Waits that can never end.  A local device's wait W is on a communicator C
// (its identity: name and members, the same on every rank) at sequence s.
// For each other member m of C (its world rank; device k's duplicates pair
// device k of every rank), m's state on C says:
//   * at s, with another call (a different op, shape, dtype or root), or the
//     same call while only one of them compares it across ranks: they cannot
//     match (a mismatch);
//   * m has ended with fewer than s calls on C: it never comes;
//   * below s, alive, and itself waiting in a collective: m waits for W's rank
//     to come to some other call first, or for ranks that do: a wait-for edge.
// The waits whose ranks only wait for ranks that wait or have ended, and on at
// least one of them, are a deadlock: none of them can move.  Every rank holds
// the same rules against the states it gathered; the lowest rank stuck
// reports, once the verdict held twice (deadlocks) or at once (mismatches,
// ended ranks, which cannot change).
struct Verdict {
  bool found = false;
  bool certain = false;   // needs no second look
  std::string why;        // the report's first line
  std::vector<int> stuck;  // ranks whose waits cannot end
  std::vector<uint64_t> comms;  // the communicators involved
  std::string key;        // the verdict's identity, to see it hold twice
  int exiting = -1;       // a rank whose process exits: it writes the report (AnnounceEnd)
};

struct Membership {
  uint64_t hash;
  std::vector<int> members;  // world ranks
};

inline std::vector<int> ParseMembers(const std::string& text) {
  std::vector<int> ranks;
  size_t at = 0;
  while (at < text.size()) {
    const size_t comma = text.find(',', at);
    ranks.push_back(std::atoi(text.substr(at, comma - at).c_str()));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return ranks;
}

// The members of the communicators this rank's devices wait on (only this
// rank knows them; the others send hashes).
inline std::vector<Membership> WaitedMemberships() {
  std::vector<Membership> known;
  for (int d = 0; d < kCallSlots; ++d) {
    if (in_flight[d].started_ns.load(std::memory_order_acquire) == 0) continue;
    const CommIdentity* identity = in_flight[d].identity.load(std::memory_order_relaxed);
    if (identity) known.push_back({CommHash(identity), ParseMembers(identity->members)});
  }
  if (in_flight[kSetupSlot].started_ns.load(std::memory_order_acquire) != 0) {
    std::lock_guard<std::mutex> lock(comm_setup.mutex);
    known.push_back({CommHash(&comm_setup.identity), ParseMembers(comm_setup.identity.members)});
  }
  return known;
}

inline Verdict FindDivergence(const std::vector<RankState>& states,
                              const std::vector<Membership>& known) {
  Verdict v;
  const int me = WorldRank();
  const RankState& mine = states[me];
  std::map<int, std::set<int>> waits_for;  // rank -> the ranks it waits for
  std::set<int> waiting, ended;
  for (size_t r = 0; r < states.size(); ++r) {
    if (states[r].head.ending != kAlive) ended.insert(static_cast<int>(r));
    else if (states[r].Answered() && states[r].InCollective()) waiting.insert(static_cast<int>(r));
  }
  for (const CallState& w : mine.calls) {
    // Not judged: sequence 0, a point-to-point call (only its peer can match
    // it); no description, a wait inside a call (a process's local devices
    // meeting for a combined allreduce), whose MPI part is its leader's call.
    if (w.phase == kPhaseDone || w.seconds < kProbeAfter || w.sequence == 0 ||
        w.call_hash == 0) {
      continue;
    }
    const Membership* membership = nullptr;
    for (const Membership& m : known) {
      if (m.hash == w.comm_hash) membership = &m;
    }
    if (!membership) continue;
    for (int m : membership->members) {
      if (m == me || m < 0 || m >= static_cast<int>(states.size())) continue;
      const RankState& theirs = states[m];
      if (!theirs.Answered() && theirs.head.ending == kAlive) continue;  // cannot tell
      const CallState* on = theirs.On(w.comm_hash);
      if (on && on->call_hash == 0) continue;  // a wait inside a call: cannot tell
      const uint64_t sequence = on ? on->sequence : 0;
      const bool same_call = on && on->call_hash == w.call_hash;
      if (on && sequence == w.sequence && w.phase != kPhaseSetup) {
        // Both comparing their calls across the ranks: the checks meet on the
        // checks' communicator, and every rank raises the mismatch.
        if (on->phase == kPhaseChecking && w.phase == kPhaseChecking) continue;
        // It has finished comparing this call, in a comparison this rank's is
        // part of: the mismatch is raised on every rank as each returns from it.
        if (on->phase == kPhaseDone && on->checked && w.phase == kPhaseChecking) continue;
        const bool one_checks = (on->phase == kPhaseChecking) != (w.phase == kPhaseChecking) &&
                                on->phase != kPhaseDone;
        if (!same_call || one_checks) {
          // One rank past a check the other is still in (it received every record
          // first; MPI_Allgather ends at different times on different ranks) looks
          // like a check mode that differs: that verdict must hold at two probes.
          v.found = true;
          v.certain = !same_call;
          v.why = "ranks " + std::to_string(std::min(me, m)) + " and " +
                  std::to_string(std::max(me, m)) + " are at the same collective on " + w.comm +
                  " (sequence " + std::to_string(w.sequence) + ") with " +
                  (same_call ? "one comparing it across ranks and one not (the check mode "
                               "differs between them)"
                             : "different calls");
          v.stuck = {me, m};
          v.comms = {w.comm_hash};
          v.key = v.why;
          return v;
        }
        continue;  // arrived
      }
      if (sequence >= w.sequence) continue;  // it has passed this call: not provable here
      if (theirs.head.ending != kAlive) {
        v.found = v.certain = true;
        v.why = "rank " + std::to_string(m) + " " +
                (theirs.head.ending == kFinished ? std::string("has finished its script")
                                                 : std::string("is exiting")) +
                " without reaching the collective rank " + std::to_string(me) + " waits in on " +
                w.comm + (w.site[0] ? std::string(", called at ") + w.site : std::string());
        v.stuck = {me};
        v.comms = {w.comm_hash};
        if (theirs.head.ending == kExiting) v.exiting = m;
        return v;
      }
      waits_for[me].insert(m);
    }
  }
  if (waits_for.empty()) return v;
  // A deadlock of two: every rank this one waits for is itself waiting, on a
  // communicator this rank belongs to and is behind on (it waits for this
  // rank elsewhere).  Longer cycles are left to the stall report and timeout.
  const std::set<int>& targets = waits_for[me];
  for (int t : targets) {
    if (!waiting.count(t)) return v;  // t is not in a collective: it may still come
    bool waits_on_me = false;
    for (const CallState& c : states[t].calls) {
      if (c.phase == kPhaseDone || c.seconds < kProbeAfter || !c.asker_is_member) continue;
      const CallState* mine_there = mine.On(c.comm_hash);
      if (!mine_there || mine_there->sequence < c.sequence) waits_on_me = true;
    }
    if (!waits_on_me) return v;
  }
  v.found = true;
  v.why = "the ranks wait for each other in collectives on different communicators: rank " +
          std::to_string(me) + " waits for rank(s)";
  for (int t : targets) v.why += " " + std::to_string(t);
  v.why += ", which wait in turn for rank " + std::to_string(me) + " elsewhere";
  v.stuck.assign(targets.begin(), targets.end());
  v.stuck.push_back(me);
  std::sort(v.stuck.begin(), v.stuck.end());
  for (int r : v.stuck) {
    v.key += std::to_string(r) + ":";
    for (const CallState& c : states[r].calls) {
      if (c.phase == kPhaseDone) continue;
      v.comms.push_back(c.comm_hash);
      v.key += std::to_string(c.comm_hash) + "@" + std::to_string(c.sequence) + ",";
    }
  }
  return v;
}

inline std::string DivergenceReport(const std::vector<RankState>& states, const Verdict& v) {
  std::string text = "mpicoll: the ranks' collectives cannot match: " + v.why +
                     "; aborting the job (found by rank " + std::to_string(WorldRank()) + ")\n";
  for (size_t r = 0; r < states.size(); ++r) {
    text += RankLine(static_cast<int>(r), states[r], v.comms);
  }
  return text;
}

// ---------------------------------------------------------------------------
// The stall report, from this rank's point of view (its longest wait);
// empty if a lower rank is stalled too (it reports).  "Stalled" with half the
// threshold's tolerance: ranks enter a collective a little apart, and a lower
// rank that arrived last is about to reach the threshold and report itself.
// A wait inside a call (a local device waiting for its leader) yields to the
// call's MPI part where this rank is in it.
inline const CallState* LongestWait(const RankState& s) {
  const CallState* longest = nullptr;
  const bool in_call_proper = InCallProper(s);
  for (const CallState& c : s.calls) {
    if (c.phase == kPhaseDone || (in_call_proper && WaitInsideCall(c))) continue;
    if (!longest || c.seconds > longest->seconds) longest = &c;
  }
  return longest;
}

// Every member of the wait's communicator has come to its call (is in it, or
// has finished it): nobody holds it up.  Seen in a report gathered just as a
// late rank arrived, the wait is ending; seen again a report later, a
// transfer does not end (watchdog.h).
inline bool EveryMemberCame(const std::vector<RankState>& states, const CallState& wait) {
  if (wait.sequence == 0 || wait.call_hash == 0) return false;  // a wait inside a call
  std::vector<int> members;
  for (const Membership& m : WaitedMemberships()) {
    if (m.hash == wait.comm_hash) members = m.members;
  }
  if (members.empty()) {
    for (size_t r = 0; r < states.size(); ++r) members.push_back(static_cast<int>(r));
  }
  for (int r : members) {
    if (r < 0 || r >= static_cast<int>(states.size()) || !states[r].Answered()) return false;
    const CallState* on = states[r].On(wait.comm_hash);
    if (!on || on->sequence < wait.sequence) return false;
    const bool in_it = on->sequence == wait.sequence && on->phase != kPhaseDone;
    if (in_it && on->call_hash != wait.call_hash) return false;  // another call: a mismatch
  }
  return true;
}

inline std::string StallReport(const std::vector<RankState>& states, int me, bool always) {
  const RankState& mine = states[me];
  const CallState* wait = LongestWait(mine);
  if (!wait) return std::string();
  for (int r = 0; r < me && !always; ++r) {
    const CallState* theirs = LongestWait(states[r]);
    if (states[r].Answered() && theirs &&
        theirs->seconds >= 0.5 * watch_settings.stall_report_seconds.load()) {
      return std::string();
    }
  }
  char head[256];
  std::snprintf(head, sizeof(head), "mpicoll: stall report from rank %d (%s): waiting %.1f s in ",
                me, mine.head.host, wait->seconds);
  std::string text = head + Describe(*wait) + "\n";
  std::vector<int> arrived, elsewhere;
  for (size_t r = 0; r < states.size(); ++r) {
    const CallState* on = states[r].On(wait->comm_hash);
    if (states[r].Answered() && on && on->phase != kPhaseDone &&
        on->sequence == wait->sequence && on->call_hash == wait->call_hash) {
      arrived.push_back(static_cast<int>(r));
    } else {
      elsewhere.push_back(static_cast<int>(r));
    }
  }
  text += "  arrived (" + std::to_string(arrived.size()) + " of " +
          std::to_string(states.size()) + " ranks):";
  for (int r : arrived) text += " " + std::to_string(r);
  text += "\n";
  if (!SideChannelUp() && states.size() > 1) {
    text += serialized_mpi.on.load()
        ? "  (the other ranks cannot be asked: MPI_THREAD_SERIALIZED)\n"
        : "  (the other ranks cannot be asked yet: the watchdogs' side channel opens once "
          "every rank has imported mpicoll)\n";
    return text;
  }
  for (int r : elsewhere) text += RankLine(r, states[r], {wait->comm_hash});
  return text;
}

// The line a timeout ends the job with: what this rank's longest wait is in.
inline std::string TimeoutLine(int me, double limit, const RankState& mine) {
  const CallState* wait = LongestWait(mine);
  char line[512];
  if (!wait) {
    std::snprintf(line, sizeof(line), "mpicoll: rank %d: MPICOLL_TIMEOUT=%g; aborting the job\n",
                  me, limit);
  } else if (wait->phase == kPhaseSetup) {
    std::snprintf(line, sizeof(line),
                  "mpicoll: rank %d has waited %.1f s in %s, the first collective on %s (its "
                  "setup, MPI_Comm_dup, MPICOLL_TIMEOUT=%g): another rank has not reached "
                  "its first collective there; aborting the job\n",
                  me, wait->seconds, wait->call, wait->comm, limit);
  } else if (WaitInsideCall(*wait)) {  // the library's own wait, not the other ranks'
    std::snprintf(line, sizeof(line),
                  "mpicoll: rank %d: its local device %d has waited %.1f s in %s on %s for this "
                  "process's other local devices to meet, which did not come (MPICOLL_TIMEOUT=%g; "
                  "a device thread stopped outside mpicoll, or mpicoll's own fault: please "
                  "report it); aborting the job\n",
                  me, wait->device, wait->seconds, wait->call, wait->comm, limit);
  } else {
    const InFlight& f = in_flight[std::max(0, wait->device)];
    std::snprintf(line, sizeof(line),
                  "mpicoll: rank %d (rank %d of %s, %s) has waited %.1f s in %s "
                  "(MPICOLL_TIMEOUT=%g); aborting the job\n",
                  me, f.rank.load(), wait->comm, SlotName(wait->device).c_str(), wait->seconds,
                  f.name.load() ? f.name.load() : "?", limit);
  }
  return line;
}

}  // namespace mpicoll

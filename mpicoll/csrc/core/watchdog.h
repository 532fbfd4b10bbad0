// The watchdog: a thread per process that watches what the local devices are
// in (guard.h's in_flight) and, when a collective waits,
//   * after half a second, and again with back-off, asks every rank what it
//     is doing (rank_state.h) and ends the job at once, with one report
//     naming every rank's state, when the wait can never end: another rank is
//     in a different call at the same sequence number on that communicator,
//     or has ended (finished its script, or its process exits) before
//     reaching it, or the ranks wait for each other in collectives on
//     different communicators (a cycle of ranks, none of which will move);
//   * after MPICOLL_STALL_REPORT seconds (default 60), writes one stall report
//     for the job: the collective, its call site and sequence number, the
//     ranks that have arrived in it and, for every other rank, what that rank
//     is doing now (in another collective, or not in mpicoll for how long, or
//     no answer); repeated with back-off (x2) while the stall lasts;
//   * after MPICOLL_TIMEOUT seconds (default 600), writes that report as the
//     reason and aborts the job.
// Only one rank prints, so the job gets one report.  Without the side channel
// (MPI_THREAD_SERIALIZED) a report holds this rank's view only, and a wait
// that cannot end is found by the timeout.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "call.h"
#include "dtypes.h"
#include "guard.h"
#include "rank_state.h"

namespace mpicoll {

inline std::atomic<bool> watchdog_started{false};
constexpr double kProbeAfter = 0.5;  // s of waiting before the ranks are first asked

// ---------------------------------------------------------------------------
// Uncaught exceptions: the rank whose error ends the job prints it; every
// other rank's watchdog says in one line which rank that was, and a rank that
// raised at the same moment (the same error on every rank, typically) prints
// one line instead of a second copy of the traceback.
inline std::atomic<int> lowest_aborting{1 << 30};  // the lowest rank that announced an abort
inline std::atomic<int> printing_rank{-1};            // a rank that prints the traceback
inline std::atomic<bool> this_rank_aborting{false};

inline void TakeAbortNotices() {
  ReceiveEach(kDumpNoticeTag, [](int, const std::vector<char>& bytes) {
    DumpFlight(WorldRank(), world_size.load(),
               "rank " + std::to_string(IntOf(bytes)) + " reported a divergence");
  });
  // Each notice is taken for what it says alone: MPI orders a sender's messages
  // only within a tag, so a traceback notice may come before that rank's abort notice.
  ReceiveEach(kTracebackNoticeTag, [](int, const std::vector<char>& bytes) {
    int none = -1;
    printing_rank.compare_exchange_strong(none, IntOf(bytes));
  });
  ReceiveEach(kAbortNoticeTag, [](int, const std::vector<char>& bytes) {
    const int who = IntOf(bytes);
    int seen = lowest_aborting.load();
    const bool first = seen == (1 << 30);
    while (who < seen && !lowest_aborting.compare_exchange_weak(seen, who)) {
    }
    if (first && !this_rank_aborting.load()) {
      std::fprintf(stderr, "mpicoll: rank %d: the job is being aborted by rank %d (its error is "
                   "printed there)\n", WorldRank(), who);
      std::fflush(stderr);
      const std::string why = "aborted by rank " + std::to_string(who);
      DumpFlight(WorldRank(), world_size.load(), why);
      WriteTrace(WorldRank(), world_size.load(), why);
    }
  });
}

inline std::vector<char> IntBytes(int value) {
  std::vector<char> bytes(sizeof(int));
  std::memcpy(bytes.data(), &value, sizeof(int));
  return bytes;
}

// Called by a rank about to abort the job for an uncaught exception: tells the
// others, waits `settle_ms` for the notices of ranks that raised at the same
// time, and returns the rank that prints the traceback: one that already said
// it does (it decided before this rank's notice reached it), else the lowest
// rank ending the job (this one or lower), which then says so.  So one rank
// prints it however far apart the ranks raise.
inline int AnnounceAbort(int settle_ms) {
  const int me = WorldRank();
  this_rank_aborting.store(true);
  int seen = lowest_aborting.load();
  while (me < seen && !lowest_aborting.compare_exchange_weak(seen, me)) {
  }
  if (!SideChannelUp()) {
    DumpFlight(me, world_size.load(), "an uncaught exception on this rank");
    WriteTrace(me, world_size.load(), "an uncaught exception on this rank");
    return me;
  }
  SendToEveryRank(IntBytes(me), kAbortNoticeTag, /*wait_ms=*/0);
  DumpFlight(me, world_size.load(), "an uncaught exception on this rank");
  WriteTrace(me, world_size.load(), "an uncaught exception on this rank");
  std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
  TakeAbortNotices();
  const int printing = printing_rank.load();
  if (printing >= 0) return printing;
  const int lowest = std::min(me, lowest_aborting.load());
  if (lowest == me) SendToEveryRank(IntBytes(me), kTracebackNoticeTag, /*wait_ms=*/0);
  return lowest;
}

// ---------------------------------------------------------------------------
// How a rank's state reads in a report.
inline std::string Describe(const CallState& c) {
  std::string text = std::string(c.call) + " on " + c.comm;
  if (c.device > 0) text += " (local device " + std::to_string(c.device) + ")";
  if (c.phase == kPhaseSetup) {
    return text + " (its first collective there: the communicator's setup, MPI_Comm_dup)";
  }
  text += ", sequence " + std::to_string(c.sequence);
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
           std::to_string(static_cast<int>(kAnswerWithin)) +
           " s (its process is gone, stopped, or its host unreachable)\n";
  }
  std::string text = "  rank " + std::to_string(rank) + " (" + s.head.host + "): ";
  std::vector<std::string> parts;
  if (s.head.ending != kAlive) parts.push_back(EndedLine(s));
  for (const CallState& c : s.calls) {
    if (c.phase != kPhaseDone && s.head.ending == kAlive) {
      parts.push_back("in " + Describe(c) + " for " + Seconds(c.seconds));
    }
  }
  if (parts.empty()) parts.push_back("not in an mpicoll collective for " +
                                     Seconds(s.head.idle_seconds));
  for (uint64_t comm : comms) {
    const CallState* c = s.On(comm);
    if (c && (c->phase == kPhaseDone || s.head.ending != kAlive)) {
      parts.push_back("its last on " + std::string(c->comm) + ": sequence " +
                      std::to_string(c->sequence) + ", " + c->call);
    }
  }
  for (size_t i = 0; i < parts.size(); ++i) text += (i ? "; " : "") + parts[i];
  return text + "\n";
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
  for (int d = 0; d < kMaxLocalDevices; ++d) {
    if (in_flight[d].started_ns.load(std::memory_order_acquire) == 0) continue;
    const CommIdentity* identity = in_flight[d].identity.load(std::memory_order_relaxed);
    if (identity) known.push_back({CommHash(identity), ParseMembers(identity->members)});
  }
  if (in_flight[kSetupSlot].started_ns.load(std::memory_order_acquire) != 0) {
    std::lock_guard<std::mutex> lock(setup_mutex);
    known.push_back({CommHash(&setup_identity), ParseMembers(setup_identity.members)});
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
    if (w.phase == kPhaseDone || w.seconds < kProbeAfter) continue;
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
      const uint64_t sequence = on ? on->sequence : 0;
      const bool same_call = on && on->call_hash == w.call_hash;
      if (on && sequence == w.sequence && w.phase != kPhaseSetup) {
        const bool one_checks = (on->phase == kPhaseChecking) != (w.phase == kPhaseChecking) &&
                                on->phase != kPhaseDone;
        if (!same_call || one_checks) {
          v.found = v.certain = true;
          v.why = "ranks " + std::to_string(std::min(me, m)) + " and " +
                  std::to_string(std::max(me, m)) + " are at the same collective on " + w.comm +
                  " (sequence " + std::to_string(w.sequence) + ") with " +
                  (same_call ? "one comparing it across ranks and one not (the check mode "
                               "differs between them)"
                             : "different calls");
          v.stuck = {me, m};
          v.comms = {w.comm_hash};
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
                w.comm;
        v.stuck = {me};
        v.comms = {w.comm_hash};
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
inline const CallState* LongestWait(const RankState& s) {
  const CallState* longest = nullptr;
  for (const CallState& c : s.calls) {
    if (c.phase != kPhaseDone && (!longest || c.seconds > longest->seconds)) longest = &c;
  }
  return longest;
}

inline std::string StallReport(const std::vector<RankState>& states, int me, bool always) {
  const RankState& mine = states[me];
  const CallState* wait = LongestWait(mine);
  if (!wait) return std::string();
  for (int r = 0; r < me && !always; ++r) {
    const CallState* theirs = LongestWait(states[r]);
    if (states[r].Answered() && theirs &&
        theirs->seconds >= 0.5 * stall_report_seconds.load()) {
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
    text += serialize_mpi_calls.load()
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
  } else {
    const InFlight& f = in_flight[std::max(0, wait->device)];
    std::snprintf(line, sizeof(line),
                  "mpicoll: rank %d (rank %d of %s, local device %d) has waited %.1f s in %s "
                  "(MPICOLL_TIMEOUT=%g); aborting the job\n",
                  me, f.rank.load(), wait->comm, wait->device, wait->seconds,
                  f.name.load() ? f.name.load() : "?", limit);
  }
  return line;
}

// Writes this rank's flight records, with `why` (a report) as their reason,
// and says where, for the report.
inline std::string FlightLine(int me, const std::string& why) {
  if (!DumpFlight(me, world_size.load(), why)) return std::string();
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(flight_setup_mutex);
    dir = flight_dir;
  }
  return "  flight records: " + dir + "/rank*.json (python -m mpicoll flight " + dir + ")\n";
}

// The communicators this rank's devices wait on, for the others to describe.
inline std::vector<uint64_t> WaitedComms() {
  std::vector<uint64_t> comms;
  for (const Membership& m : WaitedMemberships()) comms.push_back(m.hash);
  return comms;
}

// One rank reports: a rank that found a verdict defers to a lower rank that
// waits on one of the communicators involved (it finds the same), answering
// requests meanwhile, and reports itself if the job has not ended within 2 s.
inline bool DeferToLowerRank(const std::vector<RankState>& states, const Verdict& v) {
  const int me = WorldRank();
  bool lower_waits = false;
  for (int r = 0; r < me && !lower_waits; ++r) {
    if (!states[r].Answered() || states[r].head.ending != kAlive) continue;
    for (const CallState& c : states[r].calls) {
      if (c.phase != kPhaseDone &&
          std::find(v.comms.begin(), v.comms.end(), c.comm_hash) != v.comms.end()) {
        lower_waits = true;
      }
    }
  }
  if (!lower_waits) return false;
  for (int i = 0; i < 100 && !watchdog_stop.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ServeStateRequests();
    TakeAbortNotices();  // the reporting rank asks for this rank's records
  }
  return watchdog_stop.load();
}

[[noreturn]] inline void ReportDivergenceAndAbort(const std::vector<RankState>& states,
                                                  const Verdict& v) {
  SendToEveryRank(IntBytes(WorldRank()), kDumpNoticeTag, /*wait_ms=*/0);  // their records too
  const std::string report = DivergenceReport(states, v);
  std::fprintf(stderr, "%s%s", report.c_str(), FlightLine(WorldRank(), report).c_str());
  WriteTrace(WorldRank(), world_size.load(), "a divergence");
  AbortJob(3);
}

inline void Watchdog() {
  // Every return (the loop checks watchdog_stop at least every 50 ms, the
  // state requests every 2 ms) tells StopWatchdog that no MPI call follows.
  struct Stopped {
    ~Stopped() { watchdog_stopped.store(true); }
  } stopped;
  int64_t episode = 0;       // started_ns of the wait being reported on
  double next_report = 0;    // s into that wait
  double next_probe = 0;     // s into that wait
  int64_t probed_ends = 0;   // ended_changed_ns at the last probe
  std::string last_verdict;  // a deadlock's key, to see it hold twice
  for (;;) {
    const double limit = timeout_seconds.load(), stall = stall_report_seconds.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(
        (limit > 0 && limit < 2) || (stall > 0 && stall < 2) ? 20 : 50));
    if (watchdog_stop.load()) return;
    OpenSideChannelStep();
    ServeStateRequests();
    TakeAbortNotices();
    TakeEndNotices();
    if (flight_dump_asked.exchange(false)) {
      DumpFlight(WorldRank(), world_size.load(), "SIGUSR1");
      WriteTrace(WorldRank(), world_size.load(), "SIGUSR1");
    }
    const int64_t now = NowNs();
    int64_t earliest = 0;
    for (int d = 0; d <= kSetupSlot; ++d) {
      const int64_t started = in_flight[d].started_ns.load(std::memory_order_acquire);
      if (started != 0 && (earliest == 0 || started < earliest)) earliest = started;
    }
    if (earliest == 0) continue;
    const double waited = (now - earliest) * 1e-9;
    if (earliest != episode) {
      episode = earliest, next_report = stall, next_probe = kProbeAfter, last_verdict.clear();
    }
    const int me = WorldRank();
    // A wait that can never end: asked after kProbeAfter, then with back-off,
    // and at once when a rank has ended meanwhile.
    const int64_t ends = ended_changed_ns.load();
    if (SideChannelUp() && world_size.load() > 1 &&
        (waited >= next_probe || (ends != probed_ends && waited >= 0.1))) {
      probed_ends = ends;
      if (waited >= next_probe) next_probe = std::max(2 * next_probe, waited + kProbeAfter);
      const std::vector<Membership> known = WaitedMemberships();
      std::vector<uint64_t> asked;
      for (const Membership& m : known) asked.push_back(m.hash);
      const std::vector<RankState> states = EveryRanksState(asked);
      if (watchdog_stop.load()) return;
      const Verdict v = FindDivergence(states, known);
      if (v.found && (v.certain || v.key == last_verdict)) {
        if (!DeferToLowerRank(states, v)) ReportDivergenceAndAbort(states, v);
        return;  // the job is ending
      }
      last_verdict = v.found ? v.key : std::string();
      if (v.found) next_probe = waited + kProbeAfter;  // look again soon
    }
    const bool timed_out = limit > 0 && waited >= limit;
    if (!timed_out && !(stall > 0 && waited >= next_report)) continue;
    std::vector<RankState> states = EveryRanksState(WaitedComms(), /*for_report=*/true);
    if (watchdog_stop.load()) return;  // the wait ended and the process is exiting
    std::string report = StallReport(states, me, /*always=*/false);
    if (timed_out) {
      // One report for the job: the lowest stalled rank's.  The others give it
      // a moment to end the job, then end it themselves.  They answer its state
      // requests meanwhile: it is asking them for the report that ends the job.
      if (report.empty()) {
        for (int i = 0; i < 100 && !watchdog_stop.load(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          ServeStateRequests();
        }
        if (watchdog_stop.load()) return;
        report = StallReport(states, me, /*always=*/true);
      }
      const std::string line = TimeoutLine(me, limit, states[me]);
      std::fprintf(stderr, "%s%s%s", report.c_str(), FlightLine(me, report + line).c_str(),
                   line.c_str());
      WriteTrace(me, world_size.load(), "MPICOLL_TIMEOUT");
      AbortJob(3);
    }
    if (!report.empty()) {
      char tail[160];
      std::snprintf(tail, sizeof(tail),
                    "  (next report after %.0f s of waiting%s)\n", next_report * 2,
                    limit > 0 ? (", the job ends after MPICOLL_TIMEOUT=" +
                                 std::to_string(static_cast<int>(limit)) + " s").c_str()
                              : "; MPICOLL_TIMEOUT=0: it waits forever");
      std::fprintf(stderr, "%s%s%s", report.c_str(), FlightLine(me, report).c_str(), tail);
      std::fflush(stderr);
    }
    next_report *= 2;
  }
}

// ---------------------------------------------------------------------------
// A rank that ends (its script finished, `ending` kFinished, or its process
// exits, kExiting, with `code`) tells every rank its last calls, so that a
// rank waiting for it ends the job at once.  A process about to exit also
// asks the others: if one waits for it, this rank writes the job's report
// itself, since the launcher may end the others as soon as it exits.
inline void AnnounceEnd(int ending, int code, const std::string& where) {
  FinishOpeningSideChannel(/*seconds=*/2.0);
  if (!SideChannelUp() || world_size.load() == 1) return;
  RankState mine = OwnState({}, /*all_comms=*/true);
  mine.head.ending = ending;
  mine.head.exit_code = code;
  Copy(mine.head.ended_at, sizeof(mine.head.ended_at), where);
  mine.calls.resize(std::min<size_t>(mine.calls.size(), 8));  // a small, eager message
  mine.head.count = static_cast<int32_t>(mine.calls.size());
  SendToEveryRank(Pack(mine), kEndNoticeTag, /*wait_ms=*/ending == kExiting ? 200 : 50);
  if (ending != kExiting) return;
  // The others may be on their way into the collective that waits for this
  // rank: it asks for up to a second, until one waits or all have ended.
  std::vector<RankState> states;
  std::vector<uint64_t> comms;
  std::vector<int> stuck;
  for (int attempt = 0; attempt < 10 && stuck.empty(); ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    states = EveryRanksState({});
    states[WorldRank()] = mine;
    bool others_alive = false;
    // Each other rank's waits, held against this rank's last calls: a rank in a
    // collective on a communicator where this one has fewer calls waits for it.
    for (size_t r = 0; r < states.size(); ++r) {
      if (static_cast<int>(r) == WorldRank()) continue;
      others_alive |= states[r].Answered() && states[r].head.ending == kAlive;
      for (const CallState& c : states[r].calls) {
        const CallState* here = mine.On(c.comm_hash);
        if (c.phase != kPhaseDone && c.asker_is_member &&
            (here ? here->sequence : 0) < c.sequence) {
          comms.push_back(c.comm_hash);
          stuck.push_back(static_cast<int>(r));
        }
      }
    }
    if (!others_alive) return;
  }
  if (stuck.empty()) return;
  Verdict v;
  v.why = "rank " + std::to_string(WorldRank()) + " exits with code " + std::to_string(code) +
          " while rank " + std::to_string(stuck.front()) + " waits for it";
  v.comms = comms;
  const std::string report = DivergenceReport(states, v);
  std::fprintf(stderr, "%s%s", report.c_str(), FlightLine(WorldRank(), report).c_str());
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the launcher forwards it
}

// Before MPI is finalized (Python's exit): no more MPI calls from the watchdog.
inline void StopWatchdog() {
  if (!watchdog_started.load() || watchdog_stopped.load()) return;
  watchdog_stop.store(true);
  // The watchdog sees the flag within 50 ms, wherever it is; the bound is for
  // a thread stuck inside MPI itself (a broken MPI), which finalize may then meet.
  for (int i = 0; i < 2000 && !watchdog_stopped.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

inline void StartWatchdog() {
  if (watchdog_started.exchange(true)) return;
  NoteWorld();
  InstallSigusr1();
  std::thread(Watchdog).detach();
}

}  // namespace mpicoll

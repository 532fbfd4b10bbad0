// The watchdog: a thread per process that watches what the local devices are
// in (in_flight.h's in_flight) and, when a collective waits,
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
#include <string>
#include <thread>
#include <vector>

#include "../engine/call.h"
#include "../engine/dtypes.h"
#include "guard.h"
#include "rank_state.h"
#include "records_file.h"
#include "reports.h"
#include "signals.h"

namespace mpicoll {


// How long a report waits for the other ranks' flight records (GatherRecords):
// their watchdogs take the notice within 50 ms; a rank that cannot answer
// keeps its records in its own node's folder.
constexpr double kGatherRecordsWithin = 2.0;
// An end notice goes to every rank, most of which never receive it (only a
// rank that waits takes notices): it must stay below the MPIs' eager limit
// (Open MPI's shared memory: 4 KiB), or an unreceived send would stay pending
// at MPI_Finalize.  Its records (each device's last few) are left out where
// even one per device would not fit.
constexpr size_t kEndNoticeBytes = 4000;
constexpr size_t kEndNoticeRecords[] = {8, 4, 2, 1};

inline std::vector<char> IntBytes(int value) {
  std::vector<char> bytes(sizeof(int));
  std::memcpy(bytes.data(), &value, sizeof(int));
  return bytes;
}

// ---------------------------------------------------------------------------
// Uncaught exceptions: the rank whose error ends the job prints it; every
// other rank's watchdog says in one line which rank that was, and a rank that
// raised at the same moment (the same error on every rank, typically) prints
// one line instead of a second copy of the traceback.
struct AbortAgreement {
  static constexpr int kNobody = 1 << 30;
  std::atomic<int> lowest{kNobody};  // the lowest rank that announced an abort
  std::atomic<int> printing{-1};     // a rank that said it prints the traceback
  std::atomic<bool> this_rank{false};  // this rank is ending the job

  // Notes that `rank` aborts; whether it is the first abort this rank hears of.
  bool Note(int rank) {
    int seen = lowest.load();
    const bool first = seen == kNobody;
    while (rank < seen && !lowest.compare_exchange_weak(seen, rank)) {
    }
    return first;
  }
};
inline AbortAgreement aborts;

inline void TakeAbortNotices() {
  // Each notice is taken for what it says alone: MPI orders a sender's messages
  // only within a tag, so a traceback notice may come before that rank's abort notice.
  ReceiveEach(kTracebackNoticeTag, [](int, const std::vector<char>& bytes) {
    int none = -1;
    aborts.printing.compare_exchange_strong(none, IntOf(bytes));
  });
  ReceiveEach(kAbortNoticeTag, [](int, const std::vector<char>& bytes) {
    const int who = IntOf(bytes);
    if (aborts.Note(who) && !aborts.this_rank.load()) {
      std::fprintf(stderr, "mpicoll: rank %d: the job is being aborted by rank %d (its error is "
                   "printed there)\n", WorldRank(), who);
      std::fflush(stderr);
      const std::string why = "aborted by rank " + std::to_string(who);
      DumpFlight(WorldRank(), comm_world.size.load(), why);
      WriteTrace(WorldRank(), comm_world.size.load(), why);
    }
  });
  // A rank that writes a report (a divergence, a stall, a timeout, the
  // traceback that ends the job) asks for every rank's records in its folder;
  // taken after the abort notices, which name the reason better.
  ReceiveEach(kDumpNoticeTag, [](int source, const std::vector<char>& bytes) {
    const std::string why = "rank " + std::to_string(IntOf(bytes)) + " wrote a report";
    DumpFlight(WorldRank(), comm_world.size.load(), why);
    SendRecords(source, why);
  });
}


// Called by a rank about to abort the job for an uncaught exception: tells the
// others, waits `settle_ms` for the notices of ranks that raised at the same
// time, and returns the rank that prints the traceback: one that already said
// it does (it decided before this rank's notice reached it), else the lowest
// rank ending the job (this one or lower), which then says so.  So one rank
// prints it however far apart the ranks raise.
inline int AnnounceAbort(int settle_ms) {
  const int me = WorldRank();
  aborts.this_rank.store(true);
  aborts.Note(me);
  if (!SideChannelUp()) {
    DumpFlight(me, comm_world.size.load(), "an uncaught exception on this rank");
    WriteTrace(me, comm_world.size.load(), "an uncaught exception on this rank");
    return me;
  }
  SendToEveryRank(IntBytes(me), kAbortNoticeTag, /*wait_ms=*/0);
  DumpFlight(me, comm_world.size.load(), "an uncaught exception on this rank");
  WriteTrace(me, comm_world.size.load(), "an uncaught exception on this rank");
  std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
  TakeAbortNotices();
  const int printing = aborts.printing.load();
  if (printing >= 0) return printing;
  const int lowest = std::min(me, aborts.lowest.load());
  if (lowest == me) SendToEveryRank(IntBytes(me), kTracebackNoticeTag, /*wait_ms=*/0);
  return lowest;
}

// Asks every other rank still running for its flight records (a dump notice)
// and writes them into this rank's folder as they come, for up to `seconds`.
inline void GatherRecords(double seconds) {
  if (!SideChannelUp() || !CollectingRecords()) return;
  std::vector<int> running;
  for (int r = 0; r < comm_world.size.load(); ++r) {
    RankState ended;
    if (r == WorldRank()) continue;
    if (!ended_ranks.Has(r, &ended)) {
      running.push_back(r);
    } else if (!ended.records.empty()) {  // it sent its last records with its end notice
      KeepRecords(r, ended.records);
    }
  }
  SendToRanks(IntBytes(WorldRank()), kDumpNoticeTag, running, /*wait_ms=*/0);
  CollectRecords(running, seconds);
}

// Writes this rank's flight records, with `why` (a report) as their reason,
// gathers the other ranks' beside them, and says where, for the report.
inline std::string FlightLine(int me, const std::string& why, bool gather = true) {
  if (!DumpFlight(me, comm_world.size.load(), why)) {
    // Records off say nothing; records that could not be written say why.
    const bool wanted = flight.capacity.load() > 0 && !FolderOf(flight.flight_dir).empty();
    const std::string problem = wanted ? LastWriteProblem() : std::string();
    return problem.empty() ? std::string() : "  flight records: not written (" + problem + ")\n";
  }
  if (gather) GatherRecords(kGatherRecordsWithin);
  const std::string dir = FolderOf(flight.flight_dir);
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
  for (int i = 0; i < 100 && !watchdog.stop.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ServeStateRequests();
    TakeAbortNotices();  // the reporting rank asks for this rank's records
  }
  return watchdog.stop.load();
}

[[noreturn]] inline void ReportDivergenceAndAbort(const std::vector<RankState>& states,
                                                  const Verdict& v) {
  const std::string report = DivergenceReport(states, v);
  std::fprintf(stderr, "%s%s", report.c_str(), FlightLine(WorldRank(), report).c_str());
  WriteTrace(WorldRank(), comm_world.size.load(), "a divergence");
  AbortJob(3);
}

// SIGUSR2 (`python -m mpicoll stacks` sends it to one rank): where every rank
// is, its collective or its Python stack, printed and written to
// stacks-<pid>.txt in this user's private folder of the temporary directory
// (<tmp>/mpicoll-<uid>, own_files.h) for the command to read.
inline void WriteStacksReport() {
  const int me = WorldRank();
  const std::vector<RankState> states = EveryRanksState({}, kForStacks);
  std::string text = "mpicoll: where every rank is (asked on rank " + std::to_string(me) + ")\n";
  for (size_t r = 0; r < states.size(); ++r) text += RankLine(static_cast<int>(r), states[r], {});
  std::fprintf(stderr, "%s", text.c_str());
  std::fflush(stderr);
  const std::string dir = FolderOf(flight.private_root);
  WriteFileAtomically(dir, "stacks-" + std::to_string(getpid()) + ".txt", text);
}

// When this rank's oldest wait in flight began (0: none).
inline int64_t EarliestWaitStart() {
  int64_t earliest = 0;
  for (int d = 0; d <= kSetupSlot; ++d) {
    const int64_t started = in_flight[d].started_ns.load(std::memory_order_acquire);
    if (started != 0 && (earliest == 0 || started < earliest)) earliest = started;
  }
  return earliest;
}

inline void Watchdog() {
  // Every return (the loop checks watchdog.stop at least every 50 ms, the
  // state requests every 2 ms) tells StopWatchdog that no MPI call follows.
  struct Stopped {
    ~Stopped() { watchdog.stopped.store(true); }
  } stopped;
  int64_t episode = 0;       // started_ns of the wait being reported on
  double next_report = 0;    // s into that wait
  double next_probe = 0;     // s into that wait
  int64_t probed_ends = 0;   // ended_ranks.ChangedNs() at the last probe
  std::string last_verdict;  // a deadlock's key, to see it hold twice
  int64_t came_seen = 0;     // the episode seen with every rank come to its call
  for (;;) {
    const double limit = watch_settings.timeout_seconds.load();
    const double stall = watch_settings.stall_report_seconds.load();
    // Fast while the side channel opens: Open MPI's nonblocking duplicate
    // moves only when tested, a round per test (0.7 s at 50 ms ticks).
    const bool opening = side_channel_opening.Underway();
    std::this_thread::sleep_for(std::chrono::milliseconds(
        opening ? 1 : (limit > 0 && limit < 2) || (stall > 0 && stall < 2) ? 20 : 50));
    if (watchdog.stop.load()) return;
    side_channel_opening.Step();
    ServeStateRequests();
    TakeAbortNotices();
    ended_ranks.TakeNotices();
    if (signal_requests.flight_dump.exchange(false)) {
      DumpFlight(WorldRank(), comm_world.size.load(), "SIGUSR1");
      WriteTrace(WorldRank(), comm_world.size.load(), "SIGUSR1");
    }
    if (signal_requests.stacks.exchange(false)) WriteStacksReport();
    const int64_t now = NowNs();
    const int64_t earliest = EarliestWaitStart();
    if (earliest == 0) continue;
    const double waited = (now - earliest) * 1e-9;
    if (earliest != episode) {
      episode = earliest, next_report = stall, next_probe = kProbeAfter, last_verdict.clear();
    }
    const int me = WorldRank();
    // A wait that can never end: asked after kProbeAfter, then with back-off,
    // and at once when a rank has ended meanwhile.
    const int64_t ends = ended_ranks.ChangedNs();
    if (SideChannelUp() && comm_world.size.load() > 1 &&
        (waited >= next_probe || (ends != probed_ends && waited >= 0.1))) {
      probed_ends = ends;
      if (waited >= next_probe) next_probe = std::max(2 * next_probe, waited + kProbeAfter);
      const std::vector<Membership> known = WaitedMemberships();
      std::vector<uint64_t> asked;
      for (const Membership& m : known) asked.push_back(m.hash);
      const std::vector<RankState> states =
          EveryRanksState(asked, kProbe, kProbeAnswerWithin);
      if (watchdog.stop.load()) return;
      const Verdict v = FindDivergence(states, known);
      if (v.found && (v.certain || v.key == last_verdict)) {
        // A rank whose process exits writes the report itself; the launcher
        // ends this one meanwhile (or, should it not, this one reports).
        if (v.exiting >= 0) std::this_thread::sleep_for(std::chrono::seconds(2));
        if (!DeferToLowerRank(states, v)) ReportDivergenceAndAbort(states, v);
        return;  // the job is ending
      }
      last_verdict = v.found ? v.key : std::string();
      if (v.found) next_probe = waited + kProbeAfter;  // look again soon
    }
    const bool timed_out = limit > 0 && waited >= limit;
    if (!timed_out && !(stall > 0 && waited >= next_report)) continue;
    std::vector<RankState> states = EveryRanksState(WaitedComms(), kForReport);
    if (watchdog.stop.load()) return;  // the wait ended and the process is exiting
    // The wait ended while the states were gathered (the late rank came): a
    // report now would be of the next wait, 0 s in, or of nobody.
    if (EarliestWaitStart() != earliest) continue;
    std::string report = StallReport(states, me, /*always=*/false);
    const CallState* longest = LongestWait(states[me]);
    if (!timed_out && longest && EveryMemberCame(states, *longest) && came_seen != episode) {
      came_seen = episode;  // ending as the late rank's call completes: look again later
      report.clear();
    }
    if (timed_out) {
      // One report for the job: the lowest stalled rank's.  The others give it
      // a moment to end the job, then end it themselves.  They answer its state
      // requests meanwhile: it is asking them for the report that ends the job.
      if (report.empty()) {
        for (int i = 0; i < 100 && !watchdog.stop.load(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          ServeStateRequests();
        }
        if (watchdog.stop.load()) return;
        report = StallReport(states, me, /*always=*/true);
      }
      const std::string line = TimeoutLine(me, limit, states[me]);
      std::fprintf(stderr, "%s%s%s", report.c_str(), FlightLine(me, report + line).c_str(),
                   line.c_str());
      WriteTrace(me, comm_world.size.load(), "MPICOLL_TIMEOUT");
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
  // A rank that ends right after its import waits for the channel (the others
  // are on their way to it), but not forever: a rank that never imports mpicoll.
  side_channel_opening.Finish(/*seconds=*/5.0);
  if (!SideChannelUp() || comm_world.size.load() == 1) return;
  RankState mine = OwnState({}, /*all_comms=*/true);
  mine.head.ending = ending;
  mine.head.exit_code = code;
  Copy(mine.head.ended_at, sizeof(mine.head.ended_at), where);
  mine.calls.resize(std::min<size_t>(mine.calls.size(), 8));  // a small, eager message
  mine.head.count = static_cast<int32_t>(mine.calls.size());
  // Its last few records, for a report another rank writes after this one has
  // gone: the reporter writes them into its folder (every node may have its
  // own).  Nothing is written here: a normal end leaves the files as they were.
  const std::string why = "rank " + std::to_string(WorldRank()) + " " + EndedLine(mine);
  const size_t without_records = Pack(mine).size();
  for (size_t last : kEndNoticeRecords) {
    if (!CollectingRecords()) break;
    mine.records = RecordsMessage(why, last);
    if (without_records + mine.records.size() <= kEndNoticeBytes) break;
    mine.records.clear();
  }
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
  // Not gathered: the launcher may end the others as soon as this process exits.
  std::fprintf(stderr, "%s%s", report.c_str(),
               FlightLine(WorldRank(), report, /*gather=*/false).c_str());
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the launcher forwards it
}

// Before MPI is finalized (Python's exit): no more MPI calls from the watchdog.
inline void StopWatchdog() {
  if (!watchdog.started.load() || watchdog.stopped.load()) return;
  watchdog.stop.store(true);
  // The watchdog sees the flag within 50 ms, wherever it is; the bound is for
  // a thread stuck inside MPI itself (a broken MPI), which finalize may then meet.
  for (int i = 0; i < 2000 && !watchdog.stopped.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

inline void StartWatchdog() {
  if (watchdog.started.exchange(true)) return;
  NoteWorld();
  InstallSignalHandlers();
  std::thread(Watchdog).detach();
}

}  // namespace mpicoll

// The watchdog: a thread per process that watches what the local devices are
// in (guard.h's in_flight) and, when a collective has waited too long,
//   * after MPICOLL_STALL_REPORT seconds (default 60), writes one stall report
//     for the job: the collective, its call site and sequence number, the
//     ranks that have arrived in it and, for every other rank, what that rank
//     is doing now (in another collective, or not in mpicoll for how long, or
//     no answer); repeated with back-off (x2) while the stall lasts;
//   * after MPICOLL_TIMEOUT seconds (default 600), writes that report as the
//     reason and aborts the job.
// What another rank is doing comes over a side channel that needs none of the
// stuck threads: a private duplicate of COMM_WORLD on which every rank's
// watchdog answers state requests (MPI_Iprobe every 100 ms).  It needs
// MPI_THREAD_MULTIPLE; in the serialized mode the report holds this rank's
// view only.  Only the lowest stalled rank prints, so the job gets one report.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "call.h"
#include "dtypes.h"
#include "guard.h"

namespace mpicoll {

inline std::atomic<MPI_Comm> side_channel{MPI_COMM_NULL};  // set once COMM_WORLD is registered
inline std::atomic<bool> watchdog_started{false};
// Python's exit handler sets stop before MPI is finalized and waits for
// stopped: after it the watchdog makes no MPI call.
inline std::atomic<bool> watchdog_stop{false}, watchdog_stopped{false};

constexpr int kStateRequestTag = 7301;
constexpr int kStateReplyTag = 7302;
constexpr int kAbortNoticeTag = 7303;  // "rank r is ending the job" (an uncaught exception)
constexpr int kTracebackNoticeTag = 7304;  // "rank r prints the traceback that ends it"
constexpr double kAnswerWithin = 3.0;  // s a report waits for the other ranks' answers


// One rank's answer: what its busiest device is doing.  Plain bytes on the wire.
struct RankState {
  int32_t world_rank = -1;
  int32_t in_collective = 0;
  double seconds = 0;  // in the collective, or since the rank last left one
  uint64_t sequence = 0;
  char comm[64] = {};
  char call[96] = {};  // e.g. allreduce(float32[4])
  char role[64] = {};  // e.g. rank 1, local device 0
  char site[160] = {};
  char host[64] = {};
};

inline void Copy(char* into, size_t size, const std::string& text) {
  std::snprintf(into, size, "%s", text.c_str());
}

// Every rank's host name, gathered when the side channel opens (comm.py): a
// rank that cannot answer (its host is gone) is still named with its host.
inline std::mutex hosts_mutex;
inline std::vector<std::string> world_hosts;
inline std::string HostOf(int rank) {
  std::lock_guard<std::mutex> lock(hosts_mutex);
  return rank >= 0 && rank < static_cast<int>(world_hosts.size()) ? world_hosts[rank]
                                                                   : std::string("?");
}

// COMM_WORLD's rank and size, read once by the thread that starts the watchdog
// (in the serialized mode the watchdog thread may not call MPI).
inline std::atomic<int> world_rank{-1}, world_size{1};
inline int WorldRank() { return world_rank.load(); }

// The user's name of a communicator: mpicoll's duplicates are named
// "mpicoll:<name>:device<k>" (comm.py).
inline std::string UserCommName(std::string name) {
  const std::string prefix = "mpicoll:";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  const size_t device = name.rfind(":device");
  return device == std::string::npos ? name : name.substr(0, device);
}

// This rank's state: the device that has waited longest in a collective, or,
// when none is in one, how long since any left one.
inline RankState OwnState() {
  RankState s;
  s.world_rank = WorldRank();
  char host[64] = {};
  gethostname(host, sizeof(host) - 1);
  Copy(s.host, sizeof(s.host), host);
  const int64_t now = NowNs();
  int busiest = -1;
  int64_t earliest = 0, last_left = 0;
  for (int d = 0; d <= kSetupSlot; ++d) {
    const int64_t started = in_flight[d].started_ns.load(std::memory_order_acquire);
    last_left = std::max(last_left, in_flight[d].left_ns.load(std::memory_order_relaxed));
    if (started != 0 && (busiest < 0 || started < earliest)) busiest = d, earliest = started;
  }
  if (busiest < 0) {
    s.seconds = (now - (last_left ? last_left : process_start_ns)) * 1e-9;
    return s;
  }
  const InFlight& f = in_flight[busiest];
  s.in_collective = 1;
  s.seconds = (now - earliest) * 1e-9;
  if (busiest == kSetupSlot) {
    Copy(s.call, sizeof(s.call), f.name.load() ? f.name.load() : "communicator setup");
    Copy(s.comm, sizeof(s.comm), "MPI_COMM_WORLD");
    return s;
  }
  s.sequence = f.sequence.load(std::memory_order_relaxed);
  Copy(s.comm, sizeof(s.comm),
       serialize_mpi_calls.load() ? std::string("its communicator")
                                  : UserCommName(CommName(f.comm.load(std::memory_order_relaxed))));
  Copy(s.call, sizeof(s.call),
       std::string(f.name.load() ? f.name.load() : "?") + "(" +
           DtypeName(static_cast<ffi::DataType>(f.dtype.load())) + "[" +
           std::to_string(f.count.load()) + "])");
  Copy(s.role, sizeof(s.role), "rank " + std::to_string(f.rank.load()) + ", local device " +
                                   std::to_string(busiest));
  Copy(s.site, sizeof(s.site), SiteText(f.site.load(std::memory_order_relaxed)));
  return s;
}

inline bool SideChannelUp() {
  return side_channel.load() != MPI_COMM_NULL && !serialize_mpi_calls.load();
}

// Receives every pending message with `tag` on the side channel (one int each)
// and hands it to handle(source, value); nothing where the channel is down.
template <typename Handle>
inline void ReceiveEach(int tag, Handle&& handle) {
  if (!SideChannelUp()) return;
  MPI_Comm comm = side_channel.load();
  for (;;) {
    // A matched probe: the main thread may take abort notices at the same
    // time (AnnounceAbort), and a plain probe-then-receive could leave one
    // thread blocked in a receive whose message the other took.
    int pending = 0;
    MPI_Message message;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, tag, comm, &pending, &message, &status) != MPI_SUCCESS ||
        !pending) {
      return;
    }
    int value = -1;
    MPI_Mrecv(&value, 1, MPI_INT, &message, MPI_STATUS_IGNORE);
    handle(status.MPI_SOURCE, value);
  }
}

// Answers every pending state request (the watchdog's loop, and while a report
// waits for its own answers, so that two reporting ranks never wait on each other).
// A request comes with a stall report, so this rank's flight records are
// written too (DumpFlight writes at most once a second).
inline void ServeStateRequests() {
  ReceiveEach(kStateRequestTag, [](int source, int) {
    RankState mine = OwnState();
    MPI_Send(&mine, sizeof(mine), MPI_BYTE, source, kStateReplyTag, side_channel.load());
    DumpFlight(WorldRank(), world_size.load(),
               "a stall report on rank " + std::to_string(source) + " asked");
  });
}

// Uncaught exceptions: the rank whose error ends the job prints it; every
// other rank's watchdog says in one line which rank that was, and a rank that
// raised at the same moment (the same error on every rank, typically) prints
// one line instead of a second copy of the traceback.
inline std::atomic<int> lowest_aborting{1 << 30};  // the lowest rank that announced an abort
inline std::atomic<int> printing_rank{-1};            // a rank that prints the traceback
inline std::atomic<bool> this_rank_aborting{false};

inline void TakeAbortNotices() {
  // Each notice is taken for what it says alone: MPI orders a sender's messages
  // only within a tag, so a traceback notice may come before that rank's abort notice.
  ReceiveEach(kTracebackNoticeTag, [](int, int who) {
    int none = -1;
    printing_rank.compare_exchange_strong(none, who);
  });
  ReceiveEach(kAbortNoticeTag, [](int, int who) {
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

inline void NoticeToEveryRank(int tag, MPI_Comm comm) {
  static const int me = WorldRank();  // the sends' buffer, never written again
  for (int r = 0; r < world_size.load(); ++r) {
    if (r == me) continue;
    MPI_Request request;
    if (MPI_Isend(&me, 1, MPI_INT, r, tag, comm, &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);
    }
  }
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
  MPI_Comm comm = side_channel.load();
  NoticeToEveryRank(kAbortNoticeTag, comm);
  DumpFlight(me, world_size.load(), "an uncaught exception on this rank");
  WriteTrace(me, world_size.load(), "an uncaught exception on this rank");
  std::this_thread::sleep_for(std::chrono::milliseconds(settle_ms));
  TakeAbortNotices();
  const int printing = printing_rank.load();
  if (printing >= 0) return printing;
  const int lowest = std::min(me, lowest_aborting.load());
  if (lowest == me) NoticeToEveryRank(kTracebackNoticeTag, comm);
  return lowest;
}

// Every rank's state, this one's included; a rank that does not answer within
// kAnswerWithin seconds keeps world_rank = -1.
inline std::vector<RankState> EveryRanksState() {
  const int size = world_size.load(), me = WorldRank();
  std::vector<RankState> states(size);
  states[me] = OwnState();
  if (!SideChannelUp() || size == 1) return states;
  MPI_Comm comm = side_channel.load();
  static int request = 0;
  std::vector<MPI_Request> sends;
  for (int r = 0; r < size; ++r) {
    if (r == me) continue;
    sends.emplace_back();
    MPI_Isend(&request, 1, MPI_INT, r, kStateRequestTag, comm, &sends.back());
  }
  int answered = 1;
  const int64_t deadline = NowNs() + static_cast<int64_t>(kAnswerWithin * 1e9);
  // Polls rather than blocks, so that it answers requests meanwhile and sees
  // watchdog_stop: the process may be about to finalize MPI.
  while (answered < size && NowNs() < deadline && !watchdog_stop.load()) {
    ServeStateRequests();
    int pending = 0;
    MPI_Message message;
    MPI_Status status;
    MPI_Improbe(MPI_ANY_SOURCE, kStateReplyTag, comm, &pending, &message, &status);
    if (!pending) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    RankState theirs;
    MPI_Mrecv(&theirs, sizeof(theirs), MPI_BYTE, &message, MPI_STATUS_IGNORE);
    if (states[status.MPI_SOURCE].world_rank < 0) ++answered;
    states[status.MPI_SOURCE] = theirs;
  }
  // Requests to ranks that never answered stay posted; they match nothing else.
  for (auto& send : sends) MPI_Request_free(&send);
  return states;
}

inline std::string Describe(const RankState& s) {
  std::string text = std::string(s.call) + " on " + s.comm;
  if (s.role[0]) text += std::string(" (as ") + s.role + ")";
  if (s.sequence) text += ", sequence " + std::to_string(s.sequence);
  if (s.site[0]) text += std::string(", called at ") + s.site;
  return text;
}

// The report, from this rank's point of view (`stalled`: this rank's state);
// empty if a lower rank is stalled too (it reports).  "Stalled" with half the
// threshold's tolerance: ranks enter a collective a little apart, and a lower
// rank that arrived last is about to reach the threshold and report itself.
inline std::string StallReport(const std::vector<RankState>& states, int me, bool always) {
  const RankState& mine = states[me];
  for (int r = 0; r < me && !always; ++r) {
    if (states[r].world_rank >= 0 && states[r].in_collective &&
        states[r].seconds >= 0.5 * stall_report_seconds.load()) {
      return std::string();
    }
  }
  char head[256];
  std::snprintf(head, sizeof(head), "mpicoll: stall report from rank %d (%s): waiting %.1f s in ",
                me, mine.host, mine.seconds);
  std::string text = head + Describe(mine) + "\n";
  std::vector<int> arrived, elsewhere;
  for (size_t r = 0; r < states.size(); ++r) {
    const RankState& s = states[r];
    if (s.world_rank >= 0 && s.in_collective && s.sequence == mine.sequence &&
        std::strcmp(s.comm, mine.comm) == 0 && std::strcmp(s.call, mine.call) == 0) {
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
    text += "  (the other ranks cannot be asked: MPI_THREAD_SERIALIZED, or COMM_WORLD not yet "
            "used by mpicoll)\n";
    return text;
  }
  for (int r : elsewhere) {
    const RankState& s = states[r];
    char line[256];
    if (s.world_rank < 0) {
      std::snprintf(line, sizeof(line), "  rank %d (%s): no answer within %.0f s", r,
                    HostOf(r).c_str(), kAnswerWithin);
      text += std::string(line) + " (its process is gone, stopped, or its host unreachable)\n";
    } else if (s.in_collective) {
      std::snprintf(line, sizeof(line), "  rank %d (%s): for %.1f s in ", r, s.host, s.seconds);
      text += line + Describe(s) + "\n";
    } else {
      std::snprintf(line, sizeof(line), "  rank %d (%s): not in an mpicoll collective for %.1f s",
                    r, s.host, s.seconds);
      text += std::string(line) + "\n";
    }
  }
  return text;
}

// The line a timeout ends the job with: what this rank's longest wait is in.
inline std::string TimeoutLine(int me, double limit) {
  const int64_t now = NowNs();
  int d = -1;
  int64_t earliest = 0;
  for (int k = 0; k <= kSetupSlot; ++k) {
    const int64_t started = in_flight[k].started_ns.load(std::memory_order_acquire);
    if (started != 0 && (d < 0 || started < earliest)) d = k, earliest = started;
  }
  char line[512];
  if (d < 0) {
    std::snprintf(line, sizeof(line), "mpicoll: rank %d: MPICOLL_TIMEOUT=%g; aborting the job\n",
                  me, limit);
  } else if (d == kSetupSlot) {
    std::snprintf(line, sizeof(line),
                  "mpicoll: rank %d has waited %.1f s in %s (MPICOLL_TIMEOUT=%g): this is "
                  "collective, so another rank has not reached its first collective on that "
                  "communicator; aborting the job\n",
                  me, (now - earliest) * 1e-9, in_flight[d].name.load(), limit);
  } else {
    const std::string comm = serialize_mpi_calls.load()
        ? std::string("its communicator") : UserCommName(CommName(in_flight[d].comm.load()));
    std::snprintf(line, sizeof(line),
                  "mpicoll: rank %d (rank %d of %s, local device %d) has waited %.1f s in %s "
                  "(MPICOLL_TIMEOUT=%g); aborting the job\n",
                  me, in_flight[d].rank.load(), comm.c_str(), d, (now - earliest) * 1e-9,
                  in_flight[d].name.load(), limit);
  }
  return line;
}

// Writes this rank's flight records (the other ranks write theirs when asked
// for their state) and says where, for the report.
inline std::string FlightLine(int me, const char* why) {
  if (!DumpFlight(me, world_size.load(), why)) return std::string();
  return "  flight records: " + flight_dir + "/rank*.json (python -m mpicoll flight " +
         flight_dir + ")\n";
}

inline void Watchdog() {
  // Every return (the loop checks watchdog_stop at least every 20 ms, the
  // state requests every 5 ms) tells StopWatchdog that no MPI call follows.
  struct Stopped {
    ~Stopped() { watchdog_stopped.store(true); }
  } stopped;
  int64_t episode = 0;      // started_ns of the wait being reported on
  double next_report = 0;   // s into that wait
  for (;;) {
    double limit = timeout_seconds.load(), stall = stall_report_seconds.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(
        (limit > 0 && limit < 2) || (stall > 0 && stall < 2) ? 20 : 100));
    if (watchdog_stop.load()) return;
    ServeStateRequests();
    TakeAbortNotices();
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
    if (earliest != episode) episode = earliest, next_report = stall;
    const bool timed_out = limit > 0 && waited >= limit;
    if (!timed_out && !(stall > 0 && waited >= next_report)) continue;
    const int me = WorldRank();
    std::vector<RankState> states = EveryRanksState();
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
      std::fprintf(stderr, "%s%s%s", report.c_str(), FlightLine(me, "the timeout").c_str(),
                   TimeoutLine(me, limit).c_str());
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
      std::fprintf(stderr, "%s%s%s", report.c_str(), FlightLine(me, "a stall report").c_str(),
                   tail);
      std::fflush(stderr);
    }
    next_report *= 2;
  }
}

// Before MPI is finalized (Python's exit): no more MPI calls from the watchdog.
inline void StopWatchdog() {
  if (!watchdog_started.load() || watchdog_stopped.load()) return;
  watchdog_stop.store(true);
  // The watchdog sees the flag within 20 ms, wherever it is; the bound is for
  // a thread stuck inside MPI itself (a broken MPI), which finalize may then meet.
  for (int i = 0; i < 2000 && !watchdog_stopped.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// COMM_WORLD's rank and size, from a thread that may call MPI (Python's, at import).
inline void NoteWorld() {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  world_rank.store(rank);
  world_size.store(size);
}

inline void StartWatchdog() {
  if (watchdog_started.exchange(true)) return;
  NoteWorld();
  InstallSigusr1();
  std::thread(Watchdog).detach();
}

}  // namespace mpicoll

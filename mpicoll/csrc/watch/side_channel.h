// The watchdogs' side channel (watchdog.h, rank_state.h): a private duplicate
// of COMM_WORLD, made without blocking at import (MPI_Comm_idup, completed by
// the watchdog thread), so the ranks can ask each other from the job's first
// collective on, even when one rank never reaches it.  It needs
// MPI_THREAD_MULTIPLE; in the serialized mode Python makes it at COMM_WORLD's
// first use and the watchdog thread, which may not call MPI there, leaves it
// alone.  Here: its tags, its opening (with every rank's host and pid), sending
// and receiving on it, and the flight records a report gathers over it.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../engine/call.h"
#include "records_file.h"
#include "serialized.h"

namespace mpicoll {
inline std::atomic<MPI_Comm> side_channel{MPI_COMM_NULL};  // set once it is open

// The watchdog thread's life (watchdog.h): started once; Python's exit handler
// sets stop before MPI is finalized and waits for stopped, after which the
// watchdog makes no MPI call.
struct WatchdogThread {
  std::atomic<bool> started{false}, stop{false}, stopped{false};
};
inline WatchdogThread watchdog;

constexpr int kStateRequestTag = 7301;
constexpr int kStateReplyTag = 7302;
constexpr int kAbortNoticeTag = 7303;      // "rank r is ending the job" (an uncaught exception)
constexpr int kTracebackNoticeTag = 7304;  // "rank r prints the traceback that ends it"
constexpr int kEndNoticeTag = 7305;        // "rank r has ended: its last calls are ..."
constexpr int kDumpNoticeTag = 7306;       // "rank r reports a divergence: write your records"
constexpr int kRecordsTag = 7307;          // a rank's flight records, for the reporting rank's folder
constexpr double kAnswerWithin = 3.0;      // s a report waits for the other ranks' answers
constexpr double kProbeAnswerWithin = 1.0;  // s a probe waits: a rank that cannot answer
                                            // is not asked again for 3 s at each probe

inline void Copy(char* into, size_t size, const std::string& text) {
  std::snprintf(into, size, "%s", text.c_str());
}

// COMM_WORLD's rank and size, read once by the thread that starts the watchdog
// (in the serialized mode the watchdog thread may not call MPI), and every
// rank's host, gathered when the side channel opens (HostOf).
struct CommWorld {
  std::atomic<int> rank{-1}, size{1};
  std::mutex hosts_mutex;
  std::vector<std::string> hosts;  // by rank, under hosts_mutex
};
inline CommWorld comm_world;
inline int WorldRank() { return comm_world.rank.load(); }

inline void NoteWorld() {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  comm_world.rank.store(rank);
  comm_world.size.store(size);
}

inline bool SideChannelUp() {
  return side_channel.load() != MPI_COMM_NULL && !serialized_mpi.on.load();
}

// ---------------------------------------------------------------------------
// Every rank's host name and process id, gathered when the side channel
// opens: a rank that cannot answer (its host is gone) is still named with its
// host, and the job's flight records go to one folder named after rank 0's.
struct ProcessId {
  char host[64] = {};
  int64_t pid = 0;
};

inline std::string HostOf(int rank) {
  std::lock_guard<std::mutex> lock(comm_world.hosts_mutex);
  return rank >= 0 && rank < static_cast<int>(comm_world.hosts.size()) ? comm_world.hosts[rank]
                                                                   : std::string("?");
}

// The job's flight folder in this user's private folder (flight.h), where
// MPICOLL_FLIGHT_DIR is not set; this process's own until the ranks have met.
inline void ChooseJobFlightDir(const std::string& host, int64_t pid) {
  std::lock_guard<std::mutex> lock(flight.mutex);
  if (flight.job_flight_dir) {
    flight.flight_dir = flight.private_root + "/flight-" + host + "-" + std::to_string(pid);
  }
}

inline void SetWorldProcesses(const std::vector<ProcessId>& all) {
  std::vector<std::string> hosts;
  for (const ProcessId& p : all) hosts.emplace_back(p.host);
  {
    std::lock_guard<std::mutex> lock(comm_world.hosts_mutex);
    comm_world.hosts = std::move(hosts);
  }
  if (!all.empty()) ChooseJobFlightDir(all[0].host, all[0].pid);
}

inline ProcessId ThisProcess() {
  ProcessId me;
  gethostname(me.host, sizeof(me.host) - 1);
  me.pid = static_cast<int64_t>(getpid());
  return me;
}

// The nonblocking opening (MULTIPLE mode): MPI_Comm_idup at import, then an
// MPI_Iallgather of every rank's ProcessId, both completed by the watchdog's
// polls (Step), or by a rank that ends right after its import (Finish).
class SideChannelOpening {
 public:
  // kFailed: a rank was lost (ULFM) before the channel opened; it never will.
  enum Stage { kNone = 0, kDuplicating = 1, kGathering = 2, kOpen = 3, kFailed = 4 };

  void Begin() {
    if (stage_.load() != kNone || serialized_mpi.on.load()) return;
    if (MPI_Comm_idup(MPI_COMM_WORLD, &channel_, &request_) == MPI_SUCCESS) {
      stage_.store(kDuplicating);
    }
  }

  // One poll: moves to the next stage when the pending request has completed.
  void Step() {
    std::lock_guard<std::mutex> lock(mutex_);
    const int stage = stage_.load();
    if (stage != kDuplicating && stage != kGathering) return;
    int done = 0;
    if (const int rc = MPI_Test(&request_, &done, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
      // A failed process (a fault-tolerant job): the opening is over, and the
      // rank's first use of COMM_WORLD raises what it says (Failure).
      const std::string what = stage == kDuplicating
          ? "mpicoll: opening the watchdogs' side channel (MPI_Comm_idup of COMM_WORLD)"
          : "mpicoll: opening the watchdogs' side channel (MPI_Iallgather)";
      failure_ = MpiFailureText(what, stage == kDuplicating ? MPI_COMM_WORLD : channel_, rc);
      stage_.store(kFailed);
      return;
    }
    if (!done) {
      // ULFM may leave the duplicate pending, not failed, when a rank died before
      // its import: the opening is over as soon as this process knows of a failure
      // (else a survivor's import would wait its 10 s for it, Finish).
      if (KnownFailedProcess(MPI_COMM_WORLD)) {
        failure_ = MpiFailureText(
            "mpicoll: opening the watchdogs' side channel (a process of COMM_WORLD failed)",
            MPI_COMM_WORLD, kProcessFailed);
        stage_.store(kFailed);
      }
      return;
    }
    if (stage == kDuplicating) {
      MPI_Comm_set_name(channel_, "mpicoll:watchdog");
      MPI_Comm_set_errhandler(channel_, MPI_ERRORS_RETURN);
      mine_ = ThisProcess();
      all_.assign(comm_world.size.load(), ProcessId());
      MPI_Iallgather(&mine_, sizeof(ProcessId), MPI_BYTE, all_.data(), sizeof(ProcessId),
                     MPI_BYTE, channel_, &request_);
      stage_.store(kGathering);
      return;
    }
    SetWorldProcesses(all_);
    side_channel.store(channel_);
    stage_.store(kOpen);
  }

  // Completes the opening within `seconds` (a rank that ends right after its
  // import: the others wait for it on the channel).
  void Finish(double seconds) {
    const int64_t deadline = NowNs() + static_cast<int64_t>(seconds * 1e9);
    while (Underway() && NowNs() < deadline) {
      Step();
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }

  // Why the opening failed ("" while it has not).
  std::string Failure() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stage_.load() == kFailed ? failure_ : std::string();
  }

  bool Underway() const {
    const int stage = stage_.load();
    return stage == kDuplicating || stage == kGathering;
  }

 private:
  std::mutex mutex_;  // the watchdog's polls, or a rank that ends (AnnounceEnd)
  std::atomic<int> stage_{kNone};
  MPI_Comm channel_ = MPI_COMM_NULL;
  MPI_Request request_ = MPI_REQUEST_NULL;
  ProcessId mine_;
  std::vector<ProcessId> all_;
  std::string failure_;
};

inline SideChannelOpening side_channel_opening;

// Receives every pending message with `tag` on the side channel and hands it
// to handle(source, bytes); nothing where the channel is down.
template <typename Handle>
inline void ReceiveEach(int tag, Handle&& handle) {
  if (!SideChannelUp()) return;
  MPI_Comm comm = side_channel.load();
  for (;;) {
    // A matched probe: the main thread may take notices at the same time
    // (AnnounceAbort), and a plain probe-then-receive could leave one thread
    // blocked in a receive whose message the other took.
    int pending = 0;
    MPI_Message message;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, tag, comm, &pending, &message, &status) != MPI_SUCCESS ||
        !pending) {
      return;
    }
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::vector<char> data(std::max(bytes, 0));
    MPI_Mrecv(data.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    handle(status.MPI_SOURCE, data);
  }
}

inline int IntOf(const std::vector<char>& bytes) {
  int value = -1;
  if (bytes.size() >= sizeof(int)) std::memcpy(&value, bytes.data(), sizeof(int));
  return value;
}

// Sends `bytes` with `tag` to `ranks`; waits up to `wait_ms` for the sends to
// leave (a process about to exit), else lets them complete alone.
inline void SendToRanks(const std::vector<char>& bytes, int tag, const std::vector<int>& ranks,
                        int wait_ms) {
  if (!SideChannelUp()) return;
  MPI_Comm comm = side_channel.load();
  // The sends' buffers, kept for the process: a send nobody receives stays posted.
  static std::mutex kept_mutex;
  static std::list<std::vector<char>> kept;
  const std::vector<char>* kept_bytes;
  {
    std::lock_guard<std::mutex> lock(kept_mutex);
    kept.push_back(bytes);
    kept_bytes = &kept.back();
  }
  const std::vector<char>& buffer = *kept_bytes;
  std::vector<MPI_Request> sends;
  for (int r : ranks) {
    if (r == WorldRank()) continue;
    MPI_Request request;
    if (MPI_Isend(buffer.data(), static_cast<int>(buffer.size()), MPI_BYTE, r, tag, comm,
                  &request) == MPI_SUCCESS) {
      sends.push_back(request);
    }
  }
  const int64_t deadline = NowNs() + int64_t{wait_ms} * 1000000;
  int done = sends.empty();
  while (!done && NowNs() < deadline) {
    MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  for (MPI_Request& request : sends) {
    if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  }
}

inline void SendToEveryRank(const std::vector<char>& bytes, int tag, int wait_ms) {
  std::vector<int> everyone(comm_world.size.load());
  for (int r = 0; r < comm_world.size.load(); ++r) everyone[r] = r;
  SendToRanks(bytes, tag, everyone, wait_ms);
}

// ---------------------------------------------------------------------------
// Flight records a multi-node job can read: the rank that writes a report asks
// the others for theirs (a dump notice, watchdog.h) and writes them into its
// own folder (its node's temporary directory, or MPICOLL_FLIGHT_DIR), beside
// its own, so that the report names one place holding every rank's.  Each
// rank still writes its own full ring on its node; the copy sent holds its
// last kSentRecords per device, and is sent only in jobs of up to
// kCollectRecordsUpTo ranks.
constexpr size_t kSentRecords = 200;
constexpr int kCollectRecordsUpTo = 256;

inline bool CollectingRecords() {
  return comm_world.size.load() <= kCollectRecordsUpTo && flight.capacity.load() > 0;
}

// This rank's records as they travel: its flight folder, '\0', its last `last`
// records per device.
inline std::string RecordsMessage(const std::string& reason, size_t last) {
  return FolderOf(flight.flight_dir) + '\0' +
         RecordsJson(WorldRank(), comm_world.size.load(), reason, Kept::kFlight, last);
}

// Writes a rank's records received (RecordsMessage) into this rank's folder,
// unless the sender's own copy is already there (the same folder on a shared
// or the same file system).
inline void KeepRecords(int source, const std::string& message) {
  const size_t end_of_dir = message.find('\0');
  if (end_of_dir == std::string::npos) return;
  const std::string dir = FolderOf(flight.flight_dir);
  const std::string name = "rank" + std::to_string(source) + ".json";
  if (message.compare(0, end_of_dir, dir) == 0 && WrittenWithin(dir, name, /*seconds=*/30)) {
    return;
  }
  WriteFileAtomically(dir, name, message.substr(end_of_dir + 1));
}

// Sends this rank's records to `reporter`.
inline void SendRecords(int reporter, const std::string& reason) {
  if (!CollectingRecords() || reporter == WorldRank()) return;
  const std::string message = RecordsMessage(RecentDumpReason(reason), kSentRecords);
  SendToRanks(std::vector<char>(message.begin(), message.end()), kRecordsTag, {reporter},
              /*wait_ms=*/0);
}

// Receives the records `from` sends for up to `seconds` (every one, or the
// time is up) and keeps each (KeepRecords).
inline void CollectRecords(std::vector<int> from, double seconds) {
  if (!SideChannelUp() || !CollectingRecords()) return;
  const int64_t deadline = NowNs() + static_cast<int64_t>(seconds * 1e9);
  while (!from.empty() && NowNs() < deadline) {
    bool any = false;
    ReceiveEach(kRecordsTag, [&](int source, const std::vector<char>& data) {
      any = true;
      from.erase(std::remove(from.begin(), from.end(), source), from.end());
      KeepRecords(source, std::string(data.begin(), data.end()));
    });
    if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace mpicoll

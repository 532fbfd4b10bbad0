// What each rank is doing, as the watchdogs tell each other (core/watchdog.h):
// the side channel they talk on, a rank's state on the wire, the requests
// for it, and the notices a rank sends when it ends (its script finished, or
// its process is about to exit) or aborts the job.
//
// The side channel is a private duplicate of COMM_WORLD, made without
// blocking at import (MPI_Comm_idup, completed by the watchdog thread), so the
// ranks can ask each other from the job's first collective on, even when one
// rank never reaches it.  It needs MPI_THREAD_MULTIPLE; in the serialized
// mode Python makes it at COMM_WORLD's first use and the watchdog thread,
// which may not call MPI there, leaves it alone.
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

#include "call.h"
#include "dtypes.h"
#include "flight.h"
#include "guard.h"
#include "python_stacks.h"

namespace mpicoll {

inline std::atomic<MPI_Comm> side_channel{MPI_COMM_NULL};  // set once it is open
// Python's exit handler sets stop before MPI is finalized and waits for
// stopped: after it the watchdog makes no MPI call.
inline std::atomic<bool> watchdog_stop{false}, watchdog_stopped{false};

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
// (in the serialized mode the watchdog thread may not call MPI).
inline std::atomic<int> world_rank{-1}, world_size{1};
inline int WorldRank() { return world_rank.load(); }

inline void NoteWorld() {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  world_rank.store(rank);
  world_size.store(size);
}

inline bool SideChannelUp() {
  return side_channel.load() != MPI_COMM_NULL && !serialize_mpi_calls.load();
}

// ---------------------------------------------------------------------------
// Every rank's host name and process id, gathered when the side channel
// opens: a rank that cannot answer (its host is gone) is still named with its
// host, and the job's flight records go to one folder named after rank 0's.
struct ProcessId {
  char host[64] = {};
  int64_t pid = 0;
};
inline std::mutex hosts_mutex;
inline std::vector<std::string> world_hosts;

inline std::string HostOf(int rank) {
  std::lock_guard<std::mutex> lock(hosts_mutex);
  return rank >= 0 && rank < static_cast<int>(world_hosts.size()) ? world_hosts[rank]
                                                                   : std::string("?");
}

// The folder flight records go to when MPICOLL_FLIGHT_DIR is not set: one per
// job under the temporary directory, named after rank 0's host and pid (the
// same on every rank); this process's own until the ranks have met.
inline std::string flight_root;  // "": MPICOLL_FLIGHT_DIR was set (flight_dir is it)

inline void ChooseJobFlightDir(const std::string& host, int64_t pid) {
  std::lock_guard<std::mutex> lock(flight_setup_mutex);
  if (!flight_root.empty()) {
    flight_dir = flight_root + "/mpicoll-flight-" + host + "-" + std::to_string(pid);
  }
}

inline void SetWorldProcesses(const std::vector<ProcessId>& all) {
  std::vector<std::string> hosts;
  for (const ProcessId& p : all) hosts.emplace_back(p.host);
  {
    std::lock_guard<std::mutex> lock(hosts_mutex);
    world_hosts = std::move(hosts);
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
// polls (OpenSideChannelStep).
inline MPI_Comm opening_channel = MPI_COMM_NULL;
inline MPI_Request opening_request = MPI_REQUEST_NULL;
inline std::atomic<int> opening_stage{0};  // 0 none, 1 dup, 2 gather, 3 open
inline ProcessId opening_mine;
inline std::vector<ProcessId> opening_all;

inline void BeginOpeningSideChannel() {
  if (opening_stage.load() != 0 || serialize_mpi_calls.load()) return;
  if (MPI_Comm_idup(MPI_COMM_WORLD, &opening_channel, &opening_request) == MPI_SUCCESS) {
    opening_stage.store(1);
  }
}

inline std::mutex opening_mutex;  // the watchdog's polls, or a rank that ends (AnnounceEnd)

inline void OpenSideChannelStep() {
  std::lock_guard<std::mutex> lock(opening_mutex);
  const int stage = opening_stage.load();
  if (stage != 1 && stage != 2) return;
  int done = 0;
  if (MPI_Test(&opening_request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) return;
  if (stage == 1) {
    MPI_Comm_set_name(opening_channel, "mpicoll:watchdog");
    MPI_Comm_set_errhandler(opening_channel, MPI_ERRORS_RETURN);
    opening_mine = ThisProcess();
    opening_all.assign(world_size.load(), ProcessId());
    MPI_Iallgather(&opening_mine, sizeof(ProcessId), MPI_BYTE, opening_all.data(),
                   sizeof(ProcessId), MPI_BYTE, opening_channel, &opening_request);
    opening_stage.store(2);
    return;
  }
  SetWorldProcesses(opening_all);
  side_channel.store(opening_channel);
  opening_stage.store(3);
}

// Completes the opening within `seconds` (a rank that ends right after its
// import: the others wait for it on the channel).
inline void FinishOpeningSideChannel(double seconds) {
  const int64_t deadline = NowNs() + static_cast<int64_t>(seconds * 1e9);
  while (opening_stage.load() != 0 && opening_stage.load() != 3 && NowNs() < deadline) {
    OpenSideChannelStep();
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

// ---------------------------------------------------------------------------
// A rank's state on the wire: a header, then one CallState for each
// communicator a local device is in a collective on, or that the asker waits
// on, or (an end notice) that the rank used last.  Plain bytes.
constexpr int kMaxCallStates = 32;
constexpr int kMaxAskedComms = 8;
enum Ending : int32_t { kAlive = 0, kFinished = 1, kExiting = 2 };

struct CallState {
  uint64_t comm_hash = 0;  // the communicator's identity (name and members)
  uint64_t sequence = 0;   // the call's (in a collective), else the last one's
  uint64_t call_hash = 0;  // its description's hash (0: not known)
  int32_t phase = kPhaseDone;
  int32_t device = -1;
  int32_t asker_is_member = 0;  // the rank that asked is a member of the communicator
  int32_t checked = 0;  // not in a call: its last one's comparison across ranks ended
  double seconds = 0;      // in the call so far
  char comm[48] = {};      // the user's name of the communicator
  char call[112] = {};     // e.g. allreduce(float32[4], op=sum)
  char site[96] = {};
};

struct RankStateHeader {
  int32_t world_rank = -1;  // -1: no answer
  int32_t ending = kAlive;
  int32_t exit_code = 0;
  int32_t count = 0;        // CallStates that follow
  int32_t stack_bytes = 0;  // then its Python stack's text (python_stacks.h)
  double idle_seconds = 0;  // since a local device last left a collective (none in one)
  double waited = 0;        // (set by the asker) how long it waited for an answer that never came
  char host[64] = {};
  char ended_at[160] = {};  // where its script finished or its process exits
};

struct RankState {
  RankStateHeader head;
  std::vector<CallState> calls;
  std::string python_stack;  // report lines; "" where not asked for
  bool Answered() const { return head.world_rank >= 0; }
  bool InCollective() const {
    return std::any_of(calls.begin(), calls.end(),
                       [](const CallState& c) { return c.phase != kPhaseDone; });
  }
  const CallState* On(uint64_t comm_hash) const {
    for (const CallState& c : calls) {
      if (c.comm_hash == comm_hash) return &c;
    }
    return nullptr;
  }
};

inline uint64_t CommHash(const CommIdentity* identity) {
  return identity ? Fnv1a(identity->members, Fnv1a(identity->name)) : 0;
}

// The user's name of a communicator: mpicoll's duplicates are named
// "mpicoll:<name>:device<k>" (comm.py).
inline std::string UserCommName(std::string name) {
  const std::string prefix = "mpicoll:";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  const size_t device = name.rfind(":device");
  return device == std::string::npos ? name : name.substr(0, device);
}

// The communicator setup Python does at a communicator's first use (comm.py):
// the collective the program called, and the identity device 0's duplicate
// will have, so that the other ranks' states can be held against it.
inline std::mutex setup_mutex;
inline std::string setup_call, setup_comm;
inline CommIdentity setup_identity;

inline bool IsMember(const CommIdentity* identity, int rank) {
  if (!identity || rank < 0) return false;
  const std::string& m = identity->members;
  const std::string r = std::to_string(rank);
  for (size_t at = 0; at <= m.size();) {
    const size_t comma = std::min(m.find(',', at), m.size());
    if (m.compare(at, comma - at, r) == 0) return true;
    at = comma + 1;
  }
  return false;
}

inline CallState SetupState(int64_t now, int asker) {
  std::lock_guard<std::mutex> lock(setup_mutex);
  CallState s;
  s.asker_is_member = IsMember(&setup_identity, asker);
  s.comm_hash = CommHash(&setup_identity);
  s.sequence = 1;
  s.call_hash = Fnv1a(setup_call);
  s.phase = kPhaseSetup;
  s.device = 0;
  s.seconds = (now - in_flight[kSetupSlot].started_ns.load()) * 1e-9;
  Copy(s.comm, sizeof(s.comm), setup_comm);
  Copy(s.call, sizeof(s.call), setup_call);
  return s;
}

inline std::string FallbackCall(const InFlight& f) {
  return std::string(f.name.load() ? f.name.load() : "?") + "(" +
         DtypeName(static_cast<ffi::DataType>(f.dtype.load())) + "[" +
         std::to_string(f.count.load()) + "])";
}

// A device's collective in progress.
inline CallState InFlightState(int device, int64_t now, int asker) {
  const InFlight& f = in_flight[device];
  CallState s;
  const CallFacts* facts = f.facts.load(std::memory_order_relaxed);
  const CommIdentity* identity = f.identity.load(std::memory_order_relaxed);
  s.comm_hash = CommHash(identity);
  s.asker_is_member = IsMember(identity, asker);
  s.sequence = f.sequence.load(std::memory_order_relaxed);
  s.call_hash = facts ? facts->hash : 0;
  s.phase = f.phase.load(std::memory_order_relaxed);
  s.device = device;
  s.seconds = (now - f.started_ns.load(std::memory_order_acquire)) * 1e-9;
  Copy(s.comm, sizeof(s.comm),
       serialize_mpi_calls.load() ? std::string("its communicator")
                                  : UserCommName(CommName(f.comm.load(std::memory_order_relaxed))));
  Copy(s.call, sizeof(s.call), facts ? facts->description : FallbackCall(f));
  Copy(s.site, sizeof(s.site), SiteText(f.site.load(std::memory_order_relaxed)));
  return s;
}

// A device's last call on a communicator (it is in none on it now).
inline CallState LastState(int device, const CommCounter& counter) {
  CallState s;
  const CallFacts* last = counter.last.load(std::memory_order_relaxed);
  s.comm_hash = CommHash(counter.identity);
  s.sequence = counter.sequence.load(std::memory_order_relaxed);
  s.call_hash = last ? last->hash : 0;
  s.checked = s.sequence != 0 && counter.checked.load(std::memory_order_relaxed) == s.sequence;
  s.device = device;
  Copy(s.comm, sizeof(s.comm), counter.identity ? UserCommName(counter.identity->name) : "?");
  Copy(s.call, sizeof(s.call), last ? last->description : "?");
  return s;
}

// Whether a rank's state carries its Python stack: a report wants it for a
// rank outside a collective (where it is in its own code), `python -m mpicoll
// stacks` for every rank.  An end notice and a probe's verdict need none.
enum class Stack { kNone, kIfOutside, kAlways };

// This rank's state: every call in progress, then the last call on each
// communicator in `asked` (hashes), or, for an end notice (all_comms), on the
// communicators used last.  asker: the rank that asks (-1: none).
inline RankState OwnState(const std::vector<uint64_t>& asked, bool all_comms, int asker = -1,
                          Stack stack = Stack::kNone) {
  RankState s;
  s.head.world_rank = WorldRank();
  gethostname(s.head.host, sizeof(s.head.host) - 1);
  const int64_t now = NowNs();
  int64_t last_left = 0;
  std::vector<uint64_t> covered;
  for (int d = 0; d <= kSetupSlot && s.calls.size() < kMaxCallStates; ++d) {
    last_left = std::max(last_left, in_flight[d].left_ns.load(std::memory_order_relaxed));
    if (in_flight[d].started_ns.load(std::memory_order_acquire) == 0) continue;
    s.calls.push_back(d == kSetupSlot ? SetupState(now, asker) : InFlightState(d, now, asker));
    covered.push_back(s.calls.back().comm_hash);
  }
  if (s.calls.empty()) {
    s.head.idle_seconds = (now - (last_left ? last_left : process_start_ns)) * 1e-9;
  }
  std::vector<std::pair<int64_t, CallState>> lasts;  // (last used, state)
  for (int d = 0; d < kMaxLocalDevices; ++d) {
    DeviceCounters& mine = counters[d];
    std::lock_guard<std::mutex> lock(mine.mutex);
    for (const auto& [key, counter] : mine.by_comm) {
      const uint64_t hash = CommHash(counter.identity);
      if (std::find(covered.begin(), covered.end(), hash) != covered.end()) continue;
      if (!all_comms && std::find(asked.begin(), asked.end(), hash) == asked.end()) continue;
      lasts.emplace_back(counter.used_ns.load(std::memory_order_relaxed), LastState(d, counter));
    }
    if (mine.by_comm.empty() && d > 0) break;  // devices are used from 0 up
  }
  std::sort(lasts.begin(), lasts.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [used, state] : lasts) {
    if (s.calls.size() >= kMaxCallStates) break;
    s.calls.push_back(state);
  }
  s.head.count = static_cast<int32_t>(s.calls.size());
  if (stack == Stack::kAlways || (stack == Stack::kIfOutside && !s.InCollective())) {
    s.python_stack = PythonStacks();
  }
  return s;
}

inline std::vector<char> Pack(const RankState& s) {
  RankStateHeader head = s.head;
  head.stack_bytes = static_cast<int32_t>(s.python_stack.size());
  const size_t calls = s.calls.size() * sizeof(CallState);
  std::vector<char> bytes(sizeof(RankStateHeader) + calls + s.python_stack.size());
  std::memcpy(bytes.data(), &head, sizeof(RankStateHeader));
  if (calls) std::memcpy(bytes.data() + sizeof(RankStateHeader), s.calls.data(), calls);
  if (!s.python_stack.empty()) {
    std::memcpy(bytes.data() + sizeof(RankStateHeader) + calls, s.python_stack.data(),
                s.python_stack.size());
  }
  return bytes;
}

inline RankState Unpack(const std::vector<char>& bytes) {
  RankState s;
  if (bytes.size() < sizeof(RankStateHeader)) return s;
  std::memcpy(&s.head, bytes.data(), sizeof(RankStateHeader));
  const size_t count = std::min<size_t>((bytes.size() - sizeof(RankStateHeader)) /
                                            sizeof(CallState),
                                        std::max<int32_t>(0, s.head.count));
  s.calls.resize(count);
  if (count) {
    std::memcpy(s.calls.data(), bytes.data() + sizeof(RankStateHeader),
                count * sizeof(CallState));
  }
  const size_t stack_at = sizeof(RankStateHeader) + count * sizeof(CallState);
  const size_t stack = std::min<size_t>(bytes.size() - stack_at,
                                        std::max<int32_t>(0, s.head.stack_bytes));
  s.python_stack.assign(bytes.data() + stack_at, stack);
  return s;
}

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

// Answers every pending state request (the watchdog's loop, and while a
// report waits for its own answers, so that two asking ranks never wait on
// each other).  A request is [purpose, the communicators the asker waits on].
// A probe (is a wait one that can never end?) wants the calls alone; a report
// wants the Python stack of a rank outside a collective too, and this rank's
// flight records written (DumpFlight writes at most once a second); `python -m
// mpicoll stacks` wants every rank's stack.
enum Purpose : uint64_t { kProbe = 0, kForReport = 1, kForStacks = 2 };

inline Stack StackFor(uint64_t purpose) {
  return purpose == kForStacks ? Stack::kAlways
         : purpose == kForReport ? Stack::kIfOutside : Stack::kNone;
}

inline void ServeStateRequests() {
  ReceiveEach(kStateRequestTag, [](int source, const std::vector<char>& request) {
    std::vector<uint64_t> words(request.size() / sizeof(uint64_t));
    if (!words.empty()) std::memcpy(words.data(), request.data(), words.size() * sizeof(uint64_t));
    const uint64_t purpose = words.empty() ? kProbe : words[0];
    const std::vector<uint64_t> asked(words.begin() + (words.empty() ? 0 : 1), words.end());
    const std::vector<char> reply =
        Pack(OwnState(asked, /*all_comms=*/false, source, StackFor(purpose)));
    MPI_Send(reply.data(), static_cast<int>(reply.size()), MPI_BYTE, source, kStateReplyTag,
             side_channel.load());
    if (purpose == kForReport) {
      const std::string why = "a stall report on rank " + std::to_string(source) + " asked";
      DumpFlight(WorldRank(), world_size.load(), why);
    }
  });
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
  std::vector<int> everyone(world_size.load());
  for (int r = 0; r < world_size.load(); ++r) everyone[r] = r;
  SendToRanks(bytes, tag, everyone, wait_ms);
}

// ---------------------------------------------------------------------------
// Flight records a multi-node job can read: the rank that writes a report asks
// the others for theirs (a dump notice, watchdog.h) and writes them into its
// own folder (its node's temporary directory, or MPICOLL_FLIGHT_DIR), beside
// its own, so that the report names one place holding every rank's.  Each rank still writes its
// own full ring on its node; the copy sent holds its last kSentRecords per
// device, and is sent only in jobs of up to kCollectRecordsUpTo ranks.
constexpr size_t kSentRecords = 200;
constexpr int kCollectRecordsUpTo = 256;

inline bool CollectingRecords() {
  return world_size.load() <= kCollectRecordsUpTo && flight_capacity.load() > 0;
}

// Sends this rank's records to `reporter`: its flight folder, then the records.
inline void SendRecords(int reporter, const std::string& reason) {
  if (!CollectingRecords() || reporter == WorldRank()) return;
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(flight_setup_mutex);
    dir = flight_dir;
  }
  const std::string json = RecordsJson(WorldRank(), world_size.load(), RecentDumpReason(reason),
                                       Kept::kFlight, kSentRecords);
  std::vector<char> bytes(dir.begin(), dir.end());
  bytes.push_back('\0');
  bytes.insert(bytes.end(), json.begin(), json.end());
  SendToRanks(bytes, kRecordsTag, {reporter}, /*wait_ms=*/0);
}

// Receives the records `from` sends for up to `seconds` (every one, or the
// time is up) and writes each into this rank's folder, unless the sender's own
// copy is already there (the same folder on a shared or the same file system).
inline void CollectRecords(std::vector<int> from, double seconds) {
  if (!SideChannelUp() || !CollectingRecords()) return;
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(flight_setup_mutex);
    dir = flight_dir;
  }
  MPI_Comm comm = side_channel.load();
  const int64_t deadline = NowNs() + static_cast<int64_t>(seconds * 1e9);
  while (!from.empty() && NowNs() < deadline) {
    int pending = 0;
    MPI_Message message;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, kRecordsTag, comm, &pending, &message, &status) !=
        MPI_SUCCESS) {
      return;
    }
    if (!pending) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    int size = 0;
    MPI_Get_count(&status, MPI_BYTE, &size);
    std::vector<char> data(std::max(size, 0));
    MPI_Mrecv(data.data(), size, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    from.erase(std::remove(from.begin(), from.end(), status.MPI_SOURCE), from.end());
    const auto end_of_dir = std::find(data.begin(), data.end(), '\0');
    if (end_of_dir == data.end()) continue;
    const std::string theirs(data.begin(), end_of_dir);
    const std::string name = "rank" + std::to_string(status.MPI_SOURCE) + ".json";
    if (theirs == dir && WrittenWithin(dir + "/" + name, /*seconds=*/30)) continue;
    WriteFileAtomically(dir, name, std::string(end_of_dir + 1, data.end()));
  }
}

// ---------------------------------------------------------------------------
// Ranks that have ended (their end notices): their last calls, for the
// watchdog to hold the others' waits against.  A rank that ended is never
// asked again.
inline std::mutex ended_mutex;
inline std::vector<RankState> ended_ranks;  // by world rank; head.ending == kAlive: not ended
inline std::atomic<int64_t> ended_changed_ns{0};

inline void TakeEndNotices() {
  ReceiveEach(kEndNoticeTag, [](int source, const std::vector<char>& bytes) {
    RankState s = Unpack(bytes);
    if (s.head.ending == kAlive) return;
    std::lock_guard<std::mutex> lock(ended_mutex);
    if (ended_ranks.size() < static_cast<size_t>(world_size.load())) {
      ended_ranks.resize(world_size.load());
    }
    if (source >= 0 && source < static_cast<int>(ended_ranks.size())) {
      ended_ranks[source] = std::move(s);
      ended_changed_ns.store(NowNs());
    }
  });
}

inline bool HasEnded(int rank, RankState* state = nullptr) {
  std::lock_guard<std::mutex> lock(ended_mutex);
  if (rank < 0 || rank >= static_cast<int>(ended_ranks.size()) ||
      ended_ranks[rank].head.ending == kAlive) {
    return false;
  }
  if (state) *state = ended_ranks[rank];
  return true;
}

// Every rank's state, this one's included: ended ranks from their notices,
// the others asked (for the communicators in `asked`); a rank that does not
// answer within `answer_within` seconds keeps world_rank = -1.
inline std::vector<RankState> EveryRanksState(const std::vector<uint64_t>& asked,
                                              Purpose purpose = kProbe,
                                              double answer_within = kAnswerWithin) {
  static std::mutex asking;  // the watchdog, or a process about to exit (AnnounceEnd)
  std::lock_guard<std::mutex> one_at_a_time(asking);
  const int size = world_size.load(), me = WorldRank();
  std::vector<RankState> states(size);
  states[me] = OwnState(asked, /*all_comms=*/false, -1, StackFor(purpose));
  if (!SideChannelUp() || size == 1) return states;
  TakeEndNotices();
  MPI_Comm comm = side_channel.load();
  // The sends' buffer, kept for the process: a request to a rank that does not
  // answer stays posted (a few bytes per unanswered probe).
  static std::list<std::vector<uint64_t>> requests;
  requests.emplace_back(1, purpose);
  requests.back().insert(requests.back().end(), asked.begin(),
                         asked.begin() + std::min<size_t>(asked.size(), kMaxAskedComms));
  const std::vector<uint64_t>& request = requests.back();
  std::vector<MPI_Request> sends;
  int waiting_for = 0;
  for (int r = 0; r < size; ++r) {
    if (r == me || HasEnded(r, &states[r])) continue;
    sends.emplace_back();
    MPI_Isend(request.data(), static_cast<int>(request.size() * sizeof(uint64_t)), MPI_BYTE, r,
              kStateRequestTag, comm, &sends.back());
    ++waiting_for;
  }
  const int64_t deadline = NowNs() + static_cast<int64_t>(answer_within * 1e9);
  // Polls rather than blocks, so that it answers requests meanwhile and sees
  // watchdog_stop: the process may be about to finalize MPI.
  while (waiting_for > 0 && NowNs() < deadline && !watchdog_stop.load()) {
    ServeStateRequests();
    int pending = 0;
    MPI_Message message;
    MPI_Status status;
    MPI_Improbe(MPI_ANY_SOURCE, kStateReplyTag, comm, &pending, &message, &status);
    if (!pending) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::vector<char> data(std::max(bytes, 0));
    MPI_Mrecv(data.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    RankState theirs = Unpack(data);
    if (!states[status.MPI_SOURCE].Answered()) --waiting_for;
    states[status.MPI_SOURCE] = std::move(theirs);
  }
  for (RankState& s : states) {
    if (!s.Answered()) s.head.waited = answer_within;
  }
  // Requests to ranks that never answered stay posted; they match nothing else.
  int all_sent = 0;
  MPI_Testall(static_cast<int>(sends.size()), sends.data(), &all_sent, MPI_STATUSES_IGNORE);
  for (auto& send : sends) {
    if (send != MPI_REQUEST_NULL) MPI_Request_free(&send);
  }
  if (all_sent) requests.pop_back();
  return states;
}

}  // namespace mpicoll

// What each rank is doing, as the watchdogs tell each other over the side
// channel (side_channel.h, watchdog.h): a rank's state on the wire, the
// requests for it, and the notices a rank sends when it ends (its script
// finished, or its process is about to exit).
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../engine/call.h"
#include "../engine/dtypes.h"
#include "records_file.h"
#include "guard.h"
#include "python_stacks.h"
#include "side_channel.h"

namespace mpicoll {

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
  char call[192] = {};     // e.g. allreduce(float32[4], op=sum), or as written: jax.lax.psum over ...: allreduce(...)
  char site[96] = {};
};

struct RankStateHeader {
  int32_t world_rank = -1;  // -1: no answer
  int32_t ending = kAlive;
  int32_t exit_code = 0;
  int32_t count = 0;        // CallStates that follow
  int32_t stack_bytes = 0;  // then its Python stack's text (python_stacks.h)
  int32_t records_bytes = 0;  // then (an end notice) its flight folder, '\0', its records
  double idle_seconds = 0;  // since a local device last left a collective (none in one)
  double waited = 0;        // (set by the asker) how long it waited for an answer that never came
  char host[64] = {};
  char ended_at[160] = {};  // where its script finished or its process exits
};

struct RankState {
  RankStateHeader head;
  std::vector<CallState> calls;
  std::string python_stack;  // report lines; "" where not asked for
  std::string records;       // an end notice's: as SendRecords sends them (side_channel.h)
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

// The communicator setup Python does at a communicator's first use (comm.py):
// the collective the program called, and the identity device 0's duplicate
// will have, so that the other ranks' states can be held against it.
struct CommSetup {
  std::mutex mutex;
  std::string call, comm;  // the collective called, the communicator's name
  CommIdentity identity;
};
inline CommSetup comm_setup;

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
  std::lock_guard<std::mutex> lock(comm_setup.mutex);
  CallState s;
  s.asker_is_member = IsMember(&comm_setup.identity, asker);
  s.comm_hash = CommHash(&comm_setup.identity);
  s.sequence = 1;
  s.call_hash = Fnv1a(comm_setup.call);
  s.phase = kPhaseSetup;
  s.device = 0;
  s.seconds = (now - in_flight[kSetupSlot].started_ns.load()) * 1e-9;
  Copy(s.comm, sizeof(s.comm), comm_setup.comm);
  Copy(s.call, sizeof(s.call), comm_setup.call);
  return s;
}

inline std::string FallbackCall(const InFlight& f) {
  return std::string(f.name.load() ? f.name.load() : "?") + "(" +
         DtypeName(static_cast<ffi::DataType>(f.dtype.load())) + "[" +
         std::to_string(f.count.load()) + "])";
}

// The line an eager call in progress was made from: its lowered site is its
// program's first caller's (JAX caches the program), so the main thread's
// stack says it (python_stacks.h), read once per call however often the
// watchdogs ask.  "" where it cannot be told.
inline std::string EagerCallLine(int device, const InFlight& f) {
  static std::mutex reading;
  static std::map<std::pair<int, int64_t>, std::string> lines;  // (device, started) -> line
  const int64_t started = f.started_ns.load(std::memory_order_acquire);
  std::lock_guard<std::mutex> lock(reading);
  auto found = lines.find({device, started});
  if (found != lines.end()) return found->second;
  if (lines.size() > 64) lines.clear();
  return lines[{device, started}] = MainThreadCallerLine();
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
       serialized_mpi.on.load() ? std::string("its communicator")
                                  : UserCommName(CommName(f.comm.load(std::memory_order_relaxed))));
  Copy(s.call, sizeof(s.call), facts ? facts->description : FallbackCall(f));
  const int64_t site = f.site.load(std::memory_order_relaxed);
  Copy(s.site, sizeof(s.site), SiteCompared(site) ? SiteText(site) : EagerCallLine(device, f));
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
  // An eager call's lowered site is its program's first caller's: left out.
  const int64_t site = counter.last_site.load(std::memory_order_relaxed);
  if (site && SiteCompared(site)) Copy(s.site, sizeof(s.site), SiteText(site));
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
  for (int d = 0; d < kCallSlots; ++d) {
    DeviceCounters& mine = counters[d];
    std::lock_guard<std::mutex> lock(mine.mutex);
    for (const auto& [key, counter] : mine.by_comm) {
      const uint64_t hash = CommHash(counter.identity);
      if (std::find(covered.begin(), covered.end(), hash) != covered.end()) continue;
      if (!all_comms && std::find(asked.begin(), asked.end(), hash) == asked.end()) continue;
      lasts.emplace_back(counter.used_ns.load(std::memory_order_relaxed), LastState(d, counter));
    }
    // Devices' slots are used from 0 up (XLA's, from kXlaSlot, by communicator).
    if (mine.by_comm.empty() && d > 0 && d < kXlaSlot) d = kXlaSlot - 1;
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
  head.records_bytes = static_cast<int32_t>(s.records.size());
  const size_t calls = s.calls.size() * sizeof(CallState);
  std::vector<char> bytes(sizeof(RankStateHeader) + calls + s.python_stack.size() +
                          s.records.size());
  std::memcpy(bytes.data(), &head, sizeof(RankStateHeader));
  if (calls) std::memcpy(bytes.data() + sizeof(RankStateHeader), s.calls.data(), calls);
  if (!s.python_stack.empty()) {
    std::memcpy(bytes.data() + sizeof(RankStateHeader) + calls, s.python_stack.data(),
                s.python_stack.size());
  }
  if (!s.records.empty()) {
    std::memcpy(bytes.data() + sizeof(RankStateHeader) + calls + s.python_stack.size(),
                s.records.data(), s.records.size());
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
  const size_t records_at = stack_at + stack;
  s.records.assign(bytes.data() + records_at,
                   std::min<size_t>(bytes.size() - records_at,
                                    std::max<int32_t>(0, s.head.records_bytes)));
  return s;
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
      DumpFlight(WorldRank(), comm_world.size.load(), why);
    }
  });
}

// ---------------------------------------------------------------------------
// Ranks that have ended (their end notices): their last calls, for the
// watchdog to hold the others' waits against.  A rank that ended is never
// asked again.
class EndedRanks {
 public:
  // Takes every end notice that has come.
  void TakeNotices() {
    ReceiveEach(kEndNoticeTag, [this](int source, const std::vector<char>& bytes) {
      RankState s = Unpack(bytes);
      if (s.head.ending == kAlive) return;
      std::lock_guard<std::mutex> lock(mutex_);
      if (by_rank_.size() < static_cast<size_t>(comm_world.size.load())) {
        by_rank_.resize(comm_world.size.load());
      }
      if (source >= 0 && source < static_cast<int>(by_rank_.size())) {
        by_rank_[source] = std::move(s);
        changed_ns_.store(NowNs());
      }
    });
  }

  // Whether `rank` has ended; its last state into *state if so.
  bool Has(int rank, RankState* state = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (rank < 0 || rank >= static_cast<int>(by_rank_.size()) ||
        by_rank_[rank].head.ending == kAlive) {
      return false;
    }
    if (state) *state = by_rank_[rank];
    return true;
  }

  int64_t ChangedNs() const { return changed_ns_.load(); }  // when a rank last ended

 private:
  std::mutex mutex_;
  std::vector<RankState> by_rank_;  // by world rank; head.ending == kAlive: not ended
  std::atomic<int64_t> changed_ns_{0};
};

inline EndedRanks ended_ranks;

// Every rank's state, this one's included: ended ranks from their notices,
// the others asked (for the communicators in `asked`); a rank that does not
// answer within `answer_within` seconds keeps world_rank = -1.
inline std::vector<RankState> EveryRanksState(const std::vector<uint64_t>& asked,
                                              Purpose purpose = kProbe,
                                              double answer_within = kAnswerWithin) {
  static std::mutex asking;  // the watchdog, or a process about to exit (AnnounceEnd)
  std::lock_guard<std::mutex> one_at_a_time(asking);
  const int size = comm_world.size.load(), me = WorldRank();
  std::vector<RankState> states(size);
  states[me] = OwnState(asked, /*all_comms=*/false, -1, StackFor(purpose));
  if (!SideChannelUp() || size == 1) return states;
  ended_ranks.TakeNotices();
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
    if (r == me || ended_ranks.Has(r, &states[r])) continue;
    sends.emplace_back();
    MPI_Isend(request.data(), static_cast<int>(request.size() * sizeof(uint64_t)), MPI_BYTE, r,
              kStateRequestTag, comm, &sends.back());
    ++waiting_for;
  }
  const int64_t deadline = NowNs() + static_cast<int64_t>(answer_within * 1e9);
  // Polls rather than blocks, so that it answers requests meanwhile and sees
  // watchdog.stop: the process may be about to finalize MPI.
  while (waiting_for > 0 && NowNs() < deadline && !watchdog.stop.load()) {
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

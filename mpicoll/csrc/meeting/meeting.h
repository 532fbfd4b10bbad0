// The local meeting's shared state (meeting.cc runs it, kinds.h fills it per
// kind): what the L device threads of one communicator slot share during one
// call, what one call is, and one device's turn in it.
#pragma once

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../engine/algorithms.h"
#include "../engine/call.h"
#include "../engine/comm_table.h"
#include "../watch/flight.h"
#include "../watch/guard.h"
#include "kinds.def"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
namespace meeting {

enum MeetingKind : int64_t {
#define MPICOLL_MEETING_ENUM(Enum, Type, name, code, rows_in, reduces) Enum = code,
  MPICOLL_MEETING_KINDS(MPICOLL_MEETING_ENUM)
#undef MPICOLL_MEETING_ENUM
};

// One per communicator slot and group of local devices (meeting.cc, MeetingFor).
struct LocalMeeting {
  std::mutex mutex;
  std::condition_variable changed;
  std::atomic<uint64_t> generation{0};  // calls completed
  std::atomic<int> arrived{0};
  std::atomic<int> packed{0};  // threads done packing in this call
  std::atomic<int> copied{0};  // allgather: threads done copying the leader's output
  std::atomic<size_t> gathered{0};  // allgather: elements of every rank block final in it
  int expected = 0;
  size_t bytes = 0;
  int64_t kind = -1;
  ffi::DataType dtype = ffi::DataType::INVALID;
  int64_t op = -1;
  const char* inputs[kMaxLocalDevices];
  char* outputs[kMaxLocalDevices];  // written by other devices while packing (alltoall, permute)
  int32_t devices[kMaxLocalDevices];
  std::vector<char> send, receive;
  std::vector<int64_t> counts;  // permute: MPI_Alltoallv's row size and counts
  std::string mismatch;         // arrivals that disagree (never in one SPMD program)
  std::string error;            // this generation's failure, seen by every thread
  // The flight records of the meeting itself (meeting.cc, MeetingRecord): its
  // name, made by the first arrival, and each device's count of meetings,
  // touched by that device's thread only.
  std::atomic<const CommIdentity*> identity{nullptr};
  uint64_t met[kMaxLocalDevices] = {};
};

// What one call of the meeting is: the participants and the row they exchange.
struct Meeting {
  int64_t kind;
  int ranks, local, rank, part;  // part: this device's place among the local devices
  size_t row_bytes;
  ffi::Span<const int64_t> pairs;  // permute: (source row, destination row) pairs
  int64_t root;                    // bcast: the root participant's row
  bool split = false;              // allreduce: every device allreduces its own slice
  const char* gathered = nullptr;  // allgather: the leader's output, every row in it
};

// How the leader's MPI call waits for the other ranks' leaders (kinds.h,
// LeadCall::Run): on a communicator whose turns may start on XLA's thread
// (barrier), every leader of every meeting passes an arrival barrier on its
// communicator between the call's check across ranks and the collective, on
// whichever thread it runs, so the ranks' MPI calls match whichever way each took.
//
// here: the turn runs on XLA's thread (meeting.cc, Advance), where no thread may
// wait for a rank that has not arrived: the leader's call runs there only when
// no check is due (a check waits for every rank) and the barrier completes
// within the bound; else the turn is handed to the progress thread
// (handed_off), which finishes the barrier started here and runs the call.
struct LeadGate {
  bool barrier = false;  // the communicator's turns may start on XLA's thread
  bool here = false;
  int64_t deadline = 0;  // here: the turn's bound (NowNs)
  bool handed_off = false;
  bool started = false;
  Arrival arrival;
  // On XLA's thread, before the leader's call: whether it goes to the progress
  // thread instead (handed_off): where a check is due, or the ranks' leaders
  // have not all arrived by the deadline (the barrier, started here, is
  // finished there).
  bool HandsOff(const Call& c, bool check_due) {
    if (!check_due) {
      arrival.Start(c);
      started = true;
      if (arrival.Within(std::max<int64_t>(0, deadline - NowNs()))) return false;
    }
    handed_off = true;
    return true;
  }
  // Execute's before_run: the barrier, started here unless it was already.
  int operator()(const Call& c) {
    if (!barrier) return MPI_SUCCESS;  // no leader of this communicator's meetings runs here
    if (!started) arrival.Start(c), started = true;
    return arrival.Wait();
  }
};

// One device's turn in one call: the shared state, this device's own call
// (its input, output and communicator), the call, the input's shape, and how
// the leader's MPI call waits for the other ranks.
struct Turn {
  LocalMeeting& m;
  const Call& c;
  const Meeting& g;
  int32_t device;
  ffi::Span<const int64_t> dims;
  LeadGate* gate;
};

// The cores this process may run on (its affinity mask).
inline int CoresHere() {
  static const int cores = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  }();
  return cores;
}

// A waiting device spins this long before it sleeps, where the process has two
// cores per local device: the wake-up then stays off the futex path at small
// sizes.  Where the device threads outnumber the cores, spinning takes the
// cores from the threads being waited for: 2 ranks x 4 devices on 2 cores,
// 4 MiB allreduce 15.0-19.7 ms with the spin, 13.0-15.9 without; 2 x 2, 16 B
// 236-269 us with, 210-218 without.
inline constexpr int64_t kLocalSpinNs = 50000;

// No bound on a wait: the turn runs on the device's progress thread.
inline constexpr int64_t kNoDeadline = INT64_MAX;

// Waits (spin where cores allow, then sleep) until ready() holds, or until the
// steady clock reads `deadline` (NowNs): whether ready() holds.  ready reads
// atomics only.
template <typename Ready>
inline bool AwaitLocal(LocalMeeting& m, std::unique_lock<std::mutex>& lock, Ready&& ready,
                       int64_t deadline = kNoDeadline) {
  if (ready()) return true;
  if (CoresHere() >= 2 * m.expected) {
    lock.unlock();
    const int64_t spin_until = std::min(deadline, NowNs() + kLocalSpinNs);
    while (!ready() && NowNs() < spin_until) std::this_thread::yield();
    lock.lock();
  }
  if (deadline == kNoDeadline) {
    m.changed.wait(lock, ready);
    return true;
  }
  const auto until = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(deadline));
  return m.changed.wait_until(lock, until, ready);
}

// The element range [begin, end) of slice `part` of `count` elements over `local` devices.
inline std::pair<size_t, size_t> SliceOf(size_t count, int part, int local) {
  return {count * part / local, count * (part + 1) / local};
}

}  // namespace meeting
}  // namespace mpicoll

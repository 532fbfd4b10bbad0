// The flight recorder and the timeline: one record per collective per local
// device (sequence number, op, communicator, dtype and shape, bytes, call
// site, and when it was queued, started and finished), written by the
// device's own thread as the collective runs.
//
//   * flight recorder (MPICOLL_FLIGHT_RECORDS, default 1000, 0 = off): each
//     device keeps its last N records in a ring; the watchdog writes them to
//     MPICOLL_FLIGHT_DIR/rank<r>.json on a stall report (every rank: the
//     report's state request asks for it), a timeout, an abort and SIGUSR1.
//     `python -m mpicoll flight DIR` finds where the ranks diverge.
//   * timeline (MPICOLL_TRACE=DIR from import to exit, or mpicoll.start_trace
//     / stop_trace in code): every record while it runs is kept (chunks of
//     4,096, up to 2**24 per device, after the ring's slots) and written to
//     DIR/rank<r>.json when it stops (at exit, or by stop_trace; and on a
//     timeout or abort).  Each call site's first `trace_skip` calls on a
//     device go to the ring instead (warm-up).  `python -m mpicoll trace DIR`
//     merges the ranks.
//
// Both files are one format, a Chrome trace (pid = rank, tid = local device;
// open one in chrome://tracing or ui.perfetto.dev) whose events carry every
// field in "args"; so one writer and one reader serve both.
//
// Cost on the hot path: the records' stores, one clock read (queued) and, at a
// communicator's first collective on a device, its name and members.  The
// last finished collective's record is written while the next is recorded, so
// records are read without locks: a record being written has an odd stamp and
// a reader skips it.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <set>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../engine/call.h"
#include "../engine/dtypes.h"
#include "own_files.h"

namespace mpicoll {

// A communicator as the records name it: its name and its members' COMM_WORLD
// ranks, which tell apart two groups of a split that have the same name.
struct CommIdentity {
  std::string name;     // e.g. mpicoll:MPI_COMM_WORLD:device0
  std::string members;  // e.g. 0,2,4 (COMM_WORLD ranks, in the communicator's rank order)
};

inline CommIdentity* IdentifyComm(MPI_Comm comm) {
  auto* identity = new CommIdentity{CommName(comm), std::string()};  // kept for the process
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int size = 0;
  if (MPI_Comm_group(comm, &group) == MPI_SUCCESS && MPI_Group_size(group, &size) == MPI_SUCCESS &&
      MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
    std::vector<int> ranks(size), in_world(size, MPI_UNDEFINED);
    for (int i = 0; i < size; ++i) ranks[i] = i;
    MPI_Group_translate_ranks(group, size, ranks.data(), world, in_world.data());
    for (int i = 0; i < size; ++i) {
      identity->members += (i ? "," : "") + std::to_string(in_world[i]);
    }
  }
  if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
  return identity;
}

constexpr int kMaxShape = 6;  // dims recorded; a higher rank records its element count only

struct FlightRecord {
  std::atomic<uint64_t> stamp{0};  // 2 * (index + 1) once written; odd while being written
  uint64_t sequence;
  const char* op;
  const CommIdentity* comm;
  int32_t rank, size, dtype, ndims;  // ndims -1: shape not recorded
  int64_t dims[kMaxShape];
  int64_t count, bytes, site;
  int64_t queued_ns, started_ns;
  std::atomic<int64_t> finished_ns{0};  // 0 while running
  std::atomic<int32_t> failed{0};
};

constexpr uint64_t kChunkRecords = 4096;
constexpr uint64_t kMaxChunks = 4096;  // 2**24 records per device when tracing

// Slots [0, ring) hold the ring, [trace_base, trace_base + trace_next) the
// trace (trace_base: the ring's size when the trace began).
struct DeviceLog {
  std::atomic<FlightRecord*> chunks[kMaxChunks] = {};
  std::atomic<uint64_t> next{0};  // records written so far
  uint64_t ring_position = 0;     // where the next one goes in the ring (its writer's only)
  std::atomic<uint64_t> ring_used{0};         // ring slots written at least once
  std::atomic<uint64_t> trace_generation{0};  // the trace its trace slots belong to
  std::atomic<uint64_t> trace_base{0}, trace_next{0};
  std::unordered_map<uint64_t, int64_t> site_calls;  // per site and communicator (trace_skip)
};

// The recorder's state: what it keeps (set from Python: MPICOLL_FLIGHT_RECORDS,
// MPICOLL_TRACE), each device's log, and where it writes.  `mutex` guards the
// folders and each device log's allocation.
struct FlightRecorder {
  std::atomic<int64_t> capacity{1000};        // records per device in the ring; 0 = off
  std::atomic<bool> tracing{false};           // keep every record (MPICOLL_TRACE)
  std::atomic<uint64_t> trace_generation{0};  // +1 at each start of a trace
  std::atomic<int64_t> trace_skip{0};         // each site's first N calls are not traced
  std::atomic<DeviceLog*> device_logs[kCallSlots] = {};
  std::atomic<int64_t> clock_offset_ns{0};    // rank 0's clock minus this one's (tracing)
  std::mutex mutex;
  std::string flight_dir, trace_dir;  // (mutex: read them with FolderOf)
  // This user's folder in the shared temporary directory, <tmp>/mpicoll-<uid>
  // (own_files.h): the stacks report goes there, and so does the job's flight
  // folder where MPICOLL_FLIGHT_DIR is not set (job_flight_dir).
  std::string private_root;
  // flight_dir is the job's own folder in private_root, flight-<host>-<pid>
  // after rank 0's host and pid (the same on every rank), named once the
  // ranks have met (side_channel.h); this process's own until then.
  bool job_flight_dir = false;
  std::string last_write_problem;  // why the last file could not be written, "" (mutex)
  // The flight dump (the ring's last records), at most once per reason kind a
  // second (DumpFlight): a stall's state requests from several ranks ask at once.
  std::atomic<int64_t> last_dump_ns{0};
  std::string last_dump_reason;  // the last dump's (mutex)
};
inline FlightRecorder flight;

// A copy of one of the folders above, taken under their lock: the watchdog
// reads them while Python sets them, or the side channel's opening names the
// job's folder.
inline std::string FolderOf(const std::string& folder) {
  std::lock_guard<std::mutex> lock(flight.mutex);
  return folder;
}

inline bool Recording() { return flight.tracing.load(std::memory_order_relaxed) ||
                                 flight.capacity.load(std::memory_order_relaxed) > 0; }

inline DeviceLog* LogOf(int32_t device) {
  DeviceLog* log = flight.device_logs[device].load(std::memory_order_acquire);
  if (log) return log;
  std::lock_guard<std::mutex> lock(flight.mutex);
  log = flight.device_logs[device].load(std::memory_order_relaxed);
  if (!log) {
    log = new DeviceLog();  // kept for the process: the watchdog may read it at exit
    flight.device_logs[device].store(log, std::memory_order_release);
  }
  return log;
}

// The slot at `position`: in a ring of flight_capacity records, or, when
// tracing, the position-th record of the device's chunks.  nullptr when the
// trace is full.
inline FlightRecord* SlotAt(DeviceLog* log, uint64_t position) {
  const uint64_t chunk = position / kChunkRecords;
  if (chunk >= kMaxChunks) return nullptr;
  FlightRecord* records = log->chunks[chunk].load(std::memory_order_acquire);
  if (!records) {
    records = new FlightRecord[kChunkRecords];
    log->chunks[chunk].store(records, std::memory_order_release);  // only this device's thread writes
  }
  return &records[position % kChunkRecords];
}

// Whether the device's call at `site` on `comm` goes into the trace now (calls
// are counted per site and communicator: a meeting of local devices and its
// leader's MPI call are one call each).  The device's thread alone calls it;
// at its first call of a new trace it starts that trace's slots afresh (the
// writer reads them once the generation matches).
inline bool Traced(DeviceLog* log, int64_t site, const CommIdentity* comm) {
  const uint64_t generation = flight.trace_generation.load(std::memory_order_acquire);
  if (log->trace_generation.load(std::memory_order_relaxed) != generation) {
    log->trace_next.store(0, std::memory_order_relaxed);
    log->trace_base.store(static_cast<uint64_t>(std::max<int64_t>(0, flight.capacity.load())),
                          std::memory_order_relaxed);
    log->site_calls.clear();
    log->trace_generation.store(generation, std::memory_order_release);
  }
  const int64_t skip = flight.trace_skip.load(std::memory_order_relaxed);
  if (skip <= 0) return true;
  const uint64_t key = static_cast<uint64_t>(site) * 0x9E3779B97F4A7C15ull ^
                       reinterpret_cast<uintptr_t>(comm);
  return ++log->site_calls[key] > skip;
}

// Starts a record (finished_ns 0); returns it for FinishRecord, or nullptr.
inline FlightRecord* BeginRecord(int32_t device, const Call& c, const CommIdentity* comm,
                                 uint64_t sequence, int64_t queued_ns, int64_t started_ns) {
  if (!Recording()) return nullptr;
  DeviceLog* log = LogOf(device);
  const uint64_t index = log->next.load(std::memory_order_relaxed);
  uint64_t position;
  const bool traced = flight.tracing.load(std::memory_order_relaxed) && Traced(log, c.site, comm);
  if (traced) {
    position = log->trace_base.load(std::memory_order_relaxed) +
               log->trace_next.load(std::memory_order_relaxed);
  } else {  // the ring: no division on this path
    const uint64_t capacity =
        static_cast<uint64_t>(
            std::max<int64_t>(0, flight.capacity.load(std::memory_order_relaxed)));
    if (capacity == 0) return nullptr;  // a call the trace skips, and no ring
    position = log->ring_position;
    const uint64_t following = position + 1;
    log->ring_position = following >= capacity ? 0 : following;
    if (following > log->ring_used.load(std::memory_order_relaxed)) {
      log->ring_used.store(std::min(following, capacity), std::memory_order_release);
    }
  }
  FlightRecord* r = SlotAt(log, position);
  if (!r) return nullptr;
  r->stamp.store(2 * index + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  r->sequence = sequence;
  r->op = c.name;
  r->comm = comm;
  r->rank = c.rank;
  r->size = c.size;
  r->dtype = static_cast<int32_t>(c.dtype);
  r->ndims = c.dims && c.ndims <= kMaxShape ? c.ndims : -1;
  for (int i = 0; i < r->ndims; ++i) r->dims[i] = c.dims[i];
  r->count = static_cast<int64_t>(c.in_count);
  r->bytes = static_cast<int64_t>(c.in_count * c.elem_bytes);
  r->site = c.site;
  r->queued_ns = queued_ns ? queued_ns : started_ns;
  r->started_ns = started_ns;
  r->finished_ns.store(0, std::memory_order_relaxed);
  r->failed.store(0, std::memory_order_relaxed);
  r->stamp.store(2 * index + 2, std::memory_order_release);
  log->next.store(index + 1, std::memory_order_release);
  if (traced) log->trace_next.fetch_add(1, std::memory_order_release);
  return r;
}

inline void FinishRecord(FlightRecord* r, int64_t finished_ns, bool failed) {
  if (!r) return;
  r->failed.store(failed ? 1 : 0, std::memory_order_relaxed);
  r->finished_ns.store(finished_ns, std::memory_order_release);
}

// ---------------------------------------------------------------------------
// Writing the records: a Chrome trace, one "X" event per span.  The collective
// is the span started -> finished (to the time of writing while it runs), and
// a "queued" span precedes it where the device waited for its earlier
// overlapped calls, the serialized lock or the check.
inline std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (unsigned char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", ch);
      out += escaped;
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out + "\"";
}

// The user's name of a communicator: mpicoll's duplicates are named
// "mpicoll:<name>:device<k>" (comm.py).  Records keep the full name.
inline std::string UserCommName(std::string name) {
  const std::string prefix = "mpicoll:";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  const size_t device = name.rfind(":device");
  return device == std::string::npos ? name : name.substr(0, device);
}

// Call sites as the user's source lines (set from Python when a call is lowered).
struct CallSites {
  std::mutex mutex;
  std::map<int64_t, std::string> descriptions;  // site -> "file:line (function)"
  std::map<int64_t, std::string> written_as;    // site -> "jax.lax.psum over (...)"
  std::set<int64_t> uncompared;                 // eager calls' (module_watch.cc)
};
inline CallSites call_sites;

// The collective as the user wrote it, where that is not mpicoll's own call
// (a jax.lax collective routed to mpicoll), else "".
inline std::string SiteWrittenAs(int64_t site) {
  std::lock_guard<std::mutex> lock(call_sites.mutex);
  auto found = call_sites.written_as.find(site);
  return found == call_sites.written_as.end() ? std::string() : found->second;
}

inline bool SiteCompared(int64_t site) {
  std::lock_guard<std::mutex> lock(call_sites.mutex);
  return call_sites.uncompared.count(site) == 0;
}

inline std::string SiteText(int64_t site) {
  std::lock_guard<std::mutex> lock(call_sites.mutex);
  auto found = call_sites.descriptions.find(site);
  return found == call_sites.descriptions.end() ? std::string() : found->second;
}

// What a watch slot's calls are, in reports and records: "local device 1", or
// "XLA's own collectives" (from kXlaSlot up).
inline std::string SlotName(int slot) {
  return slot >= kXlaSlot ? "XLA's own collectives" : "local device " + std::to_string(slot);
}

inline std::string& HostName() {
  static std::string host = [] {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    return std::string(name);
  }();
  return host;
}

// Which records a file holds: the flight dump (the ring, and while tracing the
// trace too) or the timeline (the trace's alone).
enum class Kept { kFlight, kTrace };

// The records of every local device as a Chrome trace (each device's last
// `last` of them); `reason` says why it was written.  Times in microseconds
// on this process's steady clock.
inline std::string RecordsJson(int world_rank, int world_size, const std::string& reason,
                               Kept kept, size_t last = SIZE_MAX) {
  const bool all = kept == Kept::kTrace || flight.tracing.load();
  const int64_t now = NowNs();
  // The reason may be a whole report: it is joined as a string, not formatted
  // into a fixed buffer.
  char rest[256];
  std::snprintf(rest, sizeof(rest),
                ", \"written_ns\": %lld, \"clock_offset_ns\": %lld, \"kept\": %s, "
                "\"trace_skip\": %lld},\n\"traceEvents\": [\n",
                static_cast<long long>(now), static_cast<long long>(flight.clock_offset_ns.load()),
                all ? "\"all\"" : "\"last\"", static_cast<long long>(flight.trace_skip.load()));
  std::string out = "{\"displayTimeUnit\": \"ns\", \"otherData\": {\"mpicoll\": 1, \"rank\": " +
                    std::to_string(world_rank) + ", \"size\": " + std::to_string(world_size) +
                    ", \"host\": " + JsonString(HostName()) + ", \"reason\": " +
                    JsonString(reason) + rest;
  char meta[160];
  std::snprintf(meta, sizeof(meta),
                "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"args\": "
                "{\"name\": \"rank %d\"}}",
                world_rank, world_rank);
  out += meta;
  for (int d = 0; d < kCallSlots; ++d) {
    DeviceLog* log = flight.device_logs[d].load(std::memory_order_acquire);
    if (!log) continue;
    std::snprintf(meta, sizeof(meta),
                  ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": %d, \"tid\": %d, "
                  "\"args\": {\"name\": \"%s\"}}",
                  world_rank, d, SlotName(d).c_str());
    out += meta;
    // The slots in use, in the order they were written (by their stamps): the
    // ring's, and the trace's where it is this trace's.
    std::vector<std::pair<uint64_t, FlightRecord*>> in_order;
    auto take = [&](uint64_t from, uint64_t to) {
      for (uint64_t position = from; position < to; ++position) {
        if (position / kChunkRecords >= kMaxChunks) break;
        FlightRecord* r = log->chunks[position / kChunkRecords].load(std::memory_order_acquire);
        if (!r) continue;
        r += position % kChunkRecords;
        const uint64_t stamp = r->stamp.load(std::memory_order_acquire);
        if (stamp != 0 && stamp % 2 == 0) in_order.emplace_back(stamp, r);
      }
    };
    if (kept == Kept::kFlight) take(0, log->ring_used.load(std::memory_order_acquire));
    if (all && log->trace_generation.load(std::memory_order_acquire) ==
                   flight.trace_generation.load(std::memory_order_acquire)) {
      const uint64_t base = log->trace_base.load(std::memory_order_relaxed);
      take(base, base + log->trace_next.load(std::memory_order_acquire));
    }
    std::sort(in_order.begin(), in_order.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    if (in_order.size() > last) in_order.erase(in_order.begin(), in_order.end() - last);
    for (const auto& [stamp, r] : in_order) {
      const int64_t finished = r->finished_ns.load(std::memory_order_acquire);
      std::string shape = "[";
      for (int i = 0; i < r->ndims; ++i) shape += (i ? "," : "") + std::to_string(r->dims[i]);
      shape += r->ndims < 0 ? std::to_string(r->count) + "]" : "]";
      const bool no_data = r->ndims < 0 && r->count == 0;  // a barrier
      const std::string call = std::string(r->op) + "(" +
          (no_data ? std::string() : DtypeName(static_cast<ffi::DataType>(r->dtype)) + shape) +
          ")";
      std::string args = "{\"sequence\": " + std::to_string(r->sequence) +
          ", \"call\": " + JsonString(call) + ", \"op\": " + JsonString(r->op) +
          ", \"comm\": " + JsonString(r->comm ? r->comm->name : "?") +
          ", \"members\": " + JsonString(r->comm ? r->comm->members : "") +
          ", \"comm_rank\": " + std::to_string(r->rank) +
          ", \"comm_size\": " + std::to_string(r->size) +
          ", \"dtype\": " + JsonString(DtypeName(static_cast<ffi::DataType>(r->dtype))) +
          ", \"shape\": " + (r->ndims < 0 ? std::string("null") : shape) +
          ", \"bytes\": " + std::to_string(r->bytes) +
          ", \"site\": " + JsonString(SiteText(r->site)) +
          ", \"queued_ns\": " + std::to_string(r->queued_ns) +
          ", \"started_ns\": " + std::to_string(r->started_ns) +
          ", \"finished_ns\": " + (finished ? std::to_string(finished) : std::string("null")) +
          ", \"failed\": " + (r->failed.load() ? "true" : "false") + "}";
      char event[256];
      if (r->started_ns > r->queued_ns) {
        std::snprintf(event, sizeof(event),
                      ",\n{\"ph\": \"X\", \"cat\": \"queued\", \"name\": \"queued\", \"pid\": %d, "
                      "\"tid\": %d, \"ts\": %.3f, \"dur\": %.3f}",
                      world_rank, d, r->queued_ns * 1e-3, (r->started_ns - r->queued_ns) * 1e-3);
        out += event;
      }
      std::snprintf(event, sizeof(event),
                    ",\n{\"ph\": \"X\", \"cat\": \"collective\", \"pid\": %d, \"tid\": %d, "
                    "\"ts\": %.3f, \"dur\": %.3f, \"name\": ",
                    world_rank, d, r->started_ns * 1e-3,
                    ((finished ? finished : now) - r->started_ns) * 1e-3);
      out += event + JsonString(call) + ", \"args\": " + args + "}";
    }
  }
  return out + "\n]}\n";
}

// Writes `text` to dir/name (own_files.h: a folder of this user's, nothing
// followed or reused), so a reader never sees half a file; false where it
// cannot, with the reason kept for the reports (LastWriteProblem).
inline bool WriteFileAtomically(const std::string& dir, const std::string& name,
                                const std::string& text) {
  if (dir.empty()) return false;
  // The watchdog and the main thread may both write (an abort meets a notice).
  static std::mutex writing;
  std::lock_guard<std::mutex> lock(writing);
  const OwnFolder folder = OpenOwnFolder(dir, FolderOf(flight.private_root));
  const std::string problem =
      folder.ok() ? WriteFileIn(folder, dir, name, text) : folder.problem();
  std::lock_guard<std::mutex> state(flight.mutex);
  flight.last_write_problem = problem;
  return problem.empty();
}

// Why the last file could not be written ("" if it was).
inline std::string LastWriteProblem() {
  std::lock_guard<std::mutex> lock(flight.mutex);
  return flight.last_write_problem;
}

// Whether dir/name is a file written in the last `seconds`.
inline bool WrittenWithin(const std::string& dir, const std::string& name, double seconds) {
  const OwnFolder folder = OpenOwnFolder(dir, FolderOf(flight.private_root), /*create=*/false);
  return WrittenWithinIn(folder, name, seconds);
}

// Writes the records to dir/rank<r>.json; false where it cannot.
inline bool WriteRecords(const std::string& dir, int world_rank, int world_size,
                         const std::string& reason, Kept kept) {
  return WriteFileAtomically(dir, "rank" + std::to_string(world_rank) + ".json",
                             RecordsJson(world_rank, world_size, reason, kept));
}

// The flight dump (the ring's last records), at most once per `reason` kind a
// second: a stall's state requests from several ranks ask at once.
inline bool DumpFlight(int world_rank, int world_size, const std::string& reason) {
  const std::string dir = FolderOf(flight.flight_dir);
  if (flight.capacity.load() <= 0 || dir.empty()) return false;
  const int64_t now = NowNs(), last = flight.last_dump_ns.load();
  if (last && now - last < 1000000000) return true;
  flight.last_dump_ns.store(now);
  {
    std::lock_guard<std::mutex> lock(flight.mutex);
    flight.last_dump_reason = reason;
  }
  return WriteRecords(dir, world_rank, world_size, reason, Kept::kFlight);
}

// The reason of a dump written in the last 2 s (a copy of the records sent
// elsewhere says the same as the file here), else `fallback`.
inline std::string RecentDumpReason(const std::string& fallback) {
  if (NowNs() - flight.last_dump_ns.load() > 2000000000) return fallback;
  std::lock_guard<std::mutex> lock(flight.mutex);
  return flight.last_dump_reason.empty() ? fallback : flight.last_dump_reason;
}

// The trace so far, to trace_dir ("" once it has stopped: nothing is written).
inline bool WriteTrace(int world_rank, int world_size, const std::string& reason) {
  const std::string dir = FolderOf(flight.trace_dir);
  if (dir.empty()) return false;
  return WriteRecords(dir, world_rank, world_size, reason, Kept::kTrace);
}

// Starts a trace to `dir`, each site's first `skip` calls per device left out.
inline void StartTrace(const std::string& dir, int64_t skip) {
  {
    std::lock_guard<std::mutex> lock(flight.mutex);
    flight.trace_dir = dir;
  }
  flight.trace_skip.store(skip);
  flight.trace_generation.fetch_add(1, std::memory_order_acq_rel);
  flight.tracing.store(true);
}

// Stops the trace and writes it (false: there was none, or it cannot be written).
inline bool StopTrace(int world_rank, int world_size, const std::string& reason) {
  flight.tracing.store(false);
  const bool written = WriteTrace(world_rank, world_size, reason);
  std::lock_guard<std::mutex> lock(flight.mutex);
  flight.trace_dir.clear();
  return written;
}

// SIGUSR1: a flight dump; SIGUSR2: a report of where every rank is (watchdog.h,
// WriteStacksReport).  Both written by the watchdog thread (no file I/O or MPI
// in a signal handler).  A handler already there is chained to: MPICH installs
// one for SIGUSR1 at MPI_Init (its launcher signals process failures with it),
// and a dump is welcome then too.  A program that sets its own handler later
// (signal.signal) replaces this one.
struct SignalRequests {
  std::atomic<bool> flight_dump{false}, stacks{false};  // asked, not yet written
  struct sigaction previous_sigusr1 = {}, previous_sigusr2 = {};  // chained to
};
inline SignalRequests signal_requests;

inline void ChainTo(const struct sigaction& before, int signal, siginfo_t* info, void* context) {
  if (before.sa_flags & SA_SIGINFO) {
    if (before.sa_sigaction) before.sa_sigaction(signal, info, context);
  } else if (before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN) {
    before.sa_handler(signal);
  }
}

inline void OnSigusr1(int signal, siginfo_t* info, void* context) {
  signal_requests.flight_dump.store(true);
  ChainTo(signal_requests.previous_sigusr1, signal, info, context);
}

inline void OnSigusr2(int signal, siginfo_t* info, void* context) {
  signal_requests.stacks.store(true);
  ChainTo(signal_requests.previous_sigusr2, signal, info, context);
}

inline void InstallSignalHandlers() {
  struct sigaction action = {};
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_SIGINFO;
  action.sa_sigaction = OnSigusr1;
  sigaction(SIGUSR1, &action, &signal_requests.previous_sigusr1);
  action.sa_sigaction = OnSigusr2;
  sigaction(SIGUSR2, &action, &signal_requests.previous_sigusr2);
}

}  // namespace mpicoll

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
//
// This header is the recorder itself (the records and each device's log);
// records_file.h writes them out, call_sites.h names their call sites, and
// signals.h asks for a dump from outside.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../engine/call.h"
#include "../engine/dtypes.h"

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

}  // namespace mpicoll

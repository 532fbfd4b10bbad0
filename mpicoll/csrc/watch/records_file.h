// Writing the flight recorder's records (flight.h) out: a Chrome trace, one
// "X" event per span.  The collective is the span started -> finished (to the
// time of writing while it runs), and a "queued" span precedes it where the
// device waited for its earlier overlapped calls, the serialized lock or the
// check.  The flight dump and the timeline are both this one format, written
// atomically into a folder of this user's (own_files.h).
#pragma once

#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>

#include "../engine/dtypes.h"
#include "call_sites.h"
#include "flight.h"
#include "own_files.h"

namespace mpicoll {

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

}  // namespace mpicoll

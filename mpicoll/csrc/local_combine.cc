// The local combine: a global allreduce of small arrays whose local devices
// meet in this process first (global_collectives.py, LOCAL_COMBINE_BYTES).
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/call.h"
#include "core/collectives.h"
#include "core/comm_table.h"
#include "core/execute.h"
#include "core/guard.h"
#include "entries/entries.h"
#include "memory/host.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
namespace {

// Global allreduce of small arrays (global_collectives.py, LOCAL_COMBINE_BYTES):
// the L device threads of this process that run one pmap/shard_map program
// meet here instead of in XLA's own collectives (whose rendezvous cost as much
// as the MPI call at 4 KiB).  Each thread posts its input and waits; once all L
// are here, each thread reduces its own 1/L slice of the L inputs into a shared
// buffer with MPI_Reduce_local (MPI's operators, so every op and dtype the
// per-device allreduce takes; the inputs in device order, so the result does
// not depend on who arrived first), all L slices at once: one thread alone
// would be a serial pass over L times the array (3x XLA's psum at 1 MiB over 2
// devices, measured).  Then the thread of the lowest device ordinal (the same
// local device on every rank, so every rank's leader talks on the same
// communicator) runs ONE MPI allreduce on its own communicator (Execute: check
// mode, timeout, serialized lock as for any call) and publishes the result;
// every thread then copies it to its output.  A generation counter separates
// successive calls: a thread that returns and comes back for the next call
// cannot mix with the one still copying out, because the next call cannot
// finish (nor, since only the last arrival resizes it, touch the shared
// buffer) before that thread arrives too.  Waiting threads are watched by the
// timeout like an MPI wait (a device that never arrives aborts the job after
// MPICOLL_TIMEOUT); a short spin before sleeping keeps the wake-up off the
// futex path at these sizes.
struct LocalMeeting {
  std::mutex mutex;
  std::condition_variable changed;
  std::atomic<uint64_t> generation{0};  // calls completed
  std::atomic<int> arrived{0};
  std::atomic<int> reduced{0};  // slices reduced in this call
  int expected = 0;
  size_t bytes = 0;
  ffi::DataType dtype = ffi::DataType::INVALID;
  int64_t op = -1;
  const char* inputs[kMaxLocalDevices];
  int32_t devices[kMaxLocalDevices];
  std::vector<char> combined;
  std::string mismatch;  // arrivals that disagree (never in one SPMD program)
  std::string error;     // this generation's failure, seen by every thread
};
// One per communicator slot, like the table row it serves.
LocalMeeting* const local_meetings = new LocalMeeting[kMaxComms];
constexpr int64_t kLocalSpinNs = 50000;

// Waits (spin, then sleep) until ready() holds; ready reads atomics only.
template <typename Ready>
void AwaitLocal(LocalMeeting& m, std::unique_lock<std::mutex>& lock, Ready&& ready) {
  if (ready()) return;
  lock.unlock();
  const int64_t spin_until = NowNs() + kLocalSpinNs;
  while (!ready() && NowNs() < spin_until) std::this_thread::yield();
  lock.lock();
  m.changed.wait(lock, ready);
}

// This thread's part once all L are here: reduce slice `part` of the L inputs
// (in device order: the last arrival sorted them) into m.combined.  Runs
// without the lock: the slices are disjoint, and nothing else of the meeting
// changes until every slice is in.
ffi::Error ReduceLocalSlice(LocalMeeting& m, const Call& c, int part) {
  const int local = m.expected;
  const size_t count = c.in_count;
  const size_t begin = count * part / local, end = count * (part + 1) / local;
  const size_t offset = begin * c.elem_bytes;
  char* into = m.combined.data() + offset;
  std::memcpy(into, m.inputs[0] + offset, (end - begin) * c.elem_bytes);
  for (int i = 1; i < local; ++i) {
    for (size_t at = begin; at < end; at += kMaxChunk) {
      const int n = static_cast<int>(std::min(kMaxChunk, end - at));
      const size_t from = (at - begin) * c.elem_bytes;
      const int rc = MPI_Reduce_local(m.inputs[i] + offset + from, into + from, n,
                                      c.type, c.mpi_op);
      if (rc != MPI_SUCCESS) return MpiFailure(c, rc);
    }
  }
  return ffi::Error::Success();
}

// The leader's part once every slice is in: one MPI allreduce of m.combined, in place.
ffi::Error LeadLocalAllreduce(LocalMeeting& m, const Call& mine, int32_t device, int local,
                              ffi::Span<const int64_t> dims) {
  Call c = mine;
  c.in = c.out = m.combined.data();
  HostMemory memory;
  memory.advise_huge_pages = false;
  return Execute<AllreduceOp>(c, device, memory, [&] {
    return Describe(c, c.dtype, dims, true, false) + ", over " + std::to_string(local) +
           " local devices";
  });
}

ffi::Error CpuLocalAllreduceEntry(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                                  ffi::Result<ffi::AnyBuffer> out, int32_t device,
                                  int64_t comm_slot, int64_t op, int64_t site, int64_t local) {
  Call c{};
  if (ffi::Error err = PrepareArray<AllreduceOp>(c, x, out, device, comm_slot, /*root=*/0, op,
                                                 site, ffi::Span<const int64_t>());
      err.failure()) {
    return err;
  }
  if (local < 1 || local > kMaxLocalDevices) {
    return ffi::Error::InvalidArgument("mpicoll.allreduce: local devices out of range");
  }
  if (local == 1) {  // nobody to meet: the per-device call
    HostMemory memory;
    return Execute<AllreduceOp>(c, device, memory, [&] {
      return DescribeArray<AllreduceOp>(c, x) + ", over 1 local devices";
    });
  }
  if (c.in_count == 0) return ffi::Error::Success();  // the same shape on every participant
  progress_threads[device].Drain();  // this device's queued calls come first
  LocalMeeting& m = local_meetings[comm_slot % kMaxComms];
  const size_t bytes = c.in_count * c.elem_bytes;
  std::unique_lock<std::mutex> lock(m.mutex);
  const uint64_t generation = m.generation.load();
  const int index = m.arrived.load();
  if (index == 0) {
    m.expected = static_cast<int>(local);
    m.bytes = bytes;
    m.dtype = c.dtype;
    m.op = op;
    m.mismatch.clear();
  } else if (m.expected != local || m.bytes != bytes || m.dtype != c.dtype || m.op != op) {
    m.mismatch = "mpicoll.allreduce: the local devices called different global allreduces "
                 "on one communicator at once (local device " + std::to_string(device) + ")";
  }
  m.inputs[index] = c.in;
  m.devices[index] = device;
  if (index + 1 == m.expected) {
    // The last arrival resets the call's shared state: every thread of the
    // previous call has arrived here, so none still reads its error or copies
    // out of the buffer.  It puts the arrivals in device order: the leader
    // (lowest device) first, each thread's slice at its position.
    m.error.clear();
    if (m.mismatch.empty()) m.combined.resize(m.bytes);
    std::pair<int32_t, const char*> arrivals[kMaxLocalDevices];
    for (int i = 0; i < m.expected; ++i) arrivals[i] = {m.devices[i], m.inputs[i]};
    std::sort(arrivals, arrivals + m.expected);
    for (int i = 0; i < m.expected; ++i) std::tie(m.devices[i], m.inputs[i]) = arrivals[i];
  }
  m.arrived.store(index + 1);
  m.changed.notify_all();
  Call waiting = c;
  waiting.name = "allreduce (waiting for this process's other local devices)";
  {
    InFlightScope watched(waiting, device, /*new_call=*/false);
    AwaitLocal(m, lock, [&] {
      return m.arrived.load() == m.expected || m.generation.load() != generation;
    });
  }
  if (m.generation.load() == generation) {  // everyone is here, nobody has published yet
    const int32_t leader = m.devices[0];
    const int part = static_cast<int>(std::find(m.devices, m.devices + m.expected, device) -
                                      m.devices);
    std::string failed = m.mismatch;
    if (failed.empty()) {
      lock.unlock();
      ffi::Error err = ReduceLocalSlice(m, c, part);
      lock.lock();
      if (err.failure()) failed = std::string(err.message());
    }
    if (!failed.empty() && m.error.empty()) m.error = failed;
    m.reduced.store(m.reduced.load() + 1);
    m.changed.notify_all();
    if (device == leader) {
      {
        InFlightScope watched(waiting, device, /*new_call=*/false);
        AwaitLocal(m, lock, [&] { return m.reduced.load() == m.expected; });
      }
      if (m.error.empty()) {
        lock.unlock();
        ffi::Error err = LeadLocalAllreduce(m, c, device, m.expected, x.dimensions());
        lock.lock();
        if (err.failure()) m.error = std::string(err.message());
      }
      m.reduced.store(0);
      m.arrived.store(0);
      m.generation.store(generation + 1);
      m.changed.notify_all();
    } else {
      InFlightScope watched(waiting, device, /*new_call=*/false);
      AwaitLocal(m, lock, [&] { return m.generation.load() != generation; });
    }
  }
  // Until this thread arrives at the next call, nobody writes m.combined or m.error.
  const std::string error = m.error;
  lock.unlock();
  if (!error.empty()) return ffi::Error::Internal(error);
  std::memcpy(c.out, m.combined.data(), bytes);
  return ffi::Error::Success();
}

}  // namespace

// The global allreduce of small arrays (CPU only; see CpuLocalAllreduceEntry).
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuLocalAllreduce, CpuLocalAllreduceEntry,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ctx<LocalDevice>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("local"));

}  // namespace mpicoll

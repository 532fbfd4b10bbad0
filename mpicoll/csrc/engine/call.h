// One decoded call (Call), the chunk it runs in (Chunk), and the one error path.
#pragma once

#include <mpi.h>

#if defined(OMPI_MAJOR_VERSION) && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: ULFM's MPIX_Comm_revoke where built with it
#endif

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "comm_table.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// One decoded call: what every collective body needs.  `in`/`out` are the
// buffers MPI reads and writes: XLA's own on CPU (and with CUDA-aware MPI),
// pinned host staging buffers when GPU data is staged (the memory strategies,
// memory/).
struct Call {
  const char* name;
  MPI_Comm comm;
  MPI_Comm internal_comm;  // see DeviceComm::internal
  // comm's table key (generation and slot): what the watchdog's sequence numbers
  // and the records' communicator identity are kept by (watch/in_flight.h), since MPI
  // hands a freed communicator's handle to the next one it makes.
  int64_t comm_key;
  int rank;
  int size;
  int root;
  int64_t op;
  MPI_Datatype type;
  MPI_Op mpi_op;  // MPI_OP_NULL for collectives that do not reduce
  size_t elem_bytes;
  char* in;
  char* out;
  size_t in_count;
  size_t out_count;
  int64_t site;  // the call site in its program (for the first-run check)
  ffi::DataType dtype;
  // The vector and point-to-point families' static arguments (counts, peers).
  const int64_t* args;
  size_t nargs;
  // What a point-to-point body reports: the source and tag it received from,
  // and why a received message did not fit (kCheckFailed).
  mutable int32_t status[2];
  mutable std::string failure;
  // The input's shape, for the flight records (nullptr: not known, e.g. fused
  // arrays), and when an overlapped call was queued (0: a synchronous call).
  const int64_t* dims;
  int ndims;
  int64_t queued_ns;
  // in/out are device pointers (CUDA-aware MPI): no host code may touch them.
  bool device_buffers;
};

inline bool InPlace(const Call& c) { return c.in == c.out; }

// Largest element count passed to a single MPI call (fits an int, and keeps
// a derived block type's byte size far from overflow).
constexpr size_t kMaxChunk = size_t{1} << 30;

// Every buffer of a collective is made of rank blocks of `block` elements
// (one block for bcast/reduce/allreduce and for a gather's input; `size`
// blocks for a gather's output, a scatter's input, alltoall).  A collective
// runs as one MPI call per chunk: the element range [offset, offset + count)
// of every block.  Chunks exist for two reasons, handled by the same loop:
// counts above INT_MAX, and the GPU staging pipeline (copy chunk k+1 in and
// chunk k-1 out while MPI moves chunk k).
struct Chunk {
  size_t offset;  // elements into each block
  int count;      // elements of each block in this chunk
  size_t block;   // elements per block
  size_t at(const Call& c) const { return offset * c.elem_bytes; }
};

// How a chunk of every rank's block is described to MPI: plain counts when
// the chunk is the whole block, else one element of a type covering `count`
// elements whose extent is a whole block, so consecutive ranks' ranges are a
// block apart.
struct RankBlocks {
  MPI_Datatype type;
  int count;
  int rc = MPI_SUCCESS;
  MPI_Datatype contiguous_ = MPI_DATATYPE_NULL, resized_ = MPI_DATATYPE_NULL;
  RankBlocks(const Call& c, const Chunk& k) : type(c.type), count(k.count) {
    if (static_cast<size_t>(k.count) == k.block) return;
    rc = MPI_Type_contiguous(k.count, c.type, &contiguous_);
    if (rc == MPI_SUCCESS) {
      rc = MPI_Type_create_resized(contiguous_, 0, static_cast<MPI_Aint>(k.block * c.elem_bytes),
                                   &resized_);
    }
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&resized_);
    type = resized_;
    count = 1;
  }
  ~RankBlocks() {
    if (resized_ != MPI_DATATYPE_NULL) MPI_Type_free(&resized_);
    if (contiguous_ != MPI_DATATYPE_NULL) MPI_Type_free(&contiguous_);
  }
};

// What a collective's body or a memory strategy returns besides MPI's codes
// (which are never negative).
constexpr int kTransportFailed = -1;  // a strategy's copy failed; its `error` says why
constexpr int kCheckFailed = -2;      // a body's own check failed; c.failure says why

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline std::string CommName(MPI_Comm comm) {
  char name[MPI_MAX_OBJECT_NAME];
  int len = 0;
  if (MPI_Comm_get_name(comm, name, &len) != MPI_SUCCESS || len == 0) return "<unnamed>";
  return std::string(name, len);
}

// ---------------------------------------------------------------------------
// The one error path.

// Set once a call has failed because a process of its communicator died (ULFM:
// a job launched fault-tolerant, MPICOLL_FT=1 on Open MPI 5); Python reads it
// (mpicoll.lost_ranks, mpicoll.RankLost).
inline std::atomic<bool> rank_lost{false};
// The marker Python turns into mpicoll.RankLost (runtime/faults.py).
inline constexpr const char* kRankLostMarker = "a rank of the job was lost";

// The error code of a failed process, for a failure this process learnt of
// without an MPI call returning it (KnownFailedProcess).
#if defined(MPIX_ERR_PROC_FAILED)
constexpr int kProcessFailed = MPIX_ERR_PROC_FAILED;
#else
constexpr int kProcessFailed = MPI_ERR_OTHER;
#endif

// Whether this process knows a process of `comm` to have failed (ULFM's local
// view, no communication): for a wait that a failure may leave pending rather
// than fail, such as a nonblocking duplicate of COMM_WORLD.
inline bool KnownFailedProcess(MPI_Comm comm) {
#if defined(MPIX_ERR_PROC_FAILED) && defined(OMPI_MAJOR_VERSION) && OMPI_MAJOR_VERSION >= 5
  MPI_Group failed = MPI_GROUP_NULL;
  if (MPIX_Comm_get_failed(comm, &failed) != MPI_SUCCESS) return false;
  int size = 0;
  MPI_Group_size(failed, &size);
  MPI_Group_free(&failed);
  return size > 0;
#else
  (void)comm;
  return false;
#endif
}

// Whether rc says a process of the communicator failed, or the communicator was
// revoked because one did.  The first failure seen revokes every communicator
// mpicoll talks on (of more than one rank: every device's, every split's), so
// that every survivor waiting anywhere in mpicoll returns too: one that waits
// for a survivor which has already returned, on this communicator or another,
// would otherwise wait forever.  They are all remade by mpicoll.shrink().
inline bool RankLostFailure(MPI_Comm comm, int rc) {
#if defined(MPIX_ERR_PROC_FAILED) && defined(MPIX_ERR_REVOKED)
  int error_class = 0;
  if (MPI_Error_class(rc, &error_class) != MPI_SUCCESS) return false;
  if (error_class != MPIX_ERR_PROC_FAILED && error_class != MPIX_ERR_PROC_FAILED_PENDING &&
      error_class != MPIX_ERR_REVOKED) {
    // Open MPI's communicator creation may fail with MPI_ERR_OTHER when a
    // member dies during it (its nonblocking agreement on a context id): any
    // error on a communicator with a process known to have failed is that failure.
    if (comm == MPI_COMM_NULL || !KnownFailedProcess(comm)) return false;
  }
  if (comm != MPI_COMM_NULL) MPIX_Comm_revoke(comm);
  if (!rank_lost.exchange(true)) {
    for (std::atomic<CommRow*>& slot : comm_table) {
      CommRow* row = slot.load(std::memory_order_acquire);
      if (row == nullptr || row->key.load(std::memory_order_acquire) < 0) continue;
      for (DeviceComm& device : row->devices) {
        if (device.comm == MPI_COMM_NULL || device.size < 2) continue;
        MPIX_Comm_revoke(device.comm);
        if (device.internal != MPI_COMM_NULL) MPIX_Comm_revoke(device.internal);
      }
    }
  }
  return true;
#else
  (void)comm;
  (void)rc;
  return false;
#endif
}

// What follows a failed MPI call's text where a rank was lost: Python raises the
// error as mpicoll.RankLost from eager calls and mpicoll.fault_tolerant steps;
// a bare jax.jit step raises it as JAX's own error type, which no handler can
// change, so the text says how to catch it as RankLost.
inline const std::string& RankLostSuffix() {
  static const std::string suffix =
      std::string(" (") + kRankLostMarker +
      ": mpicoll.RankLost, raised as such where the jitted step is wrapped with "
      "mpicoll.fault_tolerant)";
  return suffix;
}

// The one text of a failed MPI call, for every caller that meets one (a
// collective, the check across ranks, a communicator's registration): `what`,
// MPI's own text, and where a process failed (the communicators are then
// revoked, RankLostFailure) `lost`, which holds the marker Python turns into
// mpicoll.RankLost.  XLA's own collectives (mpiabi/jax_calls.cc) say only the
// marker: they run in a plain jit, on communicators of XLA's that no shrink remakes.
inline std::string MpiFailureText(const std::string& what, MPI_Comm comm, int rc,
                                  const std::string& lost = RankLostSuffix()) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  return what + ": " + std::string(text, len) + (RankLostFailure(comm, rc) ? lost : std::string());
}

inline ffi::Error MpiFailure(const Call& c, int rc) {
  return ffi::Error::Internal(MpiFailureText(std::string("mpicoll.") + c.name +
                                                 " failed on rank " + std::to_string(c.rank) +
                                                 " of communicator " + CommName(c.comm),
                                             c.comm, rc));
}

inline ffi::Error Resolve(Call& c, int32_t device, int64_t comm_slot) {
  const DeviceComm* entry = LookupComm(comm_slot, device);
  if (entry == nullptr) {
    // Internal, as every error of a running collective: JAX raises JaxRuntimeError
    // for it on every dispatch path (InvalidArgument becomes a ValueError on some).
    return ffi::Error::Internal(std::string("mpicoll.") + c.name +
                                ": no communicator registered for slot " +
                                std::to_string(comm_slot) + " on device " +
                                std::to_string(device) +
                                " (freed, or the program outlived its communicator)");
  }
  c.comm = entry->comm;
  c.internal_comm = entry->internal;
  c.comm_key = comm_slot;
  c.rank = entry->rank;
  c.size = entry->size;
  return ffi::Error::Success();
}

}  // namespace mpicoll

// The extension's side of JAX's CPU collectives on mpicoll's MPI (abi.h says
// the design): the calls mpicoll's MPI ABI library forwards, on the job's MPI,
// and connect_jax_mpi(), which hands them to the library jaxlib's trampoline
// loaded.  XLA's collectives get a communicator of their own, a duplicate of
// COMM_WORLD made at connection (every rank, in mpicoll.distributed.initialize),
// so their messages never meet the program's or mpicoll's own.
//
// Every call XLA makes that can wait for another rank runs under mpicoll's
// watch (watch/guard.h), in its own slot (kXlaSlot): the timeout, the stall
// report, the flight records and the check across ranks cover it as they
// cover mpicoll's own collectives, named for what XLA inserted ("all-reduce
// (float32[8], op=sum), inserted by XLA").  A failure reaches XLA as an error
// code whose text (ErrorString) is the watch's message, which XLA raises.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_set>

#include "../engine/call.h"
#include "../engine/comm_table.h"
#include "../watch/guard.h"
#include "../watch/rank_state.h"
#include "abi.h"
#include "jax_calls.h"
#include "xla_groups.h"

namespace mpicoll {
namespace {

using mpiabi::Token;

// Errors of this side, explained by ErrorString (MPI's own codes pass through).
constexpr int kUnknownHandle = 0x7f000010;
constexpr int kUnsupportedType = 0x7f000011;
constexpr int kUnsupportedOp = 0x7f000012;
constexpr int kWatchedFailure = 0x7f000013;  // the calling thread's failure_text says what

// The text of this thread's last kWatchedFailure: XLA asks for it (Error_string)
// on the thread whose call failed, right after the call.
thread_local std::string failure_text;

constexpr uint64_t kCommMagic = 0x6d70636f6c6c436dull;     // "mpcollCm"
constexpr uint64_t kRequestMagic = 0x6d70636f6c6c5271ull;  // "mpcollRq"

// A communicator XLA made (Comm_split), or XLA's COMM_WORLD: what the watch
// needs of it besides the handle, looked up once.
struct CommBox {
  uint64_t magic = kCommMagic;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm internal = MPI_COMM_NULL;  // the checks' duplicate (guard.h's CheckComm)
  int rank = -1, size = 0;
  int64_t key = 0;  // the watch's key for it: 1, 2, ... (never reused)
  int slot = kXlaSlot;  // its watch slot (kXlaSlot + key % kXlaSlots)
  // The calls the ranks agreed on here (first-run checks): each rank's box sees
  // the same calls in the same order, so every rank decides alike to compare.
  mutable std::mutex agreed_mutex;
  mutable std::unordered_set<uint64_t> agreed;
  // With several devices per process (xla_groups.h): the device's place in its
  // group (rank: its member number, size: the group's devices); comm is then
  // the group's communicator of processes.
  xla_groups::Place place;
};

// A datatype XLA passes: MPI's, the name the watch describes it by, its size.
struct TypeFacts {
  MPI_Datatype mpi = MPI_DATATYPE_NULL;
  ffi::DataType dtype = ffi::DataType::INVALID;
  size_t bytes = 0;
};

// A nonblocking call in flight (collective-permute's Isend and Irecv), with
// what its Wait is watched as.
struct RequestBox {
  uint64_t magic = kRequestMagic;
  MPI_Request request = MPI_REQUEST_NULL;
  const CommBox* comm = nullptr;
  TypeFacts type;
  int count = 0, peer = 0;
  bool sends = false;
};

CommBox jax_world;  // XLA's COMM_WORLD: set once, at connection
std::atomic<int64_t> next_comm_key{1};

// A new box's key and watch slot.
void Key(CommBox* box) {
  box->key = next_comm_key.fetch_add(1);
  box->slot = kXlaSlot + static_cast<int>(box->key % kXlaSlots);
}
xla_groups::Splits splits;  // the rounds of XLA's splits where L > 1

bool Finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

const CommBox* CommOf(uintptr_t token) {
  if (token == Token("COMM_WORLD")) return jax_world.comm == MPI_COMM_NULL ? nullptr : &jax_world;
  const auto* box = reinterpret_cast<const CommBox*>(token);
  if (token == 0 || token == Token("COMM_SELF") || box->magic != kCommMagic) return nullptr;
  return box;
}

// The datatypes XLA's collectives pass (S8..U64, PRED as UINT8_T, F32, F64, C64,
// C128), MPI_BYTE for its raw copies, and the C types beside them.
bool TypeOf(uintptr_t token, TypeFacts* facts) {
  using D = ffi::DataType;
  struct Row {
    uint64_t token;
    MPI_Datatype mpi;
    D dtype;
    size_t bytes;
  };
  static const Row rows[] = {
      {Token("BYTE"), MPI_BYTE, D::U8, 1},
      {Token("CHAR"), MPI_CHAR, D::S8, 1},
      {Token("INT8_T"), MPI_INT8_T, D::S8, 1},
      {Token("UINT8_T"), MPI_UINT8_T, D::U8, 1},
      {Token("INT16_T"), MPI_INT16_T, D::S16, 2},
      {Token("UINT16_T"), MPI_UINT16_T, D::U16, 2},
      {Token("INT32_T"), MPI_INT32_T, D::S32, 4},
      {Token("UINT32_T"), MPI_UINT32_T, D::U32, 4},
      {Token("INT64_T"), MPI_INT64_T, D::S64, 8},
      {Token("UINT64_T"), MPI_UINT64_T, D::U64, 8},
      {Token("INT"), MPI_INT, D::S32, sizeof(int)},
      {Token("LONG"), MPI_LONG, D::S64, sizeof(long)},
      {Token("FLOAT"), MPI_FLOAT, D::F32, 4},
      {Token("DOUBLE"), MPI_DOUBLE, D::F64, 8},
      {Token("C_BOOL"), MPI_C_BOOL, D::PRED, sizeof(bool)},
      {Token("C_COMPLEX"), MPI_C_COMPLEX, D::C64, 8},
      {Token("C_FLOAT_COMPLEX"), MPI_C_FLOAT_COMPLEX, D::C64, 8},
      {Token("C_DOUBLE_COMPLEX"), MPI_C_DOUBLE_COMPLEX, D::C128, 16},
  };
  for (const Row& row : rows) {
    if (row.token == token) {
      *facts = {row.mpi, row.dtype, row.bytes};
      return true;
    }
  }
  return false;
}

// A reduction XLA passes: MPI's, and its name in mpicoll's descriptions.
bool OpOf(uintptr_t token, MPI_Op* op, const char** name) {
  struct Row {
    uint64_t token;
    MPI_Op op;
    const char* name;
  };
  static const Row rows[] = {
      {Token("SUM"), MPI_SUM, "sum"},    {Token("PROD"), MPI_PROD, "prod"},
      {Token("MIN"), MPI_MIN, "min"},    {Token("MAX"), MPI_MAX, "max"},
      {Token("LAND"), MPI_LAND, "land"}, {Token("LOR"), MPI_LOR, "lor"},
      {Token("BAND"), MPI_BAND, "band"}, {Token("BOR"), MPI_BOR, "bor"},
      {Token("LXOR"), MPI_LXOR, "lxor"}, {Token("BXOR"), MPI_BXOR, "bxor"},
  };
  for (const Row& row : rows) {
    if (row.token == token) {
      *op = row.op;
      *name = row.name;
      return true;
    }
  }
  return false;
}

// A rank or tag as the ABI's constants spell them (ints: PROC_NULL and ANY_TAG
// are -1, ANY_SOURCE -2).
int RankOf(int rank) {
  if (rank == static_cast<int>(Token("PROC_NULL"))) return MPI_PROC_NULL;
  if (rank == static_cast<int>(Token("ANY_SOURCE"))) return MPI_ANY_SOURCE;
  return rank;
}
int TagOf(int tag) { return tag == static_cast<int>(Token("ANY_TAG")) ? MPI_ANY_TAG : tag; }

const void* SendOf(const void* send) {
  return reinterpret_cast<uintptr_t>(send) == Token("IN_PLACE") ? MPI_IN_PLACE : send;
}

// Fills the ABI's status (STATUS_IGNORE: nothing) from MPI's.
void StatusOut(void* status, const MPI_Status& real) {
  if (reinterpret_cast<uintptr_t>(status) == Token("STATUS_IGNORE") || status == nullptr) return;
  mpiabi::Status out = {};
  out.source = real.MPI_SOURCE;
  out.tag = real.MPI_TAG;
  out.error = real.MPI_ERROR;
  std::memcpy(status, &out, sizeof(out));
}

// --- The watch -----------------------------------------------------------------------

// A communicator's collectives come one at a time (XLA runs a device's program
// in order; with several devices a group's leader alone calls MPI), so a slot
// has one call in it.  A second call at once (two members' messages of one
// all-to-all, two communicators in one slot) runs unwatched rather than share
// the slot's state, which one thread at a time writes.
std::atomic<bool> xla_slot_taken[kXlaSlots];

// What XLA's call is, for the watch: its name and buffers as mpicoll's Call.
Call XlaCall(const char* name, const CommBox& comm, const TypeFacts& type, size_t count,
             const void* in, void* out) {
  Call c{};
  c.name = name;
  c.comm = comm.comm;
  c.internal_comm = comm.internal;
  c.comm_key = comm.key;
  c.rank = comm.rank;
  c.size = comm.size;
  c.root = -1;
  c.op = -1;
  c.type = type.mpi;
  c.mpi_op = MPI_OP_NULL;
  c.elem_bytes = type.bytes;
  c.in = static_cast<char*>(const_cast<void*>(in));
  c.out = static_cast<char*>(out);
  c.in_count = count;
  c.out_count = count;
  c.dtype = type.dtype;
  return c;
}

// "all-reduce(float32[8], op=sum), inserted by XLA": what the ranks compare
// and the reports name.
std::string Described(const Call& c, const char* op_name, const std::string& more = "") {
  std::string text = std::string(c.name) + "(" + DtypeName(c.dtype) + "[" +
                     std::to_string(c.in_count) + "]";
  if (op_name) text += std::string(", op=") + op_name;
  return text + more + "), inserted by XLA";
}

// How the watch counts a call: a collective the ranks compare (check mode), one
// they do not (a split: each rank names its own group), or a message between
// two ranks (no sequence number on the communicator).
enum class Kind { kCompared, kCollective, kPointToPoint };

// Runs `run` (its MPI call) as mpicoll runs its own collectives: watched in XLA's
// slot, recorded, and checked across ranks where check mode says so (kCompared).
// Returns MPI_SUCCESS, or kWatchedFailure with failure_text set.
template <typename Run>
int Watched(Call& c, const CommBox& box, Kind kind, const std::string& description, Run&& run) {
  const int slot = box.slot;
  std::atomic<bool>& taken = xla_slot_taken[slot - kXlaSlot];
  bool free_slot = false;
  if (!taken.compare_exchange_strong(free_slot, true, std::memory_order_acquire)) return run();
  struct Release {
    std::atomic<bool>& taken;
    ~Release() { taken.store(false, std::memory_order_release); }
  } release{taken};
  SerializedMpiScope serialized;
  CheckPlan plan = PlanCheck(c, slot, [&] { return description; });
  const int mode = watch_settings.check_mode.load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(box.agreed_mutex);
    plan.check = kind == Kind::kCompared && c.size > 1 &&
                 (mode == kCheckEveryCall ||
                  (mode == kCheckFirstRun && box.agreed.count(plan.facts->hash) == 0));
  }
  InFlightScope watched(c, slot, /*new_call=*/true, /*queued_ns=*/0, plan.facts,
                        /*collective=*/kind != Kind::kPointToPoint);
  if (ffi::Error err = CheckSameCall(c, slot, plan, watched); err.failure()) {
    watched.failed = true;
    failure_text = err.message();
    return kWatchedFailure;
  }
  if (plan.check) {
    std::lock_guard<std::mutex> lock(box.agreed_mutex);
    box.agreed.insert(plan.facts->hash);
  }
  const int rc = run();
  if (rc == MPI_SUCCESS) return rc;
  watched.failed = true;
  failure_text = MpiFailureText("mpicoll: XLA's " + description + " failed on rank " +
                                    std::to_string(c.rank) + " of " +
                                    UserCommName(CommName(c.comm)),
                                c.comm, rc,
                                std::string(" (") + kRankLostMarker + ": mpicoll.RankLost)");
  return kWatchedFailure;
}

// --- Groups of several devices per process (xla_groups.h) ----------------------------

// The watch's box of a group's processes (made once, by its first use: no MPI).
CommBox* ProcessesBox(xla_groups::Group& g) {
  if (g.watched) return static_cast<CommBox*>(g.watched);
  auto* box = new CommBox;  // kept with the group
  box->comm = g.processes;
  box->internal = g.checks;
  Key(box);
  MPI_Comm_rank(g.processes, &box->rank);
  MPI_Comm_size(g.processes, &box->size);
  g.watched = box;
  return box;
}

int GroupSplit(int color, int key, uintptr_t* made) {
  xla_groups::Place place;
  std::string failure;
  // The round's gather, watched on XLA's COMM_WORLD: a process that never makes
  // its devices' communicators (it does not run the program) is named.
  auto gather = [&](auto&& run, std::string* why) {
    Call c = XlaCall("communicator split", jax_world, TypeFacts{MPI_INT, ffi::DataType::S32, 4},
                     0, nullptr, nullptr);
    const int rc = Watched(c, jax_world, Kind::kCollective, "communicator split(), made by XLA",
                           run);
    if (rc == kWatchedFailure) *why = failure_text;
    return rc;
  };
  // A round whose other local devices do not come: said once at the stall report's
  // time, and the job ended at MPICOLL_TIMEOUT, as for a wait in a collective.
  bool said = false;
  auto waiting = [&](double seconds, int arrived) {
    const double stall = watch_settings.stall_report_seconds.load();
    const double limit = watch_settings.timeout_seconds.load();
    const bool end = limit > 0 && seconds >= limit;
    if (!(end || (!said && stall > 0 && seconds >= stall))) return;
    said = true;
    std::fprintf(stderr,
                 "mpicoll: rank %d: %d of this process's %d CPU devices have waited %.1f s for "
                 "the others to make XLA's communicators for their groups: a program with "
                 "collectives on some of a process's devices only (XLA's MPI path needs every "
                 "device of every process; run it with MPICOLL_JAX_COLLECTIVES=gloo)%s\n",
                 jax_world.rank, arrived, splits.local_devices, seconds,
                 end ? "; aborting the job (MPICOLL_TIMEOUT)" : "");
    std::fflush(stderr);
    if (end) AbortJob(3);
  };
  const int rc = xla_groups::Split(jax_world.comm, splits, color, key, &place, &failure, gather,
                                   waiting);
  if (rc != MPI_SUCCESS) {
    failure_text = failure.empty() ? "mpicoll: making XLA's groups failed" : failure;
    return rc < 0 ? kWatchedFailure : rc;
  }
  if (!place.group) return kUnknownHandle;
  auto* box = new CommBox;
  box->comm = place.group->processes;
  box->place = place;
  box->rank = place.member;
  box->size = place.group->size;
  Key(box);
  box->slot = ProcessesBox(*place.group)->slot;  // its messages share the group's slot
  *made = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

// The leader's MPI call over a group's processes, watched there (`members` of
// the group's devices described), or nothing where the group is all here.
template <typename Run>
int OverProcesses(xla_groups::Group& g, const char* name, const TypeFacts& type, size_t count,
                  const char* op_name, Run&& run) {
  CommBox& processes = *ProcessesBox(g);
  if (processes.size == 1) return MPI_SUCCESS;
  Call c = XlaCall(name, processes, type, count, nullptr, nullptr);
  const std::string description =
      Described(c, op_name, ", " + std::to_string(g.size) + " devices");
  const int rc = Watched(c, processes, Kind::kCompared, description, std::forward<Run>(run));
  return rc;
}

// One call of a group's meeting (xla_groups::Meet): `lead(sends, receives)`
// runs in its leader and returns an MPI code, or kWatchedFailure with this
// thread's failure_text set; every member returns the same, its failure text
// copied to its own thread.
template <typename Lead>
int GroupMeeting(const CommBox& box, const void* send, void* receive, Lead&& lead) {
  xla_groups::Group& g = *box.place.group;
  std::string failure;
  const int rc = xla_groups::Meet(
      g, g.LocalIndex(box.place.member), send, receive, &failure,
      [&](const std::vector<const void*>& sends, const std::vector<void*>& receives,
          std::string* why) {
        const int rc = lead(sends, receives);
        if (rc == kWatchedFailure) *why = failure_text;
        return rc;
      });
  if (rc == MPI_SUCCESS) return rc;
  if (rc == kWatchedFailure || rc < 0) {
    failure_text = failure;
    return kWatchedFailure;
  }
  return rc;
}

// The local members' inputs reduced into `total` (count elements), then over
// the group's processes (what all-reduce and reduce-scatter share).
int ReduceOverGroup(xla_groups::Group& g, const std::vector<const void*>& sends, char* total,
                    int count, const TypeFacts& type, MPI_Op op, const char* name,
                    const char* op_name) {
  if (total != sends[0]) std::memmove(total, sends[0], static_cast<size_t>(count) * type.bytes);
  int rc = MPI_SUCCESS;
  for (size_t i = 1; i < sends.size() && rc == MPI_SUCCESS; ++i) {
    rc = MPI_Reduce_local(sends[i], total, count, type.mpi, op);
  }
  if (rc != MPI_SUCCESS) return rc;
  return OverProcesses(g, name, type, count, op_name, [&] {
    return MPI_Allreduce(MPI_IN_PLACE, total, count, type.mpi, op, g.processes);
  });
}

int GroupAllreduce(const CommBox& box, const void* send, void* receive, int count,
                   const TypeFacts& type, MPI_Op op, const char* op_name) {
  xla_groups::Group& g = *box.place.group;
  return GroupMeeting(box, send, receive, [&](const std::vector<const void*>& sends,
                                              const std::vector<void*>& receives) {
    char* total = static_cast<char*>(receives[0]);
    const int rc = ReduceOverGroup(g, sends, total, count, type, op, "all-reduce", op_name);
    for (size_t i = 1; i < receives.size() && rc == MPI_SUCCESS; ++i) {
      std::memcpy(receives[i], total, static_cast<size_t>(count) * type.bytes);
    }
    return rc;
  });
}

int GroupAllgather(const CommBox& box, const void* send, int count, const TypeFacts& type,
                   void* receive) {
  xla_groups::Group& g = *box.place.group;
  return GroupMeeting(box, send, receive, [&](const std::vector<const void*>& sends,
                                              const std::vector<void*>& receives) {
    const size_t block = static_cast<size_t>(count) * type.bytes;
    char* whole = static_cast<char*>(receives[0]);
    int rc = MPI_SUCCESS;
    CommBox& processes = *ProcessesBox(g);
    if (processes.size == 1) {
      for (size_t i = 0; i < sends.size(); ++i) {
        std::memcpy(whole + g.local[i] * block, sends[i], block);
      }
    } else {
      // This process's blocks in member order, every process's gathered in
      // process order, then each block put at its member's place.
      std::vector<char>& packed = g.scratch;
      packed.resize(block * (sends.size() + g.size));
      for (size_t i = 0; i < sends.size(); ++i) {
        std::memcpy(packed.data() + i * block, sends[i], block);
      }
      char* gathered = packed.data() + block * sends.size();
      std::vector<int> counts(processes.size), offsets(processes.size);
      for (int p = 0, at = 0; p < processes.size; ++p) {
        counts[p] = static_cast<int>(g.members_of[p].size() * block);
        offsets[p] = at;
        at += counts[p];
      }
      rc = OverProcesses(g, "all-gather", type, count, nullptr, [&] {
        return MPI_Allgatherv(packed.data(), counts[processes.rank], MPI_BYTE, gathered,
                              counts.data(), offsets.data(), MPI_BYTE, g.processes);
      });
      for (int p = 0; rc == MPI_SUCCESS && p < processes.size; ++p) {
        for (size_t k = 0; k < g.members_of[p].size(); ++k) {
          std::memcpy(whole + g.members_of[p][k] * block, gathered + offsets[p] + k * block,
                      block);
        }
      }
    }
    for (size_t i = 1; i < receives.size() && rc == MPI_SUCCESS; ++i) {
      std::memcpy(receives[i], whole, block * g.size);
    }
    return rc;
  });
}

// Each member's block of the sum: the whole reduced once per process (an
// all-reduce over the processes), then each member takes its own block.
int GroupReduceScatter(const CommBox& box, const void* send, void* receive, const int* counts,
                       const TypeFacts& type, MPI_Op op, const char* op_name) {
  xla_groups::Group& g = *box.place.group;
  std::vector<size_t> offsets(g.size + 1, 0);
  for (int m = 0; m < g.size; ++m) offsets[m + 1] = offsets[m] + static_cast<size_t>(counts[m]);
  const size_t total = offsets[g.size];
  if (total > static_cast<size_t>(INT32_MAX)) return kUnsupportedType;
  return GroupMeeting(box, send, receive, [&](const std::vector<const void*>& sends,
                                              const std::vector<void*>& receives) {
    std::vector<char>& sum = g.scratch;
    sum.resize(total * type.bytes);
    const int rc = ReduceOverGroup(g, sends, sum.data(), static_cast<int>(total), type, op,
                                   "reduce-scatter", op_name);
    for (size_t i = 0; i < receives.size() && rc == MPI_SUCCESS; ++i) {
      const int m = g.local[i];
      std::memcpy(receives[i], sum.data() + offsets[m] * type.bytes,
                  static_cast<size_t>(counts[m]) * type.bytes);
    }
    return rc;
  });
}

// A message between two members: (process, tag) on the group's messages
// communicator (xla_groups.h).
struct Route {
  int process;
  int tag;
};
// This member's message to `destination` and from `source` (members, or the
// ABI's PROC_NULL, which is not every MPI's); false for a member the group does
// not have.
bool RoutesOf(const CommBox& box, int destination, int source, Route* to, Route* from) {
  const xla_groups::Group& g = *box.place.group;
  const int me = box.place.member;
  auto route = [&](int peer, int sender, int receiver, Route* out) {
    if (RankOf(peer) == MPI_PROC_NULL) {
      *out = {MPI_PROC_NULL, 0};
      return true;
    }
    if (peer < 0 || peer >= g.size) return false;
    *out = {g.process_of[peer], sender * g.size + receiver};
    return true;
  };
  return route(destination, me, destination, to) && route(source, source, me, from);
}

// --- The calls (abi.h's Calls) ---------------------------------------------------------

int CommRank(uintptr_t token, int* rank) {
  if (token == Token("COMM_SELF")) return MPI_Comm_rank(MPI_COMM_SELF, rank);
  const CommBox* box = CommOf(token);
  if (!box) return kUnknownHandle;
  *rank = box->rank;
  return MPI_SUCCESS;
}

int CommSize(uintptr_t token, int* size) {
  if (token == Token("COMM_SELF")) return MPI_Comm_size(MPI_COMM_SELF, size);
  const CommBox* box = CommOf(token);
  if (!box) return kUnknownHandle;
  *size = box->size;
  return MPI_SUCCESS;
}

// Fills `box` for `comm` (its rank, size, watch key, the checks' duplicate),
// named `name` for the reports.  Collective over `comm`.
int Boxed(MPI_Comm comm, const std::string& name, CommBox* box) {
  box->comm = comm;
  Key(box);
  MPI_Comm_set_name(comm, name.c_str());
  int rc = MPI_Comm_rank(comm, &box->rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, &box->size);
  if (rc == MPI_SUCCESS && box->size > 1) rc = MPI_Comm_dup(comm, &box->internal);
  return rc;
}

// XLA's communicator for a group of devices (color: the group's first device's
// id), split from its COMM_WORLD; watched as a collective on it, so a rank that
// never reaches its first collective is named like any other.
int GroupSplit(int color, int key, uintptr_t* made);

int CommSplit(uintptr_t token, int color, int key, uintptr_t* made) {
  const CommBox* parent = CommOf(token);
  if (!parent) return kUnknownHandle;
  if (color == static_cast<int>(Token("UNDEFINED"))) color = MPI_UNDEFINED;
  if (splits.local_devices > 1) {
    if (parent != &jax_world || color == MPI_UNDEFINED) return kUnknownHandle;
    return GroupSplit(color, key, made);
  }
  Call c = XlaCall("communicator split", *parent, TypeFacts{MPI_INT, ffi::DataType::S32, 4}, 0,
                   nullptr, nullptr);
  auto* box = new CommBox;
  // Named in split order, the same on every rank (each makes XLA's communicators
  // in its program's order): two groups led by one device are told apart.
  static int splits_made = 0;
  const std::string group = "mpicoll:XLA's communicator " + std::to_string(++splits_made) +
                            " (group led by device " + std::to_string(color) + ")";
  const int rc = Watched(c, *parent, Kind::kCollective, "communicator split(), made by XLA", [&] {
    MPI_Comm split = MPI_COMM_NULL;
    int rc = MPI_Comm_split(parent->comm, color, key, &split);
    if (rc == MPI_SUCCESS && split != MPI_COMM_NULL) rc = Boxed(split, group, box);
    return rc;
  });
  if (rc != MPI_SUCCESS || box->comm == MPI_COMM_NULL) {
    delete box;
    *made = Token("COMM_NULL");
    return rc;
  }
  *made = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

// XLA's communicators are freed by a destructor that may run after MPI was
// finalized at exit: then only the box goes.
int CommFree(uintptr_t* token) {
  auto* box = reinterpret_cast<CommBox*>(*token);
  if (*token == 0 || box == &jax_world || box->magic != kCommMagic) return kUnknownHandle;
  // A device's box in a group of several devices per process shares the
  // group's communicators, kept for the process (xla_groups.h).
  if (!Finalized() && !box->place.group) {
    if (box->internal != MPI_COMM_NULL) MPI_Comm_free(&box->internal);
    MPI_Comm_free(&box->comm);
  }
  box->magic = 0;
  delete box;
  *token = Token("COMM_NULL");
  return MPI_SUCCESS;
}

// XLA asks before it makes a communicator, and refuses a thread MPI does not
// call its main one; mpicoll's MPI takes calls from any thread
// (MPI_THREAD_MULTIPLE: jax_transport.py keeps gloo otherwise), and with
// several devices each device's thread makes its own.
int IsThreadMain(int* flag) {
  *flag = 1;
  return MPI_SUCCESS;
}
int QueryThread(int* level) { return MPI_Query_thread(level); }

int Allreduce(const void* send, void* receive, int count, uintptr_t type_token,
              uintptr_t op_token, uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts type;
  MPI_Op op;
  const char* op_name = nullptr;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(type_token, &type)) return kUnsupportedType;
  if (!OpOf(op_token, &op, &op_name)) return kUnsupportedOp;
  if (comm->place.group) return GroupAllreduce(*comm, send, receive, count, type, op, op_name);
  Call c = XlaCall("all-reduce", *comm, type, count, send, receive);
  return Watched(c, *comm, Kind::kCompared, Described(c, op_name), [&] {
    return MPI_Allreduce(send == receive ? MPI_IN_PLACE : SendOf(send), receive, count,
                         type.mpi, op, comm->comm);
  });
}

int Allgather(const void* send, int send_count, uintptr_t send_token, void* receive,
              int receive_count, uintptr_t receive_token, uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts send_type, receive_type;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(send_token, &send_type) || !TypeOf(receive_token, &receive_type)) {
    return kUnsupportedType;
  }
  if (comm->place.group) return GroupAllgather(*comm, send, send_count, send_type, receive);
  Call c = XlaCall("all-gather", *comm, send_type, send_count, send, receive);
  return Watched(c, *comm, Kind::kCompared, Described(c, nullptr), [&] {
    return MPI_Allgather(SendOf(send), send_count, send_type.mpi, receive, receive_count,
                         receive_type.mpi, comm->comm);
  });
}

int ReduceScatter(const void* send, void* receive, const int* counts, uintptr_t type_token,
                  uintptr_t op_token, uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts type;
  MPI_Op op;
  const char* op_name = nullptr;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(type_token, &type)) return kUnsupportedType;
  if (!OpOf(op_token, &op, &op_name)) return kUnsupportedOp;
  if (comm->place.group) {
    return GroupReduceScatter(*comm, send, receive, counts, type, op, op_name);
  }
  size_t total = 0;
  bool equal = true;
  for (int r = 0; r < comm->size; ++r) {
    total += static_cast<size_t>(counts[r]);
    equal = equal && counts[r] == counts[0];
  }
  Call c = XlaCall("reduce-scatter", *comm, type, total, send, receive);
  std::string more;
  if (!equal) {
    more = ", counts=(";
    for (int r = 0; r < comm->size; ++r) more += (r ? "," : "") + std::to_string(counts[r]);
    more += ")";
  }
  return Watched(c, *comm, Kind::kCompared, Described(c, op_name, more), [&] {
    return MPI_Reduce_scatter(SendOf(send), receive, counts, type.mpi, op, comm->comm);
  });
}

// One pair of all-to-all's exchange (XLA sends to one rank and receives from
// another in each step): a point-to-point call for the watch.
int Sendrecv(const void* send, int send_count, uintptr_t send_token, int destination,
             int send_tag, void* receive, int receive_count, uintptr_t receive_token, int source,
             int receive_tag, uintptr_t comm_token, void* status) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts send_type, receive_type;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(send_token, &send_type) || !TypeOf(receive_token, &receive_type)) {
    return kUnsupportedType;
  }
  Route to{RankOf(destination), TagOf(send_tag)}, from{RankOf(source), TagOf(receive_tag)};
  MPI_Comm on = comm->comm;
  if (comm->place.group) {
    if (!RoutesOf(*comm, destination, source, &to, &from)) return kUnknownHandle;
    on = comm->place.group->messages;
  }
  Call c = XlaCall("sendrecv", *comm, send_type, send_count, send, receive);
  c.comm = on;
  const std::string more = ", to rank " + std::to_string(destination) + ", from rank " +
                           std::to_string(source);
  MPI_Status real;
  const int rc = Watched(c, *comm, Kind::kPointToPoint, Described(c, nullptr, more), [&] {
    return MPI_Sendrecv(send, send_count, send_type.mpi, to.process, to.tag, receive,
                        receive_count, receive_type.mpi, from.process, from.tag, on, &real);
  });
  if (rc == MPI_SUCCESS) StatusOut(status, real);
  return rc;
}

// A nonblocking call (`start`: MPI_Isend or MPI_Irecv with its buffer and
// peer bound) on the ABI's handles; its request boxed for Wait, which is
// where it is watched.
template <typename Start>
int StartRequest(uintptr_t type_token, uintptr_t comm_token, int count, int peer, bool sends,
                 uintptr_t* request, Start start) {
  auto* box = new RequestBox;
  box->comm = CommOf(comm_token);
  if (!box->comm || !TypeOf(type_token, &box->type)) {
    const int rc = box->comm ? kUnsupportedType : kUnknownHandle;
    delete box;
    return rc;
  }
  box->count = count;
  box->peer = peer;
  box->sends = sends;
  Route route{RankOf(peer), 0};
  MPI_Comm on = box->comm->comm;
  if (box->comm->place.group) {
    Route unused;
    const int none = static_cast<int>(Token("PROC_NULL"));  // the ABI's, as XLA passes it
    const bool routed = sends ? RoutesOf(*box->comm, peer, none, &route, &unused)
                              : RoutesOf(*box->comm, none, peer, &unused, &route);
    if (!routed) {
      delete box;
      return kUnknownHandle;
    }
    on = box->comm->place.group->messages;
  }
  const int rc = start(box->type.mpi, on, route, &box->request);
  if (rc != MPI_SUCCESS) {
    delete box;
    return rc;
  }
  *request = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

int Isend(const void* send, int count, uintptr_t type_token, int destination, int tag,
          uintptr_t comm_token, uintptr_t* request) {
  return StartRequest(type_token, comm_token, count, destination, true, request,
                      [&](MPI_Datatype type, MPI_Comm comm, Route route, MPI_Request* made) {
                        const bool grouped = comm != CommOf(comm_token)->comm;
                        return MPI_Isend(send, count, type, route.process,
                                         grouped ? route.tag : TagOf(tag), comm, made);
                      });
}

int Irecv(void* receive, int count, uintptr_t type_token, int source, int tag,
          uintptr_t comm_token, uintptr_t* request) {
  return StartRequest(type_token, comm_token, count, source, false, request,
                      [&](MPI_Datatype type, MPI_Comm comm, Route route, MPI_Request* made) {
                        const bool grouped = comm != CommOf(comm_token)->comm;
                        return MPI_Irecv(receive, count, type, route.process,
                                         grouped ? route.tag : TagOf(tag), comm, made);
                      });
}

// The end of one of collective-permute's messages.
int Wait(uintptr_t* request, void* status) {
  if (*request == Token("REQUEST_NULL")) return MPI_SUCCESS;
  auto* box = reinterpret_cast<RequestBox*>(*request);
  if (box->magic != kRequestMagic) return kUnknownHandle;
  Call c = XlaCall(box->sends ? "send" : "recv", *box->comm, box->type, box->count, nullptr,
                   nullptr);
  const std::string more = (box->sends ? ", to rank " : ", from rank ") + std::to_string(box->peer);
  MPI_Status real;
  const int rc = Watched(c, *box->comm, Kind::kPointToPoint, Described(c, nullptr, more), [&] {
    return MPI_Wait(&box->request, &real);
  });
  if (rc == MPI_SUCCESS) StatusOut(status, real);
  box->magic = 0;
  delete box;
  *request = Token("REQUEST_NULL");
  return rc;
}

int Barrier(uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  if (!comm) return kUnknownHandle;
  if (comm->place.group) {
    xla_groups::Group& g = *comm->place.group;
    return GroupMeeting(*comm, nullptr, nullptr,
                        [&](const std::vector<const void*>&, const std::vector<void*>&) {
      return OverProcesses(g, "barrier", TypeFacts{MPI_BYTE, ffi::DataType::U8, 1}, 0, nullptr,
                           [&] { return MPI_Barrier(g.processes); });
    });
  }
  Call c = XlaCall("barrier", *comm, TypeFacts{MPI_BYTE, ffi::DataType::U8, 1}, 0, nullptr,
                   nullptr);
  return Watched(c, *comm, Kind::kCompared, "barrier(), inserted by XLA",
                 [&] { return MPI_Barrier(comm->comm); });
}

// `text` into the trampoline's buffer of MPI_MAX_ERROR_STRING (1024) bytes,
// cut to fit; *length is what was written.
void CopyText(const std::string& text, char* out, int* length) {
  constexpr size_t kRoom = 1024;
  const size_t n = std::min(text.size(), kRoom - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
  *length = static_cast<int>(n);
}

int ErrorString(int code, char* text, int* length) {
  switch (code) {
    case kWatchedFailure:
      CopyText(failure_text, text, length);
      return MPI_SUCCESS;
    case kUnknownHandle:
      CopyText("mpicoll: a handle JAX's collectives passed is not one mpicoll's MPI ABI "
               "library made", text, length);
      return MPI_SUCCESS;
    case kUnsupportedType:
      CopyText("mpicoll: JAX's collectives passed an MPI datatype mpicoll's MPI ABI library "
               "does not map (it maps the integer, float and complex types XLA's CPU "
               "collectives use)", text, length);
      return MPI_SUCCESS;
    case kUnsupportedOp:
      CopyText("mpicoll: JAX's collectives passed a reduction mpicoll's MPI ABI library does "
               "not map", text, length);
      return MPI_SUCCESS;
  }
  char real[MPI_MAX_ERROR_STRING];
  int real_length = 0;
  if (MPI_Error_string(code, real, &real_length) != MPI_SUCCESS) {
    CopyText("MPI error " + std::to_string(code), text, length);
  } else {
    CopyText(std::string(real, real_length), text, length);
  }
  return MPI_SUCCESS;
}

double Wtime() { return MPI_Wtime(); }

[[noreturn]] void Abort(int code, const char* why) {
  std::fprintf(stderr, "%s\n", why);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

const mpiabi::Calls calls = {
    mpiabi::kCallsVersion, CommRank, CommSize, CommSplit, CommFree, IsThreadMain,
    QueryThread, Allreduce, Allgather, ReduceScatter, Sendrecv, Isend, Irecv, Wait, Barrier,
    ErrorString, Wtime, Abort,
};

// The library at `path` if this process has loaded it (the trampoline did, at
// `import jax`), and its entry point; else why not.
mpiabi::ConnectFunction LoadedLibrary(const char* path, void** library, std::string* why) {
  *library = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
  if (!*library) {
    *why = "jaxlib's MPItrampoline has not loaded it";
    return nullptr;
  }
  auto connect =
      reinterpret_cast<mpiabi::ConnectFunction>(dlsym(*library, mpiabi::kConnectSymbol));
  if (!connect) {
    dlclose(*library);
    *why = "the loaded library has no mpicoll_mpiabi_connect";
  }
  return connect;
}

// jax_mpi_library_problem(path) -> "" where the library at `path` is loaded
// and connectable, else why not (no MPI call: each rank asks for itself).
PyObject* JaxMpiLibraryProblem(PyObject*, PyObject* arg) {
  const char* path = PyUnicode_AsUTF8(arg);
  if (!path) return nullptr;
  void* library = nullptr;
  std::string why;
  if (LoadedLibrary(path, &library, &why)) dlclose(library);
  return PyUnicode_FromString(why.c_str());
}

// connect_jax_mpi(path, local_devices) -> "" or why not: hands the calls to the library at
// `path` (loaded: jax_mpi_library_problem said so on every rank), after
// duplicating COMM_WORLD for XLA (collective: every rank calls it).
PyObject* ConnectJaxMpi(PyObject*, PyObject* args) {
  const char* path = nullptr;
  int local_devices = 1;
  if (!PyArg_ParseTuple(args, "si", &path, &local_devices)) return nullptr;
  if (local_devices < 1 || local_devices > kMaxLocalDevices) {
    return PyUnicode_FromFormat("%d local CPU devices: mpicoll takes 1 to %d", local_devices,
                                kMaxLocalDevices);
  }
  void* library = nullptr;
  std::string why;
  const mpiabi::ConnectFunction connect = LoadedLibrary(path, &library, &why);
  if (!connect) return PyUnicode_FromString(why.c_str());
  int rc = MPI_SUCCESS;
  Py_BEGIN_ALLOW_THREADS
  if (jax_world.comm == MPI_COMM_NULL) {
    MPI_Comm world = MPI_COMM_NULL;
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &world);
    // (No checks' duplicate: only splits, which are not compared, run on it.)
    if (rc == MPI_SUCCESS) {
      jax_world.comm = world;
      Key(&jax_world);
      MPI_Comm_set_name(world, "mpicoll:XLA's COMM_WORLD");
      MPI_Comm_rank(world, &jax_world.rank);
      MPI_Comm_size(world, &jax_world.size);
    }
  }
  Py_END_ALLOW_THREADS
  if (rc != MPI_SUCCESS) return PyUnicode_FromString("MPI_Comm_dup of COMM_WORLD failed");
  splits.local_devices = local_devices;
  const int spoken = connect(&calls);
  dlclose(library);  // the trampoline holds it
  if (spoken != 0) {
    return PyUnicode_FromFormat("the loaded library speaks version %d of the calls, this "
                                "extension %d (rebuild mpicoll)", spoken, mpiabi::kCallsVersion);
  }
  return PyUnicode_FromString("");
}

}  // namespace

PyMethodDef jax_mpi_methods[] = {
    {"jax_mpi_library_problem", JaxMpiLibraryProblem, METH_O,
     "(path of mpicoll's MPI ABI library) -> '' where jaxlib's trampoline loaded it, else why "
     "not."},
    {"connect_jax_mpi", ConnectJaxMpi, METH_VARARGS,
     "(path of mpicoll's MPI ABI library, local CPU devices) -> '' or why JAX's CPU "
     "collectives cannot run on mpicoll's MPI; collective."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace mpicoll

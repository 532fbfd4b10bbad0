// The handles XLA's collectives pass through jaxlib's trampoline (the MPI ABI's
// encodings, abi.h), as the extension's MPI knows them: communicators boxed with
// what the watch needs, datatypes, reductions, ranks, tags and statuses; and the
// error codes of this side.  Only jax_calls.cc includes it (one translation unit).
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_set>

#include "../engine/dtypes.h"
#include "../watch/guard.h"
#include "abi.h"
#include "xla_groups.h"

namespace mpicoll {
namespace jax_mpi {

using mpiabi::Token;

// Errors of this side, explained by ErrorString (MPI's own codes pass through).
constexpr int kUnknownHandle = 0x7f000010;
constexpr int kUnsupportedType = 0x7f000011;
constexpr int kUnsupportedOp = 0x7f000012;
constexpr int kWatchedFailure = 0x7f000013;  // the calling thread's failure_text says what

// The text of this thread's last kWatchedFailure: XLA asks for it (Error_string)
// on the thread whose call failed, right after the call.
inline thread_local std::string failure_text;

constexpr uint64_t kCommMagic = 0x6d70636f6c6c436dull;     // "mpcollCm"
constexpr uint64_t kRequestMagic = 0x6d70636f6c6c5271ull;  // "mpcollRq"

// A communicator XLA made (Comm_split), or XLA's COMM_WORLD: what the watch
// needs of it besides the handle, looked up once.
struct CommBox {
  uint64_t magic = kCommMagic;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm internal = MPI_COMM_NULL;  // the checks' duplicate (watch/check.h's CheckComm)
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

inline CommBox jax_world;  // XLA's COMM_WORLD: set once, at connection
inline std::atomic<int64_t> next_comm_key{1};

// A new box's key and watch slot.
inline void Key(CommBox* box) {
  box->key = next_comm_key.fetch_add(1);
  box->slot = kXlaSlot + static_cast<int>(box->key % kXlaSlots);
}
inline xla_groups::Splits splits;  // the rounds of XLA's splits where L > 1

inline bool Finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

inline const CommBox* CommOf(uintptr_t token) {
  if (token == Token("COMM_WORLD")) return jax_world.comm == MPI_COMM_NULL ? nullptr : &jax_world;
  const auto* box = reinterpret_cast<const CommBox*>(token);
  if (token == 0 || token == Token("COMM_SELF") || box->magic != kCommMagic) return nullptr;
  return box;
}

// The datatypes XLA's collectives pass (S8..U64, PRED as UINT8_T, F32, F64, C64,
// C128), MPI_BYTE for its raw copies, and the C types beside them.
inline bool TypeOf(uintptr_t token, TypeFacts* facts) {
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
inline bool OpOf(uintptr_t token, MPI_Op* op, const char** name) {
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
inline int RankOf(int rank) {
  if (rank == static_cast<int>(Token("PROC_NULL"))) return MPI_PROC_NULL;
  if (rank == static_cast<int>(Token("ANY_SOURCE"))) return MPI_ANY_SOURCE;
  return rank;
}
inline int TagOf(int tag) { return tag == static_cast<int>(Token("ANY_TAG")) ? MPI_ANY_TAG : tag; }

inline const void* SendOf(const void* send) {
  return reinterpret_cast<uintptr_t>(send) == Token("IN_PLACE") ? MPI_IN_PLACE : send;
}

// Fills the ABI's status (STATUS_IGNORE: nothing) from MPI's.
inline void StatusOut(void* status, const MPI_Status& real) {
  if (reinterpret_cast<uintptr_t>(status) == Token("STATUS_IGNORE") || status == nullptr) return;
  mpiabi::Status out = {};
  out.source = real.MPI_SOURCE;
  out.tag = real.MPI_TAG;
  out.error = real.MPI_ERROR;
  std::memcpy(status, &out, sizeof(out));
}

}  // namespace jax_mpi
}  // namespace mpicoll

// Each collective as a type (BcastOp, ...): one row of ops.def, its facts as
// constants and its body as Run(), and what the generic code derives from the
// facts (rows per buffer, whether the input is read, where the output is zeros).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../ops.def"
#include "algorithms.h"
#include "call.h"
#include "reduce_ops.h"

namespace mpicoll {

// The fields of a row are described in ops.def.
enum Family { kBlocks, kVector, kVectorPairs, kPeer };
enum Zeros { kNever, kOffRoot, kOnRankZero, kFromProcNull };
enum Reduction { kNoReduction, kWholeReduction, kPrefixReduction };

#define MPICOLL_DEFINE_OP(Type, text, family, reduction, rooted, blocks_in, blocks_out,    \
                          in_place, root_input, zeros, body)                               \
  struct Type {                                                                           \
    static constexpr const char* kName = text;                                            \
    static constexpr Family kFamily = family;                                             \
    static constexpr bool kReduces = reduction != kNoReduction,                           \
                          kPrefix = reduction == kPrefixReduction,                        \
                          kRooted = rooted, kBlocksIn = blocks_in,                        \
                          kBlocksOut = blocks_out, kInPlace = in_place,                   \
                          kRootInput = root_input, kChunked = family == kBlocks;          \
    static constexpr Zeros kZeros = zeros;                                                \
    static int Run(const Call& c, const Chunk& k) { return body(c, k); }                  \
  };
MPICOLL_OPS(MPICOLL_DEFINE_OP)
#undef MPICOLL_DEFINE_OP

template <typename Op>
size_t RowsIn(const Call& c) { return Op::kBlocksIn ? c.size : 1; }
template <typename Op>
size_t RowsOut(const Call& c) { return Op::kBlocksOut ? c.size : 1; }
template <typename Op>
size_t BlockElements(const Call& c) { return c.in_count / RowsIn<Op>(c); }
// Whether this rank's input is read, and whether its output comes from MPI.
template <typename Op>
bool ReadsInput(const Call& c) { return !Op::kRootInput || c.rank == c.root; }

// MPI works on one buffer that the root fills (bcast: in place, only the
// root's input read): a strategy whose output is not the input copies the
// root's input there first.
template <typename Op>
constexpr bool kRootFillsOneBuffer = Op::kInPlace && Op::kRootInput;

// Every rank receives the reduction of every rank's whole input (allreduce):
// a check whose records carry each rank's input is then the collective itself
// (execute.h, ChecksWithData).
template <typename Op>
constexpr bool kEveryRankGetsTheReduction = Op::kReduces && !Op::kPrefix && !Op::kRooted &&
                                            !Op::kBlocksIn && !Op::kBlocksOut;
template <typename Op>
bool OutputIsZeros(const Call& c) {
  switch (Op::kZeros) {
    case kOffRoot: return c.rank != c.root;
    case kOnRankZero: return c.rank == 0;
    case kFromProcNull: return Peers(c).source == MPI_PROC_NULL;
    default: return false;
  }
}

// MPI applies no operator when a communicator has one rank, so logical ops on
// integers would return the input unchanged; give 0/1 as with several ranks.
// A prefix reduction does the same on the rank whose result is a single rank's
// input (scan: rank 0, exscan: rank 1), so its results are always normalized.
// Runs on host bytes (XLA's CPU buffers or the GPU staging buffers).
template <typename Word>
void ToTruth(char* data, size_t count) {
  Word* words = reinterpret_cast<Word*>(data);
  for (size_t i = 0; i < count; ++i) words[i] = words[i] != 0;
}

// A logical reduction's result as MPI leaves it is not 0/1 where a rank's
// result is its own input: on one rank, or on rank 0 of a prefix reduction.
template <typename Op>
bool NeedsTruthValues(const Call& c) {
  return (c.size == 1 || Op::kPrefix) && (c.op == kLand || c.op == kLor || c.op == kLxor);
}

template <typename Op>
void NormalizeLogical(const Call& c, const Chunk& k) {
  if (!NeedsTruthValues<Op>(c)) return;
  char* data = c.out + k.at(c);
  switch (c.elem_bytes) {
    case 1: ToTruth<uint8_t>(data, k.count); break;
    case 2: ToTruth<uint16_t>(data, k.count); break;
    case 4: ToTruth<uint32_t>(data, k.count); break;
    case 8: ToTruth<uint64_t>(data, k.count); break;
  }
}

}  // namespace mpicoll

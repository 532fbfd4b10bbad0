// XLA FFI handlers that run MPI collectives directly on XLA's buffers.
//
// Every data collective has the same FFI signature, (token, x) -> (token, out)
// plus the attributes comm/root/op, so one binding serves them all.  Each
// collective is a row of facts and a short chunk body (MPICOLL_OPS); one loop
// (RunCollective) runs any of them over any memory strategy: XLA's host
// buffers on CPU, and on GPUs either device pointers handed to a CUDA-aware
// MPI or pinned host staging with a copy pipeline (cuda_memory.h, compiled
// with MPICOLL_CUDA).  Errors travel one path: a failed MPI call becomes an
// ffi::Error naming the op, the MPI error string, the rank and the
// communicator, raised in Python as a runtime error.
//
// Counts above INT_MAX elements are handled by chunking: each MPI call moves
// one element range of every rank block, with a datatype whose extent is the
// whole block where a buffer has several blocks.  The GPU pipeline uses the
// same chunks.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#if defined(OMPI_MAJOR_VERSION) && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <unordered_set>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "progress.h"

#ifdef MPICOLL_CUDA  // GPU support (cuda_memory.h); the CUDA driver is loaded at run time
#include <cuda.h>
#include <dlfcn.h>
#endif

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------
// Communicator table.  Python registers each communicator once (per local
// device) and the compiled program refers to it by a key, so the hot path is
// an array index, not a handle conversion.  key = generation * kMaxComms +
// slot: a slot is reused after its communicator is freed, but with a new
// generation, so a program compiled for the freed communicator finds a
// mismatch and fails instead of running on another communicator.  Rows are
// allocated at registration and never moved or freed.
constexpr int kMaxComms = 1024;
constexpr int kMaxLocalDevices = 256;
// Rank and size are looked up once, at registration, not on every call.
struct DeviceComm {
  MPI_Comm comm = MPI_COMM_NULL;
  // A duplicate for mpicoll's own algorithms built of point-to-point messages
  // (PairwiseReduceScatter): its own context, so their messages never match a
  // user's send/recv on `comm`, even one with MPI_ANY_TAG.
  MPI_Comm internal = MPI_COMM_NULL;
  int rank = -1;
  int size = 0;
};
struct CommRow {
  std::atomic<int64_t> key{-1};
  DeviceComm devices[kMaxLocalDevices];
};
std::atomic<CommRow*> comm_table[kMaxComms];

const DeviceComm* LookupComm(int64_t key, int32_t device) {
  if (key < 0 || device < 0 || device >= kMaxLocalDevices) return nullptr;
  CommRow* row = comm_table[key % kMaxComms].load(std::memory_order_acquire);
  if (!row || row->key.load(std::memory_order_acquire) != key) return nullptr;
  const DeviceComm* entry = &row->devices[device];
  return entry->comm == MPI_COMM_NULL ? nullptr : entry;
}

// mpi4py's `Comm.handle` is the MPI_Comm value as an integer: an int in
// MPICH, a pointer in Open MPI.
template <typename Handle>
Handle HandleFromInteger(unsigned long long value) {
  if constexpr (std::is_pointer_v<Handle>) {
    return reinterpret_cast<Handle>(static_cast<uintptr_t>(value));
  } else {
    return static_cast<Handle>(value);
  }
}

// ---------------------------------------------------------------------------
// Reduction operators.  The codes match mpicoll/_mpi_types.py (OP_CODES).
enum OpCode : int64_t {
  kSum = 0, kProd, kMin, kMax, kLand, kLor, kLxor, kBand, kBor, kBxor, kNumOps
};
MPI_Op builtin_ops[kNumOps];

// MPI has no 16-bit float types: float16/bfloat16 are moved as 16-bit
// integers and reduced with native user-defined operators (one per op and
// type, so the operator knows how to decode its bits).
enum HalfKind { kF16 = 0, kBF16 = 1 };
MPI_Op half_ops[2][4];  // [HalfKind][sum, prod, min, max]

float BF16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet and NaN.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {  // inf / NaN
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {  // normal
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {  // zero
    bits = sign;
  } else {  // subnormal: value = mant * 2^-24
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;     // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;    // overflow -> inf
  if (abs < 0x38800000u) {                          // f16 subnormal or zero
    if (abs < 0x33000000u) return sign;             // rounds to zero
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;                       // 14..24
    uint32_t half = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((abs >> 13) - (112u << 10));
  uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

template <HalfKind kind>
float HalfToFloat(uint16_t h) { return kind == kF16 ? F16ToFloat(h) : BF16ToFloat(h); }
template <HalfKind kind>
uint16_t FloatToHalf(float f) { return kind == kF16 ? FloatToF16(f) : FloatToBF16(f); }

struct SumFn { float operator()(float a, float b) const { return a + b; } };
struct ProdFn { float operator()(float a, float b) const { return a * b; } };
// min/max propagate NaN, like jnp.minimum/maximum.
struct MinFn { float operator()(float a, float b) const { return (a != a || a < b) ? a : b; } };
struct MaxFn { float operator()(float a, float b) const { return (a != a || a > b) ? a : b; } };

template <HalfKind kind, typename Fn>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  Fn fn;
  for (int i = 0; i < *len; ++i) {
    b[i] = FloatToHalf<kind>(fn(HalfToFloat<kind>(a[i]), HalfToFloat<kind>(b[i])));
  }
}

template <HalfKind kind>
int CreateHalfOps() {
  MPI_User_function* fns[4] = {HalfReduce<kind, SumFn>, HalfReduce<kind, ProdFn>,
                               HalfReduce<kind, MinFn>, HalfReduce<kind, MaxFn>};
  for (int i = 0; i < 4; ++i) {
    int rc = MPI_Op_create(fns[i], /*commute=*/1, &half_ops[kind][i]);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

// ---------------------------------------------------------------------------
// Integer sums wrap around (two's complement), as in numpy and XLA.  Not every
// MPI agrees: Open MPI's op/avx component adds 8- and 16-bit integers with
// saturating vector instructions once a call has 64 elements or more
// (open-mpi/ompi#8045, closed as "wontfix"), so 200 + 200 in uint8 gives 255.
// Initialize() probes MPI_SUM on each of these types with MPI_Reduce_local and
// swaps in a wrapping user-defined operator only where the builtin saturates.
enum NarrowInt { kS8 = 0, kU8, kS16, kU16, kNumNarrowInts };
MPI_Op wrapping_sums[kNumNarrowInts] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
const char* const kNarrowIntNames[kNumNarrowInts] = {"int8", "uint8", "int16", "uint16"};

template <typename T>
void WrappingSum(void* in, void* inout, int* len, MPI_Datatype*) {
  using Unsigned = std::make_unsigned_t<T>;  // unsigned arithmetic wraps by definition
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    b[i] = static_cast<T>(static_cast<Unsigned>(static_cast<Unsigned>(a[i]) +
                                                static_cast<Unsigned>(b[i])));
  }
}

// Leaves `*replacement` MPI_OP_NULL when MPI_SUM already wraps for this type.
template <typename T>
int ProbeIntegerSum(MPI_Datatype type, MPI_Op* replacement) {
  constexpr int kCount = 1024;  // longer than any vector path's minimum
  using Unsigned = std::make_unsigned_t<T>;
  const T big = std::numeric_limits<T>::max();
  const T wrapped = static_cast<T>(static_cast<Unsigned>(static_cast<Unsigned>(big) +
                                                         static_cast<Unsigned>(big)));
  std::vector<T> a(kCount, big), b(kCount, big);
  int rc = MPI_Reduce_local(a.data(), b.data(), kCount, type, MPI_SUM);
  if (rc != MPI_SUCCESS) return rc;
  *replacement = MPI_OP_NULL;
  if (std::all_of(b.begin(), b.end(), [&](T v) { return v == wrapped; })) return MPI_SUCCESS;
  return MPI_Op_create(WrappingSum<T>, /*commute=*/1, replacement);
}

int ProbeIntegerSums() {
  int rc = ProbeIntegerSum<int8_t>(MPI_INT8_T, &wrapping_sums[kS8]);
  if (rc == MPI_SUCCESS) rc = ProbeIntegerSum<uint8_t>(MPI_UINT8_T, &wrapping_sums[kU8]);
  if (rc == MPI_SUCCESS) rc = ProbeIntegerSum<int16_t>(MPI_INT16_T, &wrapping_sums[kS16]);
  if (rc == MPI_SUCCESS) rc = ProbeIntegerSum<uint16_t>(MPI_UINT16_T, &wrapping_sums[kU16]);
  return rc;
}

int NarrowIntIndex(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S8: return kS8;
    case ffi::DataType::U8: return kU8;
    case ffi::DataType::S16: return kS16;
    case ffi::DataType::U16: return kU16;
    default: return -1;
  }
}

// ---------------------------------------------------------------------------
// XLA element type -> MPI datatype (for moving data and for builtin ops).
MPI_Datatype MpiType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return MPI_UINT8_T;  // 0/1 bytes
    case ffi::DataType::S8: return MPI_INT8_T;
    case ffi::DataType::S16: return MPI_INT16_T;
    case ffi::DataType::S32: return MPI_INT32_T;
    case ffi::DataType::S64: return MPI_INT64_T;
    case ffi::DataType::U8: return MPI_UINT8_T;
    case ffi::DataType::U16: return MPI_UINT16_T;
    case ffi::DataType::U32: return MPI_UINT32_T;
    case ffi::DataType::U64: return MPI_UINT64_T;
    case ffi::DataType::F16: return MPI_UINT16_T;
    case ffi::DataType::BF16: return MPI_UINT16_T;
    case ffi::DataType::F32: return MPI_FLOAT;
    case ffi::DataType::F64: return MPI_DOUBLE;
    case ffi::DataType::C64: return MPI_C_FLOAT_COMPLEX;
    case ffi::DataType::C128: return MPI_C_DOUBLE_COMPLEX;
    default: return MPI_DATATYPE_NULL;
  }
}

MPI_Op ReductionOp(ffi::DataType t, int64_t op) {
  if (op < 0 || op >= kNumOps) return MPI_OP_NULL;
  if (t == ffi::DataType::F16 || t == ffi::DataType::BF16) {
    if (op > kMax) return MPI_OP_NULL;
    return half_ops[t == ffi::DataType::F16 ? kF16 : kBF16][op];
  }
  if (op == kSum) {
    int narrow = NarrowIntIndex(t);
    if (narrow >= 0 && wrapping_sums[narrow] != MPI_OP_NULL) return wrapping_sums[narrow];
  }
  return builtin_ops[op];
}

// ---------------------------------------------------------------------------
// One decoded call: what every collective body needs.  `in`/`out` are the
// buffers MPI reads and writes: XLA's own on CPU (and with CUDA-aware MPI),
// pinned host staging buffers when GPU data is staged (see the memory
// strategies below).
struct Call {
  const char* name;
  MPI_Comm comm;
  MPI_Comm internal_comm;  // see DeviceComm::internal
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
  // in/out are device pointers (CUDA-aware MPI): no host code may touch them.
  bool device_buffers;
};

bool InPlace(const Call& c) { return c.in == c.out; }

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

// ---------------------------------------------------------------------------
// The collectives, one MPI call per chunk.  Zeroing the output off root
// (reduce, gather) and bcast's copy of its input are done by the memory
// strategy, which knows where the buffers live.

int BcastChunk(const Call& c, const Chunk& k) {
  return MPI_Bcast(c.out + k.at(c), k.count, c.type, c.root, c.comm);
}

int AllreduceChunk(const Call& c, const Chunk& k) {
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Allreduce(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.comm);
}

int ReduceChunk(const Call& c, const Chunk& k) {
  const void* send = (InPlace(c) && c.rank == c.root) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Reduce(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.root, c.comm);
}

int GatherChunk(const Call& c, const Chunk& k) {
  RankBlocks out(c, k);
  if (out.rc != MPI_SUCCESS) return out.rc;
  return MPI_Gather(c.in + k.at(c), k.count, c.type, c.out + k.at(c), out.count, out.type,
                    c.root, c.comm);
}

int AllgatherChunk(const Call& c, const Chunk& k) {
  RankBlocks out(c, k);
  if (out.rc != MPI_SUCCESS) return out.rc;
  return MPI_Allgather(c.in + k.at(c), k.count, c.type, c.out + k.at(c), out.count, out.type,
                       c.comm);
}

int ScatterChunk(const Call& c, const Chunk& k) {
  RankBlocks in(c, k);
  if (in.rc != MPI_SUCCESS) return in.rc;
  return MPI_Scatter(c.in + k.at(c), in.count, in.type, c.out + k.at(c), k.count, c.type, c.root,
                     c.comm);
}

int AlltoallChunk(const Call& c, const Chunk& k) {
  RankBlocks blocks(c, k);
  if (blocks.rc != MPI_SUCCESS) return blocks.rc;
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Alltoall(send, blocks.count, blocks.type, c.out + k.at(c), blocks.count, blocks.type,
                      c.comm);
}

// reduce_scatter: rank r gets the reduction of every rank's block r.  Large
// blocks go to mpicoll's own pairwise exchange (below).  A chunk
// that is not the whole block cannot be one MPI_Reduce_scatter_block (one
// datatype serves both buffers, and only the input's blocks are strided), so it
// is reduced rank block by rank block to that rank.
int PairwiseReduceScatter(const Call& c, const Chunk& k);
bool UsesPairwiseReduceScatter(const Call& c, const Chunk& k);

int ReduceScatterChunk(const Call& c, const Chunk& k) {
  if (UsesPairwiseReduceScatter(c, k)) return PairwiseReduceScatter(c, k);
  if (static_cast<size_t>(k.count) == k.block) {
    return MPI_Reduce_scatter_block(c.in, c.out, k.count, c.type, c.mpi_op, c.comm);
  }
  for (int r = 0; r < c.size; ++r) {
    int rc = MPI_Reduce(c.in + (r * k.block + k.offset) * c.elem_bytes, c.out + k.at(c), k.count,
                        c.type, c.mpi_op, r, c.comm);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

// mpicoll's own reduce-scatter for large blocks.  Open MPI 4.1's
// MPI_Reduce_scatter_block reduces the whole buffer to one rank and scatters
// it (64 MiB at 2 ranks: 55-57 ms, against 29-38 ms for a whole in-place
// MPI_Allreduce), so an allreduce written as reduce_scatter + allgather cost
// 2.3x the allreduce.  A pairwise exchange moves the (size - 1)/size of the
// data a reduce-scatter must move, and each rank reduces only its own block:
// in step s = 1 .. size-1, rank r sends its block r+s to rank r+s and receives
// rank r-s's block r, which it reduces into its output with MPI_Reduce_local
// (MPI's own operators, so every op and dtype MPI_Reduce_scatter_block takes,
// the 16-bit and wrapping ones included).  The first step receives straight
// into the output; later ones go through a scratch segment.  Blocks are cut into
// segments so that the received segment is still in cache when it is reduced,
// and the scratch stays small.  All ops are commutative, so the order of the
// operands (which differs between the ranks' blocks) is free.  The messages go
// on the communicator's internal duplicate, never on the user's.
// From 256 KiB blocks: at 2 ranks (Open MPI 4.1, shared memory) the exchange
// took 0.6x MPI_Reduce_scatter_block's time there, 0.2x at 1-32 MiB, and the
// same at 1-16 KiB, where both are dominated by the call; each message is then
// large enough that the size - 1 steps' latencies matter little on any network.
// The segment size made no measurable difference from 256 KiB to whole blocks.
// Both sizes are settable (pairwise_reduce_scatter()) for tests and for
// measuring; every rank must use the same (each decides alone).
std::atomic<size_t> pairwise_min_block_bytes{size_t{256} << 10};
std::atomic<size_t> pairwise_segment_bytes{size_t{1} << 20};
constexpr int kPairwiseTag = 0;

bool UsesPairwiseReduceScatter(const Call& c, const Chunk& k) {
  return c.size > 1 && !c.device_buffers && c.internal_comm != MPI_COMM_NULL &&
         static_cast<size_t>(k.count) * c.elem_bytes >=
             pairwise_min_block_bytes.load(std::memory_order_relaxed);
}

int PairwiseReduceScatter(const Call& c, const Chunk& k) {
  const size_t bytes = c.elem_bytes;
  const size_t segment =
      std::max<size_t>(1, pairwise_segment_bytes.load(std::memory_order_relaxed) / bytes);
  const size_t total = static_cast<size_t>(k.count);
  thread_local std::vector<char> scratch;
  if (c.size > 2) scratch.resize(std::min(segment, total) * bytes);
  // Element `at` of chunk k in rank block r of the input.
  auto input = [&](int r, size_t at) { return c.in + (r * k.block + k.offset + at) * bytes; };
  for (size_t at = 0; at < total; at += segment) {
    const int n = static_cast<int>(std::min(segment, total - at));
    char* const out = c.out + (k.offset + at) * bytes;
    for (int step = 1; step < c.size; ++step) {
      const int dest = (c.rank + step) % c.size;
      const int source = (c.rank - step + c.size) % c.size;
      char* const received = step == 1 ? out : scratch.data();
      int rc = MPI_Sendrecv(input(dest, at), n, c.type, dest, kPairwiseTag, received, n, c.type,
                            source, kPairwiseTag, c.internal_comm, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return rc;
      // inout = in op inout: the first step folds in this rank's own block.
      rc = MPI_Reduce_local(step == 1 ? input(c.rank, at) : received, out, n, c.type, c.mpi_op);
      if (rc != MPI_SUCCESS) return rc;
    }
  }
  return MPI_SUCCESS;
}

int ScanChunk(const Call& c, const Chunk& k) {
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Scan(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.comm);
}

// MPI leaves rank 0's result undefined; the memory strategy zeroes it.
int ExscanChunk(const Call& c, const Chunk& k) {
  const void* send = InPlace(c) ? MPI_IN_PLACE : c.in + k.at(c);
  return MPI_Exscan(send, c.out + k.at(c), k.count, c.type, c.mpi_op, c.comm);
}

int Barrier(const Call& c) { return MPI_Barrier(c.comm); }

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

struct ScanOp;
struct ExscanOp;

template <typename Op>
bool NeedsTruthValues(const Call& c) {
  constexpr bool kPrefix = std::is_same_v<Op, ScanOp> || std::is_same_v<Op, ExscanOp>;
  return (c.size == 1 || kPrefix) && (c.op == kLand || c.op == kLor || c.op == kLxor);
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

// ---------------------------------------------------------------------------
// The one error path.
ffi::Error MpiFailure(const Call& c, int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  char comm_name[MPI_MAX_OBJECT_NAME];
  int name_len = 0;
  if (MPI_Comm_get_name(c.comm, comm_name, &name_len) != MPI_SUCCESS || name_len == 0) {
    std::strcpy(comm_name, "<unnamed>");
  }
  return ffi::Error::Internal(std::string("mpicoll.") + c.name + " failed on rank " +
                              std::to_string(c.rank) + " of communicator " + comm_name + ": " +
                              std::string(text, len));
}

ffi::Error Resolve(Call& c, int32_t device, int64_t comm_slot) {
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
  c.rank = entry->rank;
  c.size = entry->size;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Checks: the ranks compare a fingerprint of what they are about to call (op,
// dtype, shape, root, reduction) on the call's communicator.  On a mismatch
// every rank gets an error listing what each rank called, instead of a hang,
// an MPI abort or garbage.  It costs one small allreduce, so by default
// (kCheckFirstRun) each call site of a compiled program is checked the first
// time it runs on each device, and never again; kCheckEveryCall checks every
// call (MPICOLL_CHECK=1).
enum CheckMode : int { kCheckOff = 0, kCheckFirstRun = 1, kCheckEveryCall = 2 };
std::atomic<int> check_mode{kCheckFirstRun};

// Call sites already checked, per local device (each device runs its own copy
// of a program, on its own communicator).  Sites are numbered by Python when
// it lowers a call; 0 is a call with no site (always checked in first-run mode).
struct CheckedSites {
  std::mutex mutex;
  std::unordered_set<int64_t> sites;
};
CheckedSites checked_sites[kMaxLocalDevices];

bool NeedsCheck(const Call& c, int32_t device) {
  const int mode = check_mode.load(std::memory_order_relaxed);
  if (mode != kCheckFirstRun) return mode == kCheckEveryCall;
  if (c.size == 1) return false;  // nobody to disagree with
  if (c.site == 0) return true;
  CheckedSites& checked = checked_sites[device];
  std::lock_guard<std::mutex> lock(checked.mutex);
  return checked.sites.count(c.site) == 0;
}

// Only once the ranks agreed: a failed check fails on every rank, so every
// rank checks that site again next time.
void MarkChecked(const Call& c, int32_t device) {
  if (check_mode.load(std::memory_order_relaxed) != kCheckFirstRun || c.site == 0) return;
  CheckedSites& checked = checked_sites[device];
  std::lock_guard<std::mutex> lock(checked.mutex);
  checked.sites.insert(c.site);
}

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "?";
  }
}

const char* const kOpNames[kNumOps] = {"sum", "prod", "min", "max", "land",
                                       "lor", "lxor", "band", "bor", "bxor"};

std::string CommName(MPI_Comm comm) {
  char name[MPI_MAX_OBJECT_NAME];
  int len = 0;
  if (MPI_Comm_get_name(comm, name, &len) != MPI_SUCCESS || len == 0) return "<unnamed>";
  return std::string(name, len);
}

constexpr int kDescriptionBytes = 256;
// Every mismatch message starts with this (Python looks for it, and users may).
constexpr const char* kMismatchPrefix = "mpicoll: ranks called different collectives";

// Compares `description` across the ranks of `comm`: "" if every rank has
// the same one, else a message listing every rank's.  Python uses it too, for
// a call that one rank rejects while another may be running it.
std::atomic<int64_t> comparisons_made{0};  // by this process (tests and benchmarks read it)

std::string CompareAcrossRanks(MPI_Comm comm, int rank, int size, const std::string& description) {
  comparisons_made.fetch_add(1, std::memory_order_relaxed);
  uint64_t hash = 1469598103934665603ull;  // FNV-1a
  for (unsigned char ch : description) hash = (hash ^ ch) * 1099511628211ull;
  long long value = static_cast<long long>(hash >> 2);  // keep -value representable
  long long extremes[2] = {value, -value};
  int rc = MPI_Allreduce(MPI_IN_PLACE, extremes, 2, MPI_LONG_LONG, MPI_MIN, comm);
  if (rc != MPI_SUCCESS) return "mpicoll: the check across ranks failed (MPI_Allreduce)";
  if (extremes[0] == -extremes[1]) return "";
  std::string all(static_cast<size_t>(kDescriptionBytes) * size, '\0');
  char mine[kDescriptionBytes] = {};
  std::strncpy(mine, description.c_str(), kDescriptionBytes - 1);
  rc = MPI_Allgather(mine, kDescriptionBytes, MPI_CHAR, all.data(), kDescriptionBytes, MPI_CHAR,
                     comm);
  std::string message = std::string(kMismatchPrefix) + " on " + CommName(comm) +
                        " (this is rank " + std::to_string(rank) + "):";
  for (int r = 0; rc == MPI_SUCCESS && r < size; ++r) {
    message += "\n  rank " + std::to_string(r) + ": " + (all.data() + r * kDescriptionBytes);
  }
  return message;
}

// The check before a call (see CheckMode).  Internal, like every error a
// running collective returns, so that JAX raises one type (JaxRuntimeError)
// whichever path dispatched the program.
ffi::Error CheckSameCall(const Call& c, int32_t device, const std::string& description) {
  if (!NeedsCheck(c, device)) return ffi::Error::Success();
  std::string mismatch = CompareAcrossRanks(c.comm, c.rank, c.size, description);
  if (!mismatch.empty()) return ffi::Error::Internal(mismatch);
  MarkChecked(c, device);
  return ffi::Error::Success();
}

std::string Describe(const Call& c, ffi::DataType dtype, ffi::Span<const int64_t> dims,
                     bool reduces, bool rooted) {
  std::string text = std::string(c.name) + "(" + DtypeName(dtype) + "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? "," : "") + std::to_string(dims[i]);
  text += "]";
  if (reduces && c.op >= 0 && c.op < kNumOps) text += std::string(", op=") + kOpNames[c.op];
  if (rooted) text += ", root=" + std::to_string(c.root);
  return text + ")";
}

// ---------------------------------------------------------------------------
// Timeout: each device records the collective it is in; a watchdog thread
// aborts the job when one has waited longer than the timeout, saying what it
// waited on.  A hung collective then costs the timeout, not the allocation.
struct InFlight {
  std::atomic<int64_t> started_ns{0};
  std::atomic<const char*> name{nullptr};
  std::atomic<int> rank{-1};
  MPI_Comm comm = MPI_COMM_NULL;
};
// One slot per local device, plus one for the communicator setup Python does
// collectively at a communicator's first use (MPI_Comm_dup per device): a rank
// that never reaches it would otherwise hang the others outside any collective.
constexpr int kSetupSlot = kMaxLocalDevices;
InFlight in_flight[kMaxLocalDevices + 1];
std::string setup_description;  // what kSetupSlot waits on (set from Python, under the GIL)
std::atomic<double> timeout_seconds{0.0};
std::atomic<bool> watchdog_started{false};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Ends the whole job after a report was written to stderr.  The launcher
// forwards a rank's output through a pipe, and on MPI_Abort it may tear the
// job down before reading what is still in it (seen with MPICH's hydra: the
// report, and even MPI_Abort's own line, lost in about one run in ten).  A
// short pause first lets it drain the pipe; the job is ending anyway.
[[noreturn]] void AbortJob(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort returned (it should not)
}

void Watchdog() {
  for (;;) {
    double limit = timeout_seconds.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(limit > 0 && limit < 2 ? 20 : 200));
    if (limit <= 0) continue;
    int64_t now = NowNs();
    for (int d = 0; d <= kSetupSlot; ++d) {
      int64_t started = in_flight[d].started_ns.load();
      if (started == 0 || (now - started) * 1e-9 < limit) continue;
      int world_rank = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
      if (d == kSetupSlot) {
        std::fprintf(stderr,
                     "mpicoll: rank %d has waited %.1f s in %s (MPICOLL_TIMEOUT=%g): this is "
                     "collective, so another rank has not reached its first collective on that "
                     "communicator; aborting the job\n",
                     world_rank, (now - started) * 1e-9, in_flight[d].name.load(), limit);
      } else {
        std::fprintf(stderr,
                     "mpicoll: rank %d (rank %d of %s, local device %d) has waited %.1f s in %s "
                     "(MPICOLL_TIMEOUT=%g); aborting the job\n",
                     world_rank, in_flight[d].rank.load(), CommName(in_flight[d].comm).c_str(),
                     d, (now - started) * 1e-9, in_flight[d].name.load(), limit);
      }
      AbortJob(3);
    }
  }
}

// Marks a device as inside a collective for the watchdog, for one scope.
struct InFlightScope {
  InFlight* slot = nullptr;
  InFlightScope(const Call& c, int32_t device) {
    if (timeout_seconds.load(std::memory_order_relaxed) <= 0) return;
    slot = &in_flight[device];
    slot->name.store(c.name);
    slot->rank.store(c.rank);
    slot->comm = c.comm;
    slot->started_ns.store(NowNs());
  }
  ~InFlightScope() {
    if (slot) slot->started_ns.store(0);
  }
};

// ---------------------------------------------------------------------------
// Serialized MPI (one local device per process; _native.SERIALIZED): at
// MPI_THREAD_SERIALIZED, MPI allows calls from several threads (XLA's,
// Python's) but never two at once, and skips the locking MPI_THREAD_MULTIPLE
// costs every call.  mpicoll's own MPI calls take this one lock while the
// mode is on; Python makes each dispatch of a program with collectives
// complete before it returns, so the user's mpi4py calls never overlap them.
// Any other thread of mpicoll's that calls MPI (a progress thread) must hold
// it too.  Off (MULTIPLE): no lock, MPI does its own.
std::mutex serialized_mpi_mutex;
std::atomic<bool> serialize_mpi_calls{false};

// Holds serialized_mpi_mutex for one scope when the mode is on.
class SerializedMpiScope {
 public:
  SerializedMpiScope() {
    if (serialize_mpi_calls.load(std::memory_order_relaxed)) {
      lock_ = std::unique_lock<std::mutex>(serialized_mpi_mutex);
    }
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

// Overlap (progress.h): overlapped calls run on one progress thread per local
// device, in the order their handlers were invoked; synchronous calls drain it
// first.
// Never destroyed: a progress thread may still wait on its queue's condition
// variable when static destructors run at exit, and destroying it under the
// thread hangs the exit.
mpicoll_progress::ProgressThread* const progress_threads =
    new mpicoll_progress::ProgressThread[kMaxLocalDevices];

// Before an overlapped collective moves data, its progress thread waits until
// every rank of the communicator has reached it, testing an MPI_Ibarrier and
// sleeping in between.  MPI's blocking calls spin while they wait for a late
// rank, and that spinning would take a core from the computation that runs
// meanwhile on this rank (on a machine with no spare core, the case where
// overlap matters most).  Once everyone is there the collective itself runs
// at full speed.  Costs one barrier per overlapped call, and up to one sleep
// (kArrivalSleepUs) of latency after the last rank arrives.
constexpr int64_t kArrivalSpinNs = 20000;
constexpr int kArrivalSleepUs = 50;

int WaitForArrivals(const Call& c) {
  if (c.size == 1) return MPI_SUCCESS;
  MPI_Request request;
  int rc = MPI_Ibarrier(c.comm, &request);
  const int64_t spin_until = NowNs() + kArrivalSpinNs;
  for (int done = 0; rc == MPI_SUCCESS && !done;) {
    rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (rc == MPI_SUCCESS && !done && NowNs() > spin_until) {
      std::this_thread::sleep_for(std::chrono::microseconds(kArrivalSleepUs));
    }
  }
  return rc;
}

// What Execute runs between the check and the collective (overlapped calls:
// WaitForArrivals).
struct NothingBeforeRun {
  int operator()(const Call&) const { return MPI_SUCCESS; }
};

// A large output is often memory XLA has just allocated (glibc maps buffers
// this big afresh and unmaps them when freed), so MPI's first write to it
// takes a page fault per 4 KiB page: ~100 ms for 128 MiB here, more than the
// transfer.  Where transparent huge pages are "madvise" (the common default),
// asking for them cuts that to one fault per 2 MiB (a 64 MiB gather went from
// 190 ms to ~30 ms in the benchmark).  Advice only: the memory stays XLA's,
// and nothing changes where THP are off or always on.
void AdviseHugePages(char* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr size_t kHugePage = size_t{2} << 20;
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  if (bytes < 2 * kHugePage) return;
  uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// ---------------------------------------------------------------------------
// Beyond equal rank blocks: variable-size collectives (counts per rank) and
// point-to-point.  Each makes one MPI call for the whole buffers (no chunks),
// with what Python passes in `args`:
//   vector ops      [row elements, counts per rank (in rows)...]; alltoallv:
//                   [row elements, send counts..., recv counts...]
//   point-to-point  [source, dest, send tag, recv tag]
constexpr int kCheckFailed = -2;  // a body's own check failed; c.failure says why

// `count` elements as one MPI call's (type, count): the element type up to
// INT_MAX elements, above that one element of a struct type (2^30-element
// blocks and the rest).
struct Message {
  MPI_Datatype type;
  int count;
  int rc = MPI_SUCCESS;
  MPI_Datatype parts_[2] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};
  Message(const Call& c, size_t elements) : type(c.type), count(static_cast<int>(elements)) {
    if (elements <= static_cast<size_t>(INT_MAX)) return;
    const size_t blocks = elements / kMaxChunk, rest = elements % kMaxChunk;
    rc = MPI_Type_contiguous(static_cast<int>(kMaxChunk), c.type, &parts_[0]);
    int lengths[2] = {static_cast<int>(blocks), static_cast<int>(rest)};
    MPI_Aint displacements[2] = {0, static_cast<MPI_Aint>(blocks * kMaxChunk * c.elem_bytes)};
    MPI_Datatype types[2] = {parts_[0], c.type};
    if (rc == MPI_SUCCESS) rc = MPI_Type_create_struct(2, lengths, displacements, types, &parts_[1]);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&parts_[1]);
    type = parts_[1];
    count = 1;
  }
  ~Message() {
    for (MPI_Datatype& t : parts_) {
      if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
    }
  }
};

// One row of the leading axis as an MPI type (counts are in rows).
struct RowType {
  MPI_Datatype type;
  int rc = MPI_SUCCESS;
  MPI_Datatype made_ = MPI_DATATYPE_NULL;
  explicit RowType(const Call& c) : type(c.type) {
    const size_t row = static_cast<size_t>(c.args[0]);
    if (row == 1) return;
    Message whole(c, row);
    rc = whole.rc;
    if (rc == MPI_SUCCESS) rc = MPI_Type_contiguous(whole.count, whole.type, &made_);
    if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&made_);
    type = made_;
  }
  ~RowType() {
    if (made_ != MPI_DATATYPE_NULL) MPI_Type_free(&made_);
  }
};

// Counts per rank and their displacements, as MPI's int vectors (Python keeps
// the totals within INT_MAX rows).
struct RankCounts {
  std::vector<int> counts, displacements;
  RankCounts(const int64_t* values, int size) : counts(size), displacements(size) {
    int64_t at = 0;
    for (int r = 0; r < size; ++r) {
      counts[r] = static_cast<int>(values[r]);
      displacements[r] = static_cast<int>(at);
      at += values[r];
    }
  }
};

int GathervWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts rows(c.args + 1, c.size);
  return MPI_Gatherv(c.in, rows.counts[c.rank], row.type, c.out, rows.counts.data(),
                     rows.displacements.data(), row.type, c.root, c.comm);
}

int AllgathervWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts rows(c.args + 1, c.size);
  return MPI_Allgatherv(c.in, rows.counts[c.rank], row.type, c.out, rows.counts.data(),
                        rows.displacements.data(), row.type, c.comm);
}

int ScattervWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts rows(c.args + 1, c.size);
  return MPI_Scatterv(c.in, rows.counts.data(), rows.displacements.data(), row.type, c.out,
                      rows.counts[c.rank], row.type, c.root, c.comm);
}

int AlltoallvWhole(const Call& c, const Chunk&) {
  RowType row(c);
  if (row.rc != MPI_SUCCESS) return row.rc;
  RankCounts sends(c.args + 1, c.size), receives(c.args + 1 + c.size, c.size);
  return MPI_Alltoallv(c.in, sends.counts.data(), sends.displacements.data(), row.type, c.out,
                       receives.counts.data(), receives.displacements.data(), row.type, c.comm);
}

// Check mode for alltoallv, whose counts are each rank's own: rank j's send
// count to rank r must be rank r's receive count from j.  Every rank learns
// whether any pair disagrees, so all of them fail together.
int VerifyPairCounts(const Call& c) {
  std::vector<int64_t> incoming(c.size);
  int rc = MPI_Alltoall(c.args + 1, 1, MPI_INT64_T, incoming.data(), 1, MPI_INT64_T, c.comm);
  int wrong = -1;
  for (int j = 0; rc == MPI_SUCCESS && j < c.size && wrong < 0; ++j) {
    if (incoming[j] != c.args[1 + c.size + j]) wrong = j;
  }
  int any = wrong >= 0;
  if (rc == MPI_SUCCESS) rc = MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, c.comm);
  if (rc != MPI_SUCCESS || !any) return rc;
  c.failure = std::string("mpicoll check mode: ") + c.name + " counts disagree on " +
              CommName(c.comm) + " (this is rank " + std::to_string(c.rank) + "): " +
              (wrong < 0 ? std::string("between other ranks (see their errors)")
                         : "rank " + std::to_string(wrong) + " sends " +
                               std::to_string(incoming[wrong]) + " rows here, but recv_counts[" +
                               std::to_string(wrong) + "] = " +
                               std::to_string(c.args[1 + c.size + wrong]));
  return kCheckFailed;
}

// Point-to-point.  Each body records the source and tag it received from.
struct Peers {
  int source, dest, send_tag, recv_tag;
  explicit Peers(const Call& c)
      : source(static_cast<int>(c.args[0])), dest(static_cast<int>(c.args[1])),
        send_tag(static_cast<int>(c.args[2])), recv_tag(static_cast<int>(c.args[3])) {}
};

// Checks for point-to-point: a communicator-wide fingerprint does not apply
// (only two ranks take part), so with every-call checks each message is
// preceded by a header with the sender's dtype and element count, which the
// receiver compares with its own.  (First-run checks leave messages alone: a
// sender's and a receiver's call sites need not run equally often, so they
// could not agree on which messages carry a header.)
struct Header {
  int64_t bytes;
  char description[120];
};

Header HeaderFor(const Call& c, size_t elements) {
  Header h{static_cast<int64_t>(elements * c.elem_bytes), {}};
  std::snprintf(h.description, sizeof(h.description), "%s[%zu]", DtypeName(c.dtype), elements);
  return h;
}

// After a header mismatch: consume the message into scratch memory (so its
// sender completes), and say what differed.
int HeaderMismatch(const Call& c, const Header& theirs, const Header& mine, int source, int tag,
                   const void* send, const Message* outgoing, int dest) {
  std::vector<char> scratch(static_cast<size_t>(theirs.bytes));
  MPI_Status status;
  const int rc = outgoing == nullptr
      ? MPI_Recv(scratch.data(), static_cast<int>(theirs.bytes), MPI_BYTE, source, tag, c.comm,
                 &status)
      : MPI_Sendrecv(send, outgoing->count, outgoing->type, dest, Peers(c).send_tag,
                     scratch.data(), static_cast<int>(theirs.bytes), MPI_BYTE, source, tag,
                     c.comm, &status);
  if (rc != MPI_SUCCESS) return rc;
  c.failure = std::string("mpicoll check mode: ") + c.name + " on rank " +
              std::to_string(c.rank) + " of " + CommName(c.comm) + " received " +
              theirs.description + " from rank " + std::to_string(source) + " (tag " +
              std::to_string(tag) + ") into " + mine.description;
  return kCheckFailed;
}

// The source and tag received from; a message shorter than the buffer fails
// (MPI itself fails a longer one: MPI_ERR_TRUNCATE).
int Received(const Call& c, const MPI_Status& status, const Message& expected) {
  c.status[0] = status.MPI_SOURCE;
  c.status[1] = status.MPI_TAG;
  if (status.MPI_SOURCE == MPI_PROC_NULL) return MPI_SUCCESS;
  int count = 0;
  if (MPI_Get_count(&status, expected.type, &count) == MPI_SUCCESS && count == expected.count) {
    return MPI_SUCCESS;
  }
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  c.failure = std::string("mpicoll.") + c.name + " on rank " + std::to_string(c.rank) + " of " +
              CommName(c.comm) + ": received " + std::to_string(bytes) + " bytes from rank " +
              std::to_string(status.MPI_SOURCE) + " (tag " + std::to_string(status.MPI_TAG) +
              "), but the buffer holds " + std::to_string(c.out_count * c.elem_bytes) +
              " (the sender's array is smaller)";
  return kCheckFailed;
}

int SendWhole(const Call& c, const Chunk&) {
  const Peers p(c);
  Message outgoing(c, c.in_count);
  if (outgoing.rc != MPI_SUCCESS) return outgoing.rc;
  c.status[0] = p.dest;
  c.status[1] = p.send_tag;
  if (check_mode.load(std::memory_order_relaxed) == kCheckEveryCall) {
    Header mine = HeaderFor(c, c.in_count);
    int rc = MPI_Send(&mine, sizeof(Header), MPI_BYTE, p.dest, p.send_tag, c.comm);
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_Send(c.in, outgoing.count, outgoing.type, p.dest, p.send_tag, c.comm);
}

// Receives (and, with `outgoing`, sends in the same call: sendrecv).
int ReceiveWhole(const Call& c, const Message* outgoing) {
  const Peers p(c);
  Message incoming(c, c.out_count);
  if (incoming.rc != MPI_SUCCESS) return incoming.rc;
  int source = p.source, tag = p.recv_tag;
  MPI_Status status;
  if (check_mode.load(std::memory_order_relaxed) == kCheckEveryCall) {
    // The header fixes the source and tag, so that the data that follows comes
    // from the same message pair even with ANY_SOURCE/ANY_TAG.
    const Header mine = HeaderFor(c, c.out_count), sent = HeaderFor(c, c.in_count);
    Header theirs{};
    int rc = outgoing == nullptr
        ? MPI_Recv(&theirs, sizeof(Header), MPI_BYTE, source, tag, c.comm, &status)
        : MPI_Sendrecv(&sent, sizeof(Header), MPI_BYTE, p.dest, p.send_tag, &theirs,
                       sizeof(Header), MPI_BYTE, source, tag, c.comm, &status);
    if (rc != MPI_SUCCESS) return rc;
    if (status.MPI_SOURCE != MPI_PROC_NULL) {
      source = status.MPI_SOURCE;
      tag = status.MPI_TAG;
      theirs.description[sizeof(theirs.description) - 1] = '\0';
      if (theirs.bytes != mine.bytes || std::strcmp(theirs.description, mine.description) != 0) {
        return HeaderMismatch(c, theirs, mine, source, tag, c.in, outgoing, p.dest);
      }
    }
  }
  const int rc = outgoing == nullptr
      ? MPI_Recv(c.out, incoming.count, incoming.type, source, tag, c.comm, &status)
      : MPI_Sendrecv(c.in, outgoing->count, outgoing->type, p.dest, p.send_tag, c.out,
                     incoming.count, incoming.type, source, tag, c.comm, &status);
  if (rc != MPI_SUCCESS) return rc;
  return Received(c, status, incoming);
}

int RecvWhole(const Call& c, const Chunk&) { return ReceiveWhole(c, nullptr); }

int SendrecvWhole(const Call& c, const Chunk&) {
  Message outgoing(c, c.in_count);
  if (outgoing.rc != MPI_SUCCESS) return outgoing.rc;
  return ReceiveWhole(c, &outgoing);
}

// ---------------------------------------------------------------------------
// Each collective as a type: one row of facts plus its body.  The facts drive
// everything generic (argument checks, check-mode descriptions, fused packing,
// GPU staging); nothing else asks which collective it is.
//   family         kBlocks: equal rank blocks, run in chunks (counts above
//                  INT_MAX, the GPU pipeline), fused for pytrees;
//                  kVector: counts per rank, the same on every rank (args);
//                  kVectorPairs: send/recv counts of this rank (args);
//                  kPeer: point-to-point (args: source, dest, tags)
//   reduces        takes a reduction operator
//   rooted         takes a root
//   blocks_in/out  the input/output is `size` rank blocks (else one block)
//   in_place       output shape = input shape; MPI_IN_PLACE when XLA aliases
//                  them (alltoall is not: MPICH's in-place alltoall measured
//                  5.3x the out-of-place time at 64 MiB)
//   root_input     only root's input is read (bcast, scatter)
//   zeros          where the output is zeros: kOffRoot (reduce, gather),
//                  kOnRankZero (exscan, undefined in MPI), kFromProcNull
//                  (a receive from MPI_PROC_NULL)
enum Family { kBlocks, kVector, kVectorPairs, kPeer };
enum Zeros { kNever, kOffRoot, kOnRankZero, kFromProcNull };

#define MPICOLL_OPS(X)                                                                     \
  /* Type             name              family        reduces rooted blocks_in blocks_out \
     in_place root_input zeros body */                                                    \
  X(BcastOp,          "bcast",          kBlocks,      false,  true,  false,    false,     \
    true,  true,  kNever,       BcastChunk)                                               \
  X(ScatterOp,        "scatter",        kBlocks,      false,  true,  true,     false,     \
    false, true,  kNever,       ScatterChunk)                                             \
  X(ReduceOp,         "reduce",         kBlocks,      true,   true,  false,    false,     \
    true,  false, kOffRoot,     ReduceChunk)                                              \
  X(AllreduceOp,      "allreduce",      kBlocks,      true,   false, false,    false,     \
    true,  false, kNever,       AllreduceChunk)                                           \
  X(GatherOp,         "gather",         kBlocks,      false,  true,  false,    true,      \
    false, false, kOffRoot,     GatherChunk)                                              \
  X(AllgatherOp,      "allgather",      kBlocks,      false,  false, false,    true,      \
    false, false, kNever,       AllgatherChunk)                                           \
  X(AlltoallOp,       "alltoall",       kBlocks,      false,  false, true,     true,      \
    false, false, kNever,       AlltoallChunk)                                            \
  X(ReduceScatterOp,  "reduce_scatter", kBlocks,      true,   false, true,     false,     \
    false, false, kNever,       ReduceScatterChunk)                                       \
  X(ScanOp,           "scan",           kBlocks,      true,   false, false,    false,     \
    true,  false, kNever,       ScanChunk)                                                \
  X(ExscanOp,         "exscan",         kBlocks,      true,   false, false,    false,     \
    true,  false, kOnRankZero,  ExscanChunk)                                              \
  X(GathervOp,        "gatherv",        kVector,      false,  true,  false,    false,     \
    false, false, kOffRoot,     GathervWhole)                                             \
  X(AllgathervOp,     "allgatherv",     kVector,      false,  false, false,    false,     \
    false, false, kNever,       AllgathervWhole)                                          \
  X(ScattervOp,       "scatterv",       kVector,      false,  true,  false,    false,     \
    false, true,  kNever,       ScattervWhole)                                            \
  X(AlltoallvOp,      "alltoallv",      kVectorPairs, false,  false, false,    false,     \
    false, false, kNever,       AlltoallvWhole)                                           \
  X(SendOp,           "send",           kPeer,        false,  false, false,    false,     \
    false, false, kNever,       SendWhole)                                                \
  X(RecvOp,           "recv",           kPeer,        false,  false, false,    false,     \
    false, false, kFromProcNull, RecvWhole)                                               \
  X(SendrecvOp,       "sendrecv",       kPeer,        false,  false, false,    false,     \
    false, false, kFromProcNull, SendrecvWhole)

#define MPICOLL_DEFINE_OP(Type, text, family, reduces, rooted, blocks_in, blocks_out,      \
                          in_place, root_input, zeros, body)                               \
  struct Type {                                                                           \
    static constexpr const char* kName = text;                                            \
    static constexpr Family kFamily = family;                                             \
    static constexpr bool kReduces = reduces, kRooted = rooted, kBlocksIn = blocks_in,    \
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
template <typename Op>
bool OutputIsZeros(const Call& c) {
  switch (Op::kZeros) {
    case kOffRoot: return c.rank != c.root;
    case kOnRankZero: return c.rank == 0;
    case kFromProcNull: return Peers(c).source == MPI_PROC_NULL;
    default: return false;
  }
}

// The check before a call (see CheckMode and CheckSameCall).  Point-to-point
// ops take no part (only two ranks of the communicator are in a message):
// with every-call checks their bodies check each message instead.  alltoallv
// also compares its counts pairwise.
template <typename Op, typename Describe>
ffi::Error CheckCall(const Call& c, int32_t device, Describe&& describe) {
  if constexpr (Op::kFamily == kPeer) return ffi::Error::Success();
  if (!NeedsCheck(c, device)) return ffi::Error::Success();
  std::string mismatch = CompareAcrossRanks(c.comm, c.rank, c.size, describe());
  if (!mismatch.empty()) return ffi::Error::Internal(mismatch);
  if constexpr (Op::kFamily == kVectorPairs) {
    if (int rc = VerifyPairCounts(c); rc == kCheckFailed) {
      return ffi::Error::Internal(c.failure);
    } else if (rc != MPI_SUCCESS) {
      return MpiFailure(c, rc);
    }
  }
  MarkChecked(c, device);
  return ffi::Error::Success();
}

// The call's communicator, root, op and MPI types, from the attributes and dtype.
template <typename Op>
ffi::Error Prepare(Call& c, int32_t device, int64_t comm_slot, int64_t root, int64_t op,
                   int64_t site, ffi::DataType dtype) {
  c.name = Op::kName;
  c.site = site;
  if (ffi::Error err = Resolve(c, device, comm_slot); err.failure()) return err;
  c.root = static_cast<int>(root);
  c.op = op;
  c.type = MpiType(dtype);
  c.mpi_op = Op::kReduces ? ReductionOp(dtype, op) : MPI_OP_NULL;
  if (c.type == MPI_DATATYPE_NULL || (Op::kReduces && c.mpi_op == MPI_OP_NULL)) {
    // Python validates dtype and op first; this guards direct misuse.
    return ffi::Error::InvalidArgument(std::string("mpicoll.") + Op::kName +
                                       ": unsupported dtype/op");
  }
  c.elem_bytes = ffi::ByteWidth(dtype);
  c.dtype = dtype;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Memory strategies.  One implementation of each collective serves every
// platform and transport; a strategy says where the bytes MPI touches live
// and moves them there:
//   Begin<Op>(c)          before the first chunk (may point c.in/c.out at
//                         staging buffers)
//   ChunkElements(c, b)   elements of each block per MPI call
//   BeforeChunk(c, k)     chunk k's input must be in c.in when it returns
//   AfterChunk(c, k)      chunk k's output in c.out is final
//   Finish<Op>(c, ok)     after the last chunk: zeros off root, hand-back
// Each returns an MPI code, or kTransportFailed with `error` set.  A strategy
// with kCallsMpi false does the whole collective in Begin.
// HostMemory: XLA's CPU buffers (or GPU staging buffers) are MPI's buffers.
// The GPU strategies (CUDA-aware, pinned staging) are in cuda_memory.h.
constexpr int kTransportFailed = -1;  // MPI codes are never negative

// What strategies that give MPI whole buffers share: one chunk per call (up
// to kMaxChunk elements), nothing to do between chunks.
struct WholeBuffers {
  static constexpr bool kCallsMpi = true;
  std::string error;
  size_t ChunkElements(const Call&, size_t) const { return kMaxChunk; }
  int BeforeChunk(const Call&, const Chunk&) { return MPI_SUCCESS; }
  int AfterChunk(const Call&, const Chunk&) { return MPI_SUCCESS; }
};

struct HostMemory : WholeBuffers {
  bool advise_huge_pages = true;

  template <typename Op>
  int Begin(Call& c) {
    if (!InPlace(c) && advise_huge_pages) AdviseHugePages(c.out, c.out_count * c.elem_bytes);
    // bcast sends from its output buffer.
    if (std::is_same_v<Op, BcastOp> && !InPlace(c) && c.rank == c.root) {
      std::memcpy(c.out, c.in, c.out_count * c.elem_bytes);
    }
    return MPI_SUCCESS;
  }
  template <typename Op>
  int Finish(const Call& c, bool ok) {
    // Output shapes do not depend on the rank; off root they are zeros.
    if (ok && OutputIsZeros<Op>(c)) std::memset(c.out, 0, c.out_count * c.elem_bytes);
    return MPI_SUCCESS;
  }
};

// The one loop every collective runs, on any memory.
template <typename Op, typename Memory>
int RunCollective(Call& c, Memory& memory) {
  int rc = memory.template Begin<Op>(c);
  if constexpr (!Memory::kCallsMpi) return rc;  // the strategy did all of it
  const size_t block = BlockElements<Op>(c);
  if constexpr (!Op::kChunked) {  // one MPI call on the whole buffers
    const Chunk whole{0, 0, block};
    if (rc == MPI_SUCCESS) rc = memory.BeforeChunk(c, whole);
    if (rc == MPI_SUCCESS) rc = Op::Run(c, whole);
    if (rc == MPI_SUCCESS) rc = memory.AfterChunk(c, whole);
    const int finished = memory.template Finish<Op>(c, rc == MPI_SUCCESS);
    return rc == MPI_SUCCESS ? finished : rc;
  }
  const size_t step = std::max<size_t>(1, std::min(memory.ChunkElements(c, block), kMaxChunk));
  for (size_t offset = 0; rc == MPI_SUCCESS && offset < block; offset += step) {
    const Chunk k{offset, static_cast<int>(std::min(step, block - offset)), block};
    rc = memory.BeforeChunk(c, k);
    if (rc == MPI_SUCCESS) rc = Op::Run(c, k);
    if (rc == MPI_SUCCESS && Op::kReduces) NormalizeLogical<Op>(c, k);
    if (rc == MPI_SUCCESS) rc = memory.AfterChunk(c, k);
  }
  const int finished = memory.template Finish<Op>(c, rc == MPI_SUCCESS);
  return rc == MPI_SUCCESS ? finished : rc;
}

// The MPI part, once c's buffers are set: watched by the timeout, checked
// across ranks in check mode (`describe()` says what this rank calls).
// A synchronous call first lets the device's queued overlapped calls finish
// (they come earlier in program order), then takes the serialized mode's lock
// (after draining: the progress thread needs it to finish those calls).
template <typename Op, typename Memory, typename Describe, typename BeforeRun = NothingBeforeRun>
ffi::Error Execute(Call& c, int32_t device, Memory& memory, Describe&& describe,
                   BeforeRun&& before_run = {}) {
  progress_threads[device].Drain();
  SerializedMpiScope serialized;
  InFlightScope watched(c, device);
  if (ffi::Error err = CheckCall<Op>(c, device, describe); err.failure()) return err;
  // Rank blocks have the same shapes on every rank, so an empty array skips MPI
  // on every rank (counts and messages may be empty on one rank only).
  if (Op::kFamily == kBlocks && c.in_count == 0 && c.out_count == 0) {
    return ffi::Error::Success();
  }
  if (int rc = before_run(c); rc != MPI_SUCCESS) return MpiFailure(c, rc);
  const int rc = RunCollective<Op>(c, memory);
  if (rc == kCheckFailed) return ffi::Error::Internal(c.failure);
  if (rc == kTransportFailed) {
    return ffi::Error::Internal(std::string("mpicoll.") + c.name + " on rank " +
                                std::to_string(c.rank) + ": " + memory.error);
  }
  if (rc != MPI_SUCCESS) return MpiFailure(c, rc);
  return ffi::Error::Success();
}

template <typename Op>
ffi::Error PrepareArray(Call& c, ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& out,
                        int32_t device, int64_t comm_slot, int64_t root, int64_t op,
                        int64_t site, ffi::Span<const int64_t> args) {
  if (ffi::Error err = Prepare<Op>(c, device, comm_slot, root, op, site, x.element_type());
      err.failure()) {
    return err;
  }
  // Python always passes what the family needs; this guards direct misuse.
  const size_t needed = Op::kFamily == kPeer ? 4
                        : Op::kFamily == kVector ? 1 + static_cast<size_t>(c.size)
                        : Op::kFamily == kVectorPairs ? 1 + 2 * static_cast<size_t>(c.size)
                        : 0;
  if (args.size() != needed) {
    return ffi::Error::InvalidArgument(std::string("mpicoll.") + Op::kName + ": expected " +
                                       std::to_string(needed) + " args, got " +
                                       std::to_string(args.size()));
  }
  c.args = args.begin();
  c.nargs = args.size();
  c.in = static_cast<char*>(x.untyped_data());
  c.out = static_cast<char*>(out->untyped_data());
  c.in_count = x.element_count();
  c.out_count = out->element_count();
  return ffi::Error::Success();
}

// Vector ops: the leading axis is this rank's count (it differs between
// ranks), so the description has the row shape and, where they are the same
// on every rank, the counts.
template <typename Op>
std::string DescribeShape(const Call& c, ffi::DataType dtype, ffi::Span<const int64_t> dims) {
  if constexpr (Op::kFamily == kVector || Op::kFamily == kVectorPairs) {
    std::string text = Describe(c, dtype, dims.last(dims.size() - 1), Op::kReduces,
                                Op::kRooted);
    text.insert(text.find('[') + 1, dims.size() > 1 ? "*," : "*");
    if constexpr (Op::kFamily == kVector) {
      text.pop_back();
      text += ", counts=(";
      for (size_t r = 1; r < c.nargs; ++r) text += (r > 1 ? "," : "") + std::to_string(c.args[r]);
      text += "))";
    }
    return text;
  }
  return Describe(c, dtype, dims, Op::kReduces, Op::kRooted);
}

template <typename Op>
std::string DescribeArray(const Call& c, const ffi::AnyBuffer& x) {
  return DescribeShape<Op>(c, x.element_type(), x.dimensions());
}

// The source and tag each local device's last point-to-point call received
// from (send: its dest and tag), read by the status handler that follows it in
// program order.
int32_t last_status[kMaxLocalDevices][2];

template <typename Op>
void RecordStatus(const Call& c, int32_t device) {
  if constexpr (Op::kFamily == kPeer) {
    last_status[device][0] = c.status[0];
    last_status[device][1] = c.status[1];
  }
}

template <typename Op>
ffi::Error CpuEntry(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> out, int32_t device, int64_t comm_slot,
                    int64_t root, int64_t op, int64_t site, ffi::Span<const int64_t> args) {
  Call c{};
  if (ffi::Error err = PrepareArray<Op>(c, x, out, device, comm_slot, root, op, site, args);
      err.failure()) {
    return err;
  }
  HostMemory memory;
  ffi::Error err = Execute<Op>(c, device, memory, [&] { return DescribeArray<Op>(c, x); });
  if (err.success()) RecordStatus<Op>(c, device);
  return err;
}

ffi::Error CpuStatusEntry(ffi::Token, ffi::Result<ffi::Token>,
                          ffi::Result<ffi::Buffer<ffi::S32>> out, int32_t device) {
  if (device < 0 || device >= kMaxLocalDevices || out->element_count() != 2) {
    return ffi::Error::InvalidArgument("mpicoll status: bad device or output shape");
  }
  progress_threads[device].Drain();  // an overlapped recv writes last_status
  std::memcpy(out->typed_data(), last_status[device], sizeof(last_status[device]));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Fused calls (pytrees): n arrays of one dtype in one MPI message.  XLA hands
// over the n buffers; they are packed into one staging buffer, moved by one
// MPI call, and unpacked into the n outputs.  Doing this here rather than as
// XLA concatenate + n slices saves one kernel launch per array (~0.8 us each
// on XLA:CPU).  Python keeps the fused arrays small (large ones go alone,
// zero-copy), which also bounds the staging buffers.
//
// Where the rank axis leads (Op::kBlocksIn / kBlocksOut), the message is still
// `size` rank blocks: block r holds every array's row r, array after array.
struct FusedArrays {
  std::vector<char*> in, out;           // XLA's buffers
  std::vector<size_t> in_row, out_row;  // elements per row of each array
  size_t in_rows = 1, out_rows = 1;
};

template <typename Op>
ffi::Error PrepareFused(Call& c, FusedArrays& arrays, ffi::RemainingArgs& xs,
                        ffi::RemainingRets& outs, int32_t device, int64_t comm_slot,
                        int64_t root, int64_t op, int64_t site) {
  const size_t n = xs.size();
  auto first = xs.get<ffi::AnyBuffer>(0);
  if (n == 0 || outs.size() != n || !first.has_value()) {
    return ffi::Error::InvalidArgument(std::string("mpicoll.") + Op::kName +
                                       ": a fused call needs n >= 1 arrays and n results");
  }
  const ffi::DataType dtype = first->element_type();
  if (ffi::Error err = Prepare<Op>(c, device, comm_slot, root, op, site, dtype); err.failure()) {
    return err;
  }
  arrays.in_rows = RowsIn<Op>(c);
  arrays.out_rows = RowsOut<Op>(c);
  arrays.in.resize(n);
  arrays.out.resize(n);
  arrays.in_row.resize(n);
  arrays.out_row.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto x = xs.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!x.has_value() || !out.has_value() || x->element_type() != dtype) {
      return ffi::Error::InvalidArgument(std::string("mpicoll.") + Op::kName +
                                         ": fused arrays must be buffers of one dtype");
    }
    arrays.in[i] = static_cast<char*>(x->untyped_data());
    arrays.out[i] = static_cast<char*>((*out)->untyped_data());
    arrays.in_row[i] = x->element_count() / arrays.in_rows;
    arrays.out_row[i] = (*out)->element_count() / arrays.out_rows;
    c.in_count += x->element_count();
    c.out_count += (*out)->element_count();
  }
  return ffi::Error::Success();
}

template <typename Op>
std::string DescribeFused(const Call& c, size_t n, ffi::DataType dtype) {
  const size_t rows = RowsIn<Op>(c);
  const int64_t dims[2] = {static_cast<int64_t>(rows), static_cast<int64_t>(c.in_count / rows)};
  const bool one_row = rows == 1;
  return "fused " + std::to_string(n) + " arrays: " +
         Describe(c, dtype, ffi::Span<const int64_t>(dims + one_row, 2 - one_row), Op::kReduces,
                  Op::kRooted);
}

// Copies every array's rows to (or from) the packed message, one strided copy
// per array: copy2d(dst, dst_pitch, src, src_pitch, width, height) in bytes.
template <typename Copy2D>
int CopyPacked(bool to_packed, const std::vector<char*>& arrays, const std::vector<size_t>& row,
               size_t rows, char* packed, size_t elem_bytes, Copy2D&& copy2d) {
  size_t packed_row_bytes = 0;
  for (size_t n : row) packed_row_bytes += n * elem_bytes;
  size_t at = 0;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const size_t bytes = row[i] * elem_bytes;
    const int rc = to_packed ? copy2d(packed + at, packed_row_bytes, arrays[i], bytes, bytes, rows)
                             : copy2d(arrays[i], bytes, packed + at, packed_row_bytes, bytes, rows);
    if (rc != MPI_SUCCESS) return rc;
    at += bytes;
  }
  return MPI_SUCCESS;
}

int HostCopy2D(char* dst, size_t dst_pitch, const char* src, size_t src_pitch, size_t width,
               size_t height) {
  for (size_t r = 0; r < height; ++r) std::memcpy(dst + r * dst_pitch, src + r * src_pitch, width);
  return MPI_SUCCESS;
}

// Packs, runs and unpacks a prepared fused call (synchronous or overlapped).
template <typename Op, typename BeforeRun = NothingBeforeRun>
ffi::Error RunFused(Call& c, FusedArrays& arrays, std::vector<char>& packed_in,
                    std::vector<char>& packed_out, int32_t device, const std::string& suffix,
                    BeforeRun&& before_run = {}) {
  packed_in.resize(c.in_count * c.elem_bytes);
  c.in = packed_in.data();
  if (Op::kInPlace) {
    c.out = c.in;
  } else {
    packed_out.resize(c.out_count * c.elem_bytes);
    c.out = packed_out.data();
  }
  if (ReadsInput<Op>(c)) {
    CopyPacked(true, arrays.in, arrays.in_row, arrays.in_rows, c.in, c.elem_bytes, HostCopy2D);
  }
  HostMemory memory;
  ffi::Error err = Execute<Op>(
      c, device, memory, [&] { return DescribeFused<Op>(c, arrays.in.size(), c.dtype) + suffix; },
      before_run);
  if (err.failure()) return err;
  CopyPacked(false, arrays.out, arrays.out_row, arrays.out_rows, c.out, c.elem_bytes, HostCopy2D);
  return ffi::Error::Success();
}

template <typename Op>
ffi::Error CpuFusedEntry(ffi::Token, ffi::RemainingArgs xs, ffi::Result<ffi::Token>,
                         ffi::RemainingRets outs, int32_t device, int64_t comm_slot, int64_t root,
                         int64_t op, int64_t site) {
  Call c{};
  thread_local FusedArrays arrays;
  if (ffi::Error err = PrepareFused<Op>(c, arrays, xs, outs, device, comm_slot, root, op, site);
      err.failure()) {
    return err;
  }
  thread_local std::vector<char> packed_in, packed_out;
  return RunFused<Op>(c, arrays, packed_in, packed_out, device, "");
}

// ---------------------------------------------------------------------------
// Overlapped handlers (see progress.h): the same calls, run on the device's
// progress thread while XLA goes on with work that does not need the result.
// The handler decodes the call on XLA's thread (a freed communicator fails at
// once), copies what the job needs out of XLA's call frame, which does not
// outlive the handler, queues the job and returns a future the job completes.
// XLA keeps the buffers alive, and runs nothing that reads the output or the
// token, until then.  The check's description says "overlapped", so ranks
// that disagree on overlapping a call get the mismatch error, not a hang.
constexpr const char* kOverlappedSuffix = ", overlapped";

ffi::Future CompletedFuture(const ffi::Error& err) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (err.failure()) {
    promise.SetError(err);
  } else {
    promise.SetAvailable();
  }
  return future;
}

// Queues run() (returning ffi::Error) on the device's progress thread.
template <typename Run>
ffi::Future Overlap(int32_t device, Run&& run) {
  ffi::Promise promise;
  ffi::Future future(promise);
  progress_threads[device].Enqueue([promise, run = std::forward<Run>(run)]() mutable {
    ffi::Error err = run();
    if (err.failure()) {
      promise.SetError(std::move(err));
    } else {
      promise.SetAvailable();
    }
  });
  return future;
}

// Point-to-point calls have only two ranks in a message: no barrier over the
// communicator before them.
template <typename Op>
struct ArrivalWait {
  int operator()(const Call& c) const {
    if constexpr (Op::kFamily == kPeer) return MPI_SUCCESS;
    return WaitForArrivals(c);
  }
};

struct OverlappedArray {
  Call c{};
  std::vector<int64_t> args, dims;
  ffi::DataType dtype;
};

template <typename Op>
ffi::Future CpuOverlappedEntry(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                               ffi::Result<ffi::AnyBuffer> out, int32_t device,
                               int64_t comm_slot, int64_t root, int64_t op, int64_t site,
                               ffi::Span<const int64_t> args) {
  auto call = std::make_shared<OverlappedArray>();
  if (ffi::Error err =
          PrepareArray<Op>(call->c, x, out, device, comm_slot, root, op, site, args);
      err.failure()) {
    return CompletedFuture(err);
  }
  call->args.assign(args.begin(), args.end());
  call->c.args = call->args.data();
  call->dims.assign(x.dimensions().begin(), x.dimensions().end());
  call->dtype = x.element_type();
  return Overlap(device, [call, device] {
    Call& c = call->c;
    HostMemory memory;
    ffi::Error err = Execute<Op>(
        c, device, memory,
        [&] { return DescribeShape<Op>(c, call->dtype, call->dims) + kOverlappedSuffix; },
        ArrivalWait<Op>{});
    if (err.success()) RecordStatus<Op>(c, device);
    return err;
  });
}

// A fused call packs into buffers of its own (the synchronous path's are per
// thread, and several overlapped calls may be queued at once).
struct OverlappedFused {
  Call c{};
  FusedArrays arrays;
  std::vector<char> packed_in, packed_out;
};

template <typename Op>
ffi::Future CpuOverlappedFusedEntry(ffi::Token, ffi::RemainingArgs xs, ffi::Result<ffi::Token>,
                                    ffi::RemainingRets outs, int32_t device, int64_t comm_slot,
                                    int64_t root, int64_t op, int64_t site) {
  auto call = std::make_shared<OverlappedFused>();
  if (ffi::Error err =
          PrepareFused<Op>(call->c, call->arrays, xs, outs, device, comm_slot, root, op, site);
      err.failure()) {
    return CompletedFuture(err);
  }
  return Overlap(device, [call, device] {
    return RunFused<Op>(call->c, call->arrays, call->packed_in, call->packed_out, device,
                        kOverlappedSuffix, ArrivalWait<Op>{});
  });
}

// ---------------------------------------------------------------------------
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
    InFlightScope watched(waiting, device);
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
        InFlightScope watched(waiting, device);
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
      InFlightScope watched(waiting, device);
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

ffi::Error BarrierEntry(ffi::Token, ffi::Result<ffi::Token>, int32_t device, int64_t comm_slot,
                        int64_t site) {
  Call c{};
  c.name = "barrier";
  c.site = site;
  if (ffi::Error err = Resolve(c, device, comm_slot); err.failure()) return err;
  progress_threads[device].Drain();
  InFlightScope watched(c, device);
  if (ffi::Error err = CheckSameCall(c, device, "barrier()"); err.failure()) return err;
  if (int rc = Barrier(c); rc != MPI_SUCCESS) return MpiFailure(c, rc);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Handlers: every data collective has one FFI signature per platform, so one
// binding serves all of them; `Extra` adds the platform's context (the CUDA
// stream).  A handler's symbol is <Platform><Kind>_<Op>.
#define MPICOLL_DATA_BINDING(Extra)                                                    \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Token>()                                                               \
      .Arg<ffi::AnyBuffer>()                                                           \
      .Ret<ffi::Token>()                                                               \
      .Ret<ffi::AnyBuffer>() Extra                                                     \
      .Ctx<ffi::DeviceOrdinal>()                                                       \
      .Attr<int64_t>("comm")                                                           \
      .Attr<int64_t>("root")                                                           \
      .Attr<int64_t>("op")                                                             \
      .Attr<int64_t>("site")                                                         \
      .Attr<ffi::Span<const int64_t>>("args")
#define MPICOLL_FUSED_BINDING(Extra)                                                   \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Token>()                                                               \
      .RemainingArgs()                                                                 \
      .Ret<ffi::Token>()                                                               \
      .RemainingRets() Extra                                                           \
      .Ctx<ffi::DeviceOrdinal>()                                                       \
      .Attr<int64_t>("comm")                                                           \
      .Attr<int64_t>("root")                                                           \
      .Attr<int64_t>("op")                                                             \
      .Attr<int64_t>("site")
#define MPICOLL_NO_CONTEXT

#define MPICOLL_CPU_HANDLERS(Type, ...)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuData_##Type, CpuEntry<Type>,                           \
                                MPICOLL_DATA_BINDING(MPICOLL_NO_CONTEXT));                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuFused_##Type, CpuFusedEntry<Type>,                     \
                                MPICOLL_FUSED_BINDING(MPICOLL_NO_CONTEXT));               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuOverlappedData_##Type, CpuOverlappedEntry<Type>,       \
                                MPICOLL_DATA_BINDING(MPICOLL_NO_CONTEXT));                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuOverlappedFused_##Type, CpuOverlappedFusedEntry<Type>, \
                                MPICOLL_FUSED_BINDING(MPICOLL_NO_CONTEXT));
MPICOLL_OPS(MPICOLL_CPU_HANDLERS)
#undef MPICOLL_CPU_HANDLERS

// The global allreduce of small arrays (CPU only; see CpuLocalAllreduceEntry).
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuLocalAllreduce, CpuLocalAllreduceEntry,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("local"));

// The barrier has no buffers and no stream work: one handler for every platform.
XLA_FFI_DEFINE_HANDLER_SYMBOL(BarrierHandler, BarrierEntry,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Token>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("site"));

#define MPICOLL_STATUS_BINDING(Extra)                                                  \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Token>()                                                               \
      .Ret<ffi::Token>()                                                               \
      .Ret<ffi::Buffer<ffi::S32>>() Extra                                              \
      .Ctx<ffi::DeviceOrdinal>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(CpuStatusHandler, CpuStatusEntry,
                              MPICOLL_STATUS_BINDING(MPICOLL_NO_CONTEXT));

struct Registration {
  std::string name;
  XLA_FFI_Handler* handler;
};

// Every op's handler, and the fused one for the rank-block family (pytrees).
#define MPICOLL_REGISTRATION(Platform, Type, text)                                    \
  registrations.push_back({std::string("mpicoll_") + text, Platform##Data_##Type});   \
  if (Type::kFamily == kBlocks) {                                                      \
    registrations.push_back({std::string("mpicoll_") + text + "_fused",                \
                             Platform##Fused_##Type});                                 \
  }
#define MPICOLL_CPU_REGISTRATION(Type, text, ...) MPICOLL_REGISTRATION(Cpu, Type, text)
// Overlapped handlers are CPU-only for now: mpicoll_<op>_overlapped[_fused].
#define MPICOLL_CPU_OVERLAPPED_REGISTRATION(Type, text, ...)                           \
  registrations.push_back({std::string("mpicoll_") + text + "_overlapped",            \
                           CpuOverlappedData_##Type});                                \
  if (Type::kFamily == kBlocks) {                                                      \
    registrations.push_back({std::string("mpicoll_") + text + "_overlapped_fused",    \
                             CpuOverlappedFused_##Type});                              \
  }
std::vector<Registration> CpuRegistrations() {
  std::vector<Registration> registrations{{"mpicoll_barrier", BarrierHandler},
                                          {"mpicoll_status", CpuStatusHandler},
                                          {"mpicoll_allreduce_local", CpuLocalAllreduce}};
  MPICOLL_OPS(MPICOLL_CPU_REGISTRATION)
  MPICOLL_OPS(MPICOLL_CPU_OVERLAPPED_REGISTRATION)
  return registrations;
}
#undef MPICOLL_CPU_OVERLAPPED_REGISTRATION
#undef MPICOLL_CPU_REGISTRATION

#ifdef MPICOLL_CUDA
#include "cuda_memory.h"
#endif

// ---------------------------------------------------------------------------
// Python module: registrations(), initialize(), register_comm(), build_info(),
// cuda_aware_mpi().

PyObject* RegistrationDict(const std::vector<Registration>& registrations) {
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  for (const Registration& r : registrations) {
    PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(r.handler), nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(dict, r.name.c_str(), capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return dict;
}

// FFI target name -> handler capsule, per platform ("cpu", and "cuda" when built with it).
PyObject* Registrations(PyObject*, PyObject* args) {
  const char* platform = "cpu";
  if (!PyArg_ParseTuple(args, "|s", &platform)) return nullptr;
  if (std::strcmp(platform, "cpu") == 0) return RegistrationDict(CpuRegistrations());
#ifdef MPICOLL_CUDA
  if (std::strcmp(platform, "cuda") == 0) return RegistrationDict(CudaRegistrations());
#endif
  PyErr_Format(PyExc_ValueError, "mpicoll: this build has no handlers for platform %s",
               platform);
  return nullptr;
}

bool initialized = false;

// Called once MPI is initialized (by mpi4py): checks the thread level and
// creates the operators for 16-bit floats.
PyObject* Initialize(PyObject*, PyObject*) {
  if (initialized) Py_RETURN_NONE;
  int flag = 0;
  MPI_Initialized(&flag);
  if (!flag) {
    PyErr_SetString(PyExc_RuntimeError, "mpicoll: MPI is not initialized");
    return nullptr;
  }
  int provided = 0;
  MPI_Query_thread(&provided);
  const MPI_Op builtins[kNumOps] = {MPI_SUM, MPI_PROD, MPI_MIN,  MPI_MAX, MPI_LAND,
                                    MPI_LOR, MPI_LXOR, MPI_BAND, MPI_BOR, MPI_BXOR};
  std::copy(builtins, builtins + kNumOps, builtin_ops);
  if (CreateHalfOps<kF16>() != MPI_SUCCESS || CreateHalfOps<kBF16>() != MPI_SUCCESS ||
      ProbeIntegerSums() != MPI_SUCCESS) {
    PyErr_SetString(PyExc_RuntimeError, "mpicoll: creating the reduction operators failed");
    return nullptr;
  }
  initialized = true;
  return PyLong_FromLong(provided);
}

PyObject* RegisterComm(PyObject*, PyObject* args) {
  long long key;
  int device;
  unsigned long long handle;
  if (!PyArg_ParseTuple(args, "LiK", &key, &device, &handle)) return nullptr;
  if (key < 0 || device < 0 || device >= kMaxLocalDevices) {
    PyErr_Format(PyExc_ValueError, "mpicoll: communicator key %lld / device %d out of range "
                 "(at most %d local devices)", key, device, kMaxLocalDevices);
    return nullptr;
  }
  DeviceComm entry;
  entry.comm = HandleFromInteger<MPI_Comm>(handle);
  int rc = MPI_Comm_rank(entry.comm, &entry.rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(entry.comm, &entry.size);
  // Collective, like the Python MPI_Comm_dup this follows (same order on every rank).
  if (rc == MPI_SUCCESS && entry.size > 1) rc = MPI_Comm_dup(entry.comm, &entry.internal);
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
    text[len] = '\0';
    PyErr_Format(PyExc_ValueError, "mpicoll: cannot register communicator %lld: %s", key, text);
    return nullptr;
  }
  CommRow* row = comm_table[key % kMaxComms].load();
  if (!row) {
    row = new CommRow;
    comm_table[key % kMaxComms].store(row, std::memory_order_release);
  }
  if (row->key.load() != key) {  // a new generation of this slot
    row->key.store(-1);
    std::fill(row->devices, row->devices + kMaxLocalDevices, DeviceComm{});
  }
  row->devices[device] = entry;
  row->key.store(key, std::memory_order_release);
  Py_RETURN_NONE;
}

PyObject* UnregisterComm(PyObject*, PyObject* args) {
  long long key;
  if (!PyArg_ParseTuple(args, "L", &key)) return nullptr;
  if (key < 0) Py_RETURN_NONE;
  if (CommRow* row = comm_table[key % kMaxComms].load()) {
    int64_t expected = key;
    if (row->key.compare_exchange_strong(expected, -1)) {
      // Python frees the communicators it duplicated right after this, in the same order.
      for (DeviceComm& entry : row->devices) {
        if (entry.internal != MPI_COMM_NULL) MPI_Comm_free(&entry.internal);
      }
    }
  }
  Py_RETURN_NONE;
}

PyObject* BuildInfo(PyObject*, PyObject*) {
#if defined(OMPI_MAJOR_VERSION)
  const char* vendor = "Open MPI";
  PyObject* version = Py_BuildValue("(iii)", OMPI_MAJOR_VERSION, OMPI_MINOR_VERSION,
                                    OMPI_RELEASE_VERSION);
#elif defined(I_MPI_NUMVERSION)  // before MPICH: Intel MPI defines MPICH_NUMVERSION too
  const char* vendor = "Intel MPI";
  PyObject* version = Py_BuildValue("(iii)", static_cast<int>(I_MPI_NUMVERSION / 10000000),
                                    static_cast<int>((I_MPI_NUMVERSION / 100000) % 100),
                                    static_cast<int>((I_MPI_NUMVERSION / 1000) % 100));
#elif defined(MPICH_NUMVERSION)
  const char* vendor = "MPICH";
  PyObject* version = Py_BuildValue("(iii)", MPICH_NUMVERSION / 10000000,
                                    (MPICH_NUMVERSION / 100000) % 100,
                                    (MPICH_NUMVERSION / 1000) % 100);
#else
  const char* vendor = "unknown";
  PyObject* version = Py_BuildValue("()");
#endif
  if (!version) return nullptr;
#ifdef MPICOLL_CUDA
  PyObject* platforms = Py_BuildValue("(ss)", "cpu", "cuda");
#else
  PyObject* platforms = Py_BuildValue("(s)", "cpu");
#endif
  if (!platforms) return nullptr;
  return Py_BuildValue("{s:s,s:N,s:i,s:i,s:i,s:i,s:N}", "mpi_vendor", vendor, "mpi_version",
                       version, "mpi_standard_version", MPI_VERSION, "mpi_standard_subversion",
                       MPI_SUBVERSION, "max_comms", kMaxComms, "max_local_devices",
                       kMaxLocalDevices, "platforms", platforms);
}

// Whether this MPI takes CUDA device pointers in its calls: True or False where
// the MPI can say (Open MPI's MPIX_Query_cuda_support, MPICH's
// MPIX_GPU_query_support; both answer at run time, e.g. for a library built with
// CUDA but run with GPU support switched off), None where it cannot.
PyObject* CudaAwareMpi(PyObject*, PyObject*) {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return PyBool_FromLong(MPIX_Query_cuda_support());
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  Py_RETURN_FALSE;  // Open MPI built without CUDA
#elif defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  if (MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) != MPI_SUCCESS) Py_RETURN_NONE;
  return PyBool_FromLong(supported);
#else
  Py_RETURN_NONE;
#endif
}

// The reduction operators by name, so Python never duplicates the numbering.
PyObject* OpCodes(PyObject*, PyObject*) {
  return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "sum", kSum, "prod", kProd,
                       "min", kMin, "max", kMax, "land", kLand, "lor", kLor, "lxor", kLxor,
                       "band", kBand, "bor", kBor, "bxor", kBxor);
}

// Python's collective communicator setup, watched like a collective.
PyObject* BeginSetup(PyObject*, PyObject* args) {
  const char* description;
  if (!PyArg_ParseTuple(args, "s", &description)) return nullptr;
  InFlight& slot = in_flight[kSetupSlot];
  slot.started_ns.store(0);
  setup_description = description;
  slot.name.store(setup_description.c_str());
  slot.started_ns.store(NowNs());
  Py_RETURN_NONE;
}

PyObject* EndSetup(PyObject*, PyObject*) {
  in_flight[kSetupSlot].started_ns.store(0);
  Py_RETURN_NONE;
}

// The dtypes whose sum uses mpicoll's wrapping operator instead of MPI_SUM.
PyObject* ReplacedSums(PyObject*, PyObject*) {
  PyObject* names = PyList_New(0);
  if (!names) return nullptr;
  for (int i = 0; i < kNumNarrowInts; ++i) {
    if (wrapping_sums[i] == MPI_OP_NULL) continue;
    PyObject* name = PyUnicode_FromString(kNarrowIntNames[i]);
    if (!name || PyList_Append(names, name) < 0) {
      Py_XDECREF(name);
      Py_DECREF(names);
      return nullptr;
    }
    Py_DECREF(name);
  }
  return names;
}

PyObject* SetCheckMode(PyObject*, PyObject* arg) {
  long mode = PyLong_AsLong(arg);
  if (mode == -1 && PyErr_Occurred()) return nullptr;
  if (mode < kCheckOff || mode > kCheckEveryCall) {
    PyErr_SetString(PyExc_ValueError, "check mode must be 0 (off), 1 (first run) or 2 (every call)");
    return nullptr;
  }
  check_mode.store(static_cast<int>(mode));
  Py_RETURN_NONE;
}

// (min block bytes, segment bytes) -> the previous pair; (-1, -1) only reads.
PyObject* PairwiseReduceScatterSizes(PyObject*, PyObject* args) {
  long long min_block = -1, segment = -1;
  if (!PyArg_ParseTuple(args, "|LL", &min_block, &segment)) return nullptr;
  const unsigned long long old_min = pairwise_min_block_bytes.load(),
                           old_segment = pairwise_segment_bytes.load();
  if (min_block >= 0) pairwise_min_block_bytes.store(static_cast<size_t>(min_block));
  if (segment > 0) pairwise_segment_bytes.store(static_cast<size_t>(segment));
  return Py_BuildValue("(KK)", old_min, old_segment);
}

PyObject* ComparisonsMade(PyObject*, PyObject*) {
  return PyLong_FromLongLong(comparisons_made.load());
}

// (slot, device, description) -> "" or the mismatch message (see CompareAcrossRanks).
PyObject* CompareCall(PyObject*, PyObject* args) {
  long long slot;
  int device;
  const char* description;
  if (!PyArg_ParseTuple(args, "Lis", &slot, &device, &description)) return nullptr;
  const DeviceComm* entry = LookupComm(slot, device);
  if (entry == nullptr) {
    PyErr_SetString(PyExc_ValueError, "mpicoll: no communicator registered for this slot");
    return nullptr;
  }
  std::string message;
  Py_BEGIN_ALLOW_THREADS
  {  // released before the GIL is taken back
    SerializedMpiScope serialized;
    message = CompareAcrossRanks(entry->comm, entry->rank, entry->size, description);
  }
  Py_END_ALLOW_THREADS
  return PyUnicode_FromStringAndSize(message.data(), static_cast<Py_ssize_t>(message.size()));
}

PyObject* SetTimeout(PyObject*, PyObject* arg) {
  double seconds = PyFloat_AsDouble(arg);
  if (seconds == -1.0 && PyErr_Occurred()) return nullptr;
  timeout_seconds.store(seconds > 0 ? seconds : 0.0);
  if (seconds > 0 && !watchdog_started.exchange(true)) std::thread(Watchdog).detach();
  Py_RETURN_NONE;
}

// True: mpicoll's MPI calls take serialized_mpi_mutex (MPI_THREAD_SERIALIZED).
PyObject* SetSerializedMpi(PyObject*, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  serialize_mpi_calls.store(on != 0);
  Py_RETURN_NONE;
}

PyObject* PyAbortJob(PyObject*, PyObject* arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) return nullptr;
  AbortJob(static_cast<int>(code));
}

PyMethodDef methods[] = {
    {"set_check_mode", SetCheckMode, METH_O,
     "Compare call fingerprints across ranks: 0 never, 1 each call site's first run, 2 always."},
    {"pairwise_reduce_scatter", PairwiseReduceScatterSizes, METH_VARARGS,
     "(min block bytes, segment bytes) of mpicoll's own reduce-scatter -> the previous pair; "
     "a negative value leaves that one; every rank must set the same."},
    {"comparisons_made", ComparisonsMade, METH_NOARGS,
     "How many times this process has compared a call across ranks."},
    {"compare_call", CompareCall, METH_VARARGS,
     "(slot, device, description) -> '' if every rank passed the same, else the mismatch."},
    {"set_timeout", SetTimeout, METH_O, "Abort the job if a collective waits longer (0 = off)."},
    {"op_codes", OpCodes, METH_NOARGS, "Reduction operator name -> code used by the handlers."},
    {"registrations", Registrations, METH_VARARGS,
     "FFI target name -> handler capsule for a platform ('cpu' or 'cuda')."},
#ifdef MPICOLL_CUDA
    {"set_gpu_transport", SetGpuTransport, METH_VARARGS,
     "Choose the GPU memory strategy: (cuda_aware, pipeline chunk bytes)."},
    {"cuda_driver", CudaDriverInfo, METH_NOARGS, "The CUDA driver: error, version, devices."},
#endif
    {"initialize", Initialize, METH_NOARGS, "Set up MPI operators; returns the thread level."},
    {"register_comm", RegisterComm, METH_VARARGS, "Store an MPI_Comm handle in a table slot."},
    {"unregister_comm", UnregisterComm, METH_VARARGS, "Empty a slot (its communicator was freed)."},
    {"build_info", BuildInfo, METH_NOARGS, "The MPI this extension was compiled against."},
    {"cuda_aware_mpi", CudaAwareMpi, METH_NOARGS,
     "True/False: whether MPI accepts CUDA device buffers; None: this MPI cannot tell."},
    {"begin_setup", BeginSetup, METH_VARARGS,
     "Watch a collective setup step (MPICOLL_TIMEOUT) described by the argument."},
    {"end_setup", EndSetup, METH_NOARGS, "End the watched setup step."},
    {"set_serialized_mpi", SetSerializedMpi, METH_O,
     "True: mpicoll's MPI calls take one lock (MPI_THREAD_SERIALIZED mode)."},
    {"abort_job", PyAbortJob, METH_O,
     "Abort every rank with this exit code, after letting the launcher forward stderr."},
    {"replaced_sums", ReplacedSums, METH_NOARGS,
     "Dtypes whose MPI_SUM saturates in this MPI and is replaced by a wrapping operator."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mpicoll_ffi",
                      "XLA FFI handlers for MPI collectives.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__mpicoll_ffi() { return PyModule_Create(&module); }

// The reduction operators: codes, the MPI_Op each code is on each dtype, and
// mpicoll's own operators where MPI's builtin ones do not serve (16-bit floats,
// saturating narrow integer sums).  Every op list here comes from reduce_ops.def.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../reduce_ops.def"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// The codes Python passes (`op_codes()`, `reduction_ops()`): a row's position.
enum OpCode : int64_t {
#define MPICOLL_OP_CODE(Code, ...) Code,
  MPICOLL_REDUCE_OPS(MPICOLL_OP_CODE)
#undef MPICOLL_OP_CODE
  kNumOps
};

// What Python and the error messages need of each op, by code.
struct ReduceOpFacts {
  const char* name;
  bool bool_, integer, floating, complex;
};
inline constexpr ReduceOpFacts kReduceOps[kNumOps] = {
#define MPICOLL_OP_FACTS(Code, name, mpi_op, bool_, integer, floating, complex, float_fn) \
  {name, bool_, integer, floating, complex},
    MPICOLL_REDUCE_OPS(MPICOLL_OP_FACTS)
#undef MPICOLL_OP_FACTS
};

inline MPI_Op builtin_ops[kNumOps];

// MPI has no 16-bit float types: float16/bfloat16 are moved as 16-bit
// integers and reduced with native user-defined operators (one per op and
// type, so the operator knows how to decode its bits).
enum HalfKind { kF16 = 0, kBF16 = 1 };
inline MPI_Op half_ops[2][kNumOps];  // [HalfKind][op]; MPI_OP_NULL where not floating

inline float BF16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet and NaN.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

inline float F16ToFloat(uint16_t h) {
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

inline uint16_t FloatToF16(float f) {
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
// The ops that are not defined on floating types have no 16-bit operator.
struct NoFloatFn {};

template <HalfKind kind, typename Fn>
void HalfReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  Fn fn;
  for (int i = 0; i < *len; ++i) {
    b[i] = FloatToHalf<kind>(fn(HalfToFloat<kind>(a[i]), HalfToFloat<kind>(b[i])));
  }
}

template <HalfKind kind, typename Fn>
int CreateHalfOp(MPI_Op* op) {
  *op = MPI_OP_NULL;
  if constexpr (std::is_same_v<Fn, NoFloatFn>) {
    return MPI_SUCCESS;
  } else {
    return MPI_Op_create(HalfReduce<kind, Fn>, /*commute=*/1, op);
  }
}

template <HalfKind kind>
int CreateHalfOps() {
  int rc = MPI_SUCCESS;
#define MPICOLL_CREATE_HALF_OP(Code, name, mpi_op, bool_, integer, floating, complex, float_fn) \
  if (rc == MPI_SUCCESS) rc = CreateHalfOp<kind, float_fn>(&half_ops[kind][Code]);
  MPICOLL_REDUCE_OPS(MPICOLL_CREATE_HALF_OP)
#undef MPICOLL_CREATE_HALF_OP
  return rc;
}

// ---------------------------------------------------------------------------
// Integer sums wrap around (two's complement), as in numpy and XLA.  Not every
// MPI agrees: Open MPI's op/avx component adds 8- and 16-bit integers with
// saturating vector instructions once a call has 64 elements or more
// (open-mpi/ompi#8045, closed as "wontfix"), so 200 + 200 in uint8 gives 255.
// Initialize() probes MPI_SUM on each of these types with MPI_Reduce_local and
// swaps in a wrapping user-defined operator only where the builtin saturates.
enum NarrowInt { kS8 = 0, kU8, kS16, kU16, kNumNarrowInts };
inline MPI_Op wrapping_sums[kNumNarrowInts] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
inline const char* const kNarrowIntNames[kNumNarrowInts] = {"int8", "uint8", "int16", "uint16"};

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

inline int ProbeIntegerSums() {
  int rc = ProbeIntegerSum<int8_t>(MPI_INT8_T, &wrapping_sums[kS8]);
  if (rc == MPI_SUCCESS) rc = ProbeIntegerSum<uint8_t>(MPI_UINT8_T, &wrapping_sums[kU8]);
  if (rc == MPI_SUCCESS) rc = ProbeIntegerSum<int16_t>(MPI_INT16_T, &wrapping_sums[kS16]);
  if (rc == MPI_SUCCESS) rc = ProbeIntegerSum<uint16_t>(MPI_UINT16_T, &wrapping_sums[kU16]);
  return rc;
}

inline int NarrowIntIndex(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S8: return kS8;
    case ffi::DataType::U8: return kU8;
    case ffi::DataType::S16: return kS16;
    case ffi::DataType::U16: return kU16;
    default: return -1;
  }
}

// Once MPI is initialized: the builtin operators, the 16-bit float ones, and
// the wrapping sums where MPI_SUM saturates.
inline int CreateReductionOps() {
#define MPICOLL_BUILTIN_OP(Code, name, mpi_op, ...) builtin_ops[Code] = mpi_op;
  MPICOLL_REDUCE_OPS(MPICOLL_BUILTIN_OP)
#undef MPICOLL_BUILTIN_OP
  int rc = CreateHalfOps<kF16>();
  if (rc == MPI_SUCCESS) rc = CreateHalfOps<kBF16>();
  if (rc == MPI_SUCCESS) rc = ProbeIntegerSums();
  return rc;
}

// The operator that reduces `op` on `t`; MPI_OP_NULL where there is none.
inline MPI_Op ReductionOp(ffi::DataType t, int64_t op) {
  if (op < 0 || op >= kNumOps) return MPI_OP_NULL;
  if (t == ffi::DataType::F16 || t == ffi::DataType::BF16) {
    return half_ops[t == ffi::DataType::F16 ? kF16 : kBF16][op];
  }
  if (op == kSum) {
    int narrow = NarrowIntIndex(t);
    if (narrow >= 0 && wrapping_sums[narrow] != MPI_OP_NULL) return wrapping_sums[narrow];
  }
  return builtin_ops[op];
}

}  // namespace mpicoll

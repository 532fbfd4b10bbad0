// The element types mpicoll moves: XLA's type, its name, and its MPI datatype.
#pragma once

#include <mpi.h>

#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// XLA element type, numpy's name for it, the MPI datatype that moves it (and
// that builtin ops reduce).  MPI has no 16-bit floats: they move as 16-bit
// integers and are reduced by mpicoll's own operators (core/reduce_ops.h).
#define MPICOLL_DTYPES(X)                       \
  X(PRED, "bool", MPI_UINT8_T) /* 0/1 bytes */  \
  X(S8, "int8", MPI_INT8_T)                     \
  X(S16, "int16", MPI_INT16_T)                  \
  X(S32, "int32", MPI_INT32_T)                  \
  X(S64, "int64", MPI_INT64_T)                  \
  X(U8, "uint8", MPI_UINT8_T)                   \
  X(U16, "uint16", MPI_UINT16_T)                \
  X(U32, "uint32", MPI_UINT32_T)                \
  X(U64, "uint64", MPI_UINT64_T)                \
  X(F16, "float16", MPI_UINT16_T)               \
  X(BF16, "bfloat16", MPI_UINT16_T)             \
  X(F32, "float32", MPI_FLOAT)                  \
  X(F64, "float64", MPI_DOUBLE)                 \
  X(C64, "complex64", MPI_C_FLOAT_COMPLEX)      \
  X(C128, "complex128", MPI_C_DOUBLE_COMPLEX)

inline MPI_Datatype MpiType(ffi::DataType t) {
  switch (t) {
#define MPICOLL_MPI_TYPE_CASE(xla, name, mpi) \
    case ffi::DataType::xla: return mpi;
    MPICOLL_DTYPES(MPICOLL_MPI_TYPE_CASE)
#undef MPICOLL_MPI_TYPE_CASE
    default: return MPI_DATATYPE_NULL;
  }
}

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
#define MPICOLL_DTYPE_NAME_CASE(xla, name, mpi) \
    case ffi::DataType::xla: return name;
    MPICOLL_DTYPES(MPICOLL_DTYPE_NAME_CASE)
#undef MPICOLL_DTYPE_NAME_CASE
    default: return "?";
  }
}

// The type numpy calls `name`; INVALID if mpicoll does not move it.
inline ffi::DataType DtypeFromName(const char* name) {
#define MPICOLL_DTYPE_FROM_NAME(xla, text, mpi) \
  if (std::strcmp(name, text) == 0) return ffi::DataType::xla;
  MPICOLL_DTYPES(MPICOLL_DTYPE_FROM_NAME)
#undef MPICOLL_DTYPE_FROM_NAME
  return ffi::DataType::INVALID;
}

}  // namespace mpicoll

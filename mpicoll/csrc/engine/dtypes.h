// The element types mpicoll moves: XLA's type, its name, and its MPI datatype.
#pragma once

#include <mpi.h>

#include <cstring>

#include "../dtypes.def"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

namespace ffi = xla::ffi;

// The rows: csrc/dtypes.def (XLA's type, numpy's name, the MPI datatype, the family).
inline MPI_Datatype MpiType(ffi::DataType t) {
  switch (t) {
#define MPICOLL_MPI_TYPE_CASE(xla, name, mpi, family) \
    case ffi::DataType::xla: return mpi;
    MPICOLL_DTYPES(MPICOLL_MPI_TYPE_CASE)
#undef MPICOLL_MPI_TYPE_CASE
    default: return MPI_DATATYPE_NULL;
  }
}

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
#define MPICOLL_DTYPE_NAME_CASE(xla, name, mpi, family) \
    case ffi::DataType::xla: return name;
    MPICOLL_DTYPES(MPICOLL_DTYPE_NAME_CASE)
#undef MPICOLL_DTYPE_NAME_CASE
    default: return "?";
  }
}

// The type numpy calls `name`; INVALID if mpicoll does not move it.
inline ffi::DataType DtypeFromName(const char* name) {
#define MPICOLL_DTYPE_FROM_NAME(xla, text, mpi, family) \
  if (std::strcmp(name, text) == 0) return ffi::DataType::xla;
  MPICOLL_DTYPES(MPICOLL_DTYPE_FROM_NAME)
#undef MPICOLL_DTYPE_FROM_NAME
  return ffi::DataType::INVALID;
}

}  // namespace mpicoll

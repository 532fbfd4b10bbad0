// A test-only entry point: the GPU staging pipeline (memory/staged.h) run on
// host memory with HostCopier, so that CI machines without a GPU test its
// chunking, its 2-D copies across rank blocks, the reuse of its staging
// buffers across calls and its single-rank path, with the same template code
// the CUDA handlers instantiate (tests/test_staged_pipeline.py).
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "../engine/call.h"
#include "../engine/collectives.h"
#include "../engine/dtypes.h"
#include "../engine/execute.h"
#include "../engine/reduce_ops.h"
#include "../memory/host_copier.h"
#include "../memory/staged.h"
#include "staged_entry.h"
#include "../ops.def"
#include "entries.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
namespace {

// Reused across calls, like a device's pinned buffers.
DeviceStaging<HostCopier> host_staging;

template <typename Op>
std::string RunStaged(Call& c, size_t chunk_bytes) {
  if constexpr (Op::kFamily != kBlocks) {
    return std::string("mpicoll: ") + Op::kName + " takes arguments this test entry does not pass";
  } else {
    c.name = Op::kName;
    c.mpi_op = Op::kReduces ? ReductionOp(c.dtype, c.op) : MPI_OP_NULL;
    if (Op::kReduces && c.mpi_op == MPI_OP_NULL) return "mpicoll: unsupported dtype/op";
    const ffi::Error err = ExecuteStaged<Op>(c, /*device=*/0, HostCopier{}, host_staging,
                                             chunk_bytes, [&] {
                                               return std::string(c.name) + "(staged on host, " +
                                                      DtypeName(c.dtype) + ")";
                                             });
    return err.success() ? std::string() : std::string(err.message());
  }
}

}  // namespace

std::string RunStagedOnHost(const char* name, MPI_Comm comm, ffi::DataType dtype, char* in,
                            size_t in_count, char* out, size_t out_count, int root, int64_t op,
                            size_t chunk_bytes) {
  Call c{};
  c.comm = comm;
  c.internal_comm = MPI_COMM_NULL;
  if (MPI_Comm_rank(comm, &c.rank) != MPI_SUCCESS || MPI_Comm_size(comm, &c.size) != MPI_SUCCESS) {
    return "mpicoll: not a communicator";
  }
  c.root = root;
  c.op = op;
  c.dtype = dtype;
  c.type = MpiType(dtype);
  if (c.type == MPI_DATATYPE_NULL) return "mpicoll: unsupported dtype";
  c.elem_bytes = ffi::ByteWidth(dtype);
  c.in = in;
  c.out = out;
  c.in_count = in_count;
  c.out_count = out_count;
#define MPICOLL_STAGED_CASE(Type, text, ...) \
  if (std::strcmp(name, text) == 0) return RunStaged<Type>(c, chunk_bytes);
  MPICOLL_OPS(MPICOLL_STAGED_CASE)
#undef MPICOLL_STAGED_CASE
  return std::string("mpicoll: no collective named ") + name;
}

}  // namespace mpicoll

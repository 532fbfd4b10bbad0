// CudaAwareMemory: XLA's device pointers go to an MPI built with CUDA support.
#pragma once

#include <mpi.h>

#include <type_traits>

#include "../engine/call.h"
#include "../engine/collectives.h"
#include "cuda_driver.h"
#include "host.h"

namespace mpicoll {

// MPI gets XLA's device pointers once the stream has finished the kernels
// that produce the input.
class CudaAwareMemory : public WholeBuffers {
 public:
  explicit CudaAwareMemory(const CudaCopier& copier) : copier_(copier) {}

  template <typename Op>
  int Begin(Call& c) {
    c.device_buffers = true;  // no host-side algorithm (PairwiseReduceScatter) on these
    // The root's input into the one buffer MPI works on (bcast).
    if (kRootFillsOneBuffer<Op> && !InPlace(c) && c.rank == c.root) {
      if (int rc = copier_.Copy(error, c.out, c.in, c.out_count * c.elem_bytes);
          rc != MPI_SUCCESS) {
        return rc;
      }
    }
    return copier_.Synchronize(error);
  }
  template <typename Op>
  int Finish(const Call& c, bool ok) {
    if (!ok || !OutputIsZeros<Op>(c)) return MPI_SUCCESS;
    return copier_.Zero(error, c.out, c.out_count * c.elem_bytes);
  }

 private:
  CudaCopier copier_;
};

}  // namespace mpicoll

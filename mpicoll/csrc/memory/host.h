// HostMemory: the strategy for host buffers (XLA's CPU buffers, or pinned
// staging buffers already filled): they are MPI's buffers.  WholeBuffers is
// what every strategy that hands MPI whole buffers shares.  (The interface a
// strategy implements is described above RunCollective, engine/execute.h.)
#pragma once

#include <mpi.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "../engine/call.h"
#include "../engine/collectives.h"

namespace mpicoll {

// A large output is often memory XLA has just allocated (glibc maps buffers
// this big afresh and unmaps them when freed), so MPI's first write to it
// takes a page fault per 4 KiB page: ~100 ms for 128 MiB here, more than the
// transfer.  Where transparent huge pages are "madvise" (the common default),
// asking for them cuts that to one fault per 2 MiB (a 64 MiB gather went from
// 190 ms to ~30 ms in the benchmark).  Advice only: the memory stays XLA's,
// and nothing changes where THP are off or always on.
inline void AdviseHugePages(char* data, size_t bytes) {
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
  static constexpr bool kHostBuffers = true;  // MPI reads and writes these buffers as they are
  bool advise_huge_pages = true;

  template <typename Op>
  int Begin(Call& c) {
    if (!InPlace(c) && advise_huge_pages) AdviseHugePages(c.out, c.out_count * c.elem_bytes);
    // The root's input into the one buffer MPI works on (bcast).
    if (kRootFillsOneBuffer<Op> && !InPlace(c) && c.rank == c.root) {
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

// A strided copy on host memory: `height` rows of `width` bytes.
inline int HostCopy2D(char* dst, size_t dst_pitch, const char* src, size_t src_pitch, size_t width,
                       size_t height) {
  for (size_t r = 0; r < height; ++r) std::memcpy(dst + r * dst_pitch, src + r * src_pitch, width);
  return MPI_SUCCESS;
}

}  // namespace mpicoll

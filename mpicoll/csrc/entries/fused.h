// Fused calls (pytrees): several arrays of one dtype in one MPI message.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../engine/call.h"
#include "../engine/collectives.h"
#include "../engine/execute.h"
#include "../memory/host.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {

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

}  // namespace mpicoll

// RowsInPlace: the strategy for an exchange whose data MPI reads and writes
// where it already is, in pieces spread over several buffers (the local
// meeting's all_to_all and ppermute: rows in the devices' inputs and outputs,
// meeting/meeting.cc).  For each rank it holds the pieces (address, bytes) of
// what goes to it and of what comes from it, in message order, and runs one
// MPI_Alltoallw whose datatypes name them by absolute address (MPI_BOTTOM).
// (The interface a strategy implements is described above RunCollective,
// engine/execute.h.)
#pragma once

#include <mpi.h>

#include <utility>
#include <vector>

#include "../engine/call.h"
#include "host.h"

namespace mpicoll {

struct RowsInPlace : WholeBuffers {
  static constexpr bool kCallsMpi = false;  // Begin runs the whole exchange
  using Pieces = std::vector<std::pair<const char*, int>>;
  std::vector<Pieces> to, from;
  explicit RowsInPlace(int ranks) : to(ranks), from(ranks) {}

  static int TypeOf(const Pieces& pieces, MPI_Datatype* type) {
    std::vector<int> lengths;
    std::vector<MPI_Aint> at(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      lengths.push_back(pieces[i].second);
      if (int rc = MPI_Get_address(pieces[i].first, &at[i]); rc != MPI_SUCCESS) return rc;
    }
    int rc = MPI_Type_create_hindexed(static_cast<int>(pieces.size()), lengths.data(),
                                      at.data(), MPI_BYTE, type);
    return rc == MPI_SUCCESS ? MPI_Type_commit(type) : rc;
  }

  template <typename Op>
  int Begin(Call& c) {
    const size_t P = to.size();
    std::vector<MPI_Datatype> sends(P, MPI_BYTE), receives(P, MPI_BYTE);
    std::vector<int> send_counts(P, 0), receive_counts(P, 0), displacements(P, 0);
    int rc = MPI_SUCCESS;
    for (size_t r = 0; r < P && rc == MPI_SUCCESS; ++r) {
      if (!to[r].empty() && (rc = TypeOf(to[r], &sends[r])) == MPI_SUCCESS) send_counts[r] = 1;
      if (rc == MPI_SUCCESS && !from[r].empty() &&
          (rc = TypeOf(from[r], &receives[r])) == MPI_SUCCESS) {
        receive_counts[r] = 1;
      }
    }
    if (rc == MPI_SUCCESS) {
      rc = MPI_Alltoallw(MPI_BOTTOM, send_counts.data(), displacements.data(), sends.data(),
                         MPI_BOTTOM, receive_counts.data(), displacements.data(),
                         receives.data(), c.comm);
    }
    for (size_t r = 0; r < P; ++r) {
      if (sends[r] != MPI_BYTE) MPI_Type_free(&sends[r]);
      if (receives[r] != MPI_BYTE) MPI_Type_free(&receives[r]);
    }
    return rc;
  }
  template <typename Op>
  int Finish(const Call&, bool) { return MPI_SUCCESS; }
};

}  // namespace mpicoll

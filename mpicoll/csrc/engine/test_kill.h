// Test-only kill points: a rank of a test job kills itself (SIGKILL) at a named
// moment of mpicoll's own code, so that tests time a death by the program, not by
// sleeps (tests/programs/survive_moments.py).  Inactive unless the test sets
//   MPICOLL_TEST_KILL="moment@rank/recoveries,..."
// (rank: of MPI.COMM_WORLD; recoveries: how many mpicoll.shrink() calls this rank
// has made, so that a moment met again after a shrink can be told apart), and
// optionally MPICOLL_TEST_KILL_LOG, a file each death appends "moment rank ns"
// to (CLOCK_REALTIME), from which the survivors measure how long RankLost took.
// Python's kill points (runtime/faults.py, _test_kill_at) read the same variable.
#pragma once

#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace mpicoll {

// How many times mpicoll.shrink() has gone on with the survivors (FaultRecovered).
inline std::atomic<int> recoveries{0};

// Kills this process where MPICOLL_TEST_KILL names `moment` for this rank now.
inline void TestKillAt(const char* moment) {
  static const char* const wanted = std::getenv("MPICOLL_TEST_KILL");
  if (wanted == nullptr || *wanted == '\0') return;  // the normal case: one load, one branch
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string me = std::string(moment) + "@" + std::to_string(rank) + "/" +
                         std::to_string(recoveries.load());
  const std::string all = std::string(",") + wanted + ",";
  if (all.find("," + me + ",") == std::string::npos) return;
  if (const char* log = std::getenv("MPICOLL_TEST_KILL_LOG"); log && *log) {
    if (std::FILE* file = std::fopen(log, "a")) {
      const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::system_clock::now().time_since_epoch()).count();
      std::fprintf(file, "%s %d %lld\n", moment, rank, static_cast<long long>(now));
      std::fclose(file);
    }
  }
  kill(getpid(), SIGKILL);
}

}  // namespace mpicoll

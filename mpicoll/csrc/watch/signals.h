// Asking a running process for its records from outside: SIGUSR1 (a flight
// dump) and SIGUSR2 (where every rank is).  The handlers only raise a flag;
// the watchdog thread (watchdog.h) writes.
#pragma once

#include <atomic>
#include <csignal>

namespace mpicoll {

// SIGUSR1: a flight dump; SIGUSR2: a report of where every rank is (watchdog.h,
// WriteStacksReport).  Both written by the watchdog thread (no file I/O or MPI
// in a signal handler).  A handler already there is chained to: MPICH installs
// one for SIGUSR1 at MPI_Init (its launcher signals process failures with it),
// and a dump is welcome then too.  A program that sets its own handler later
// (signal.signal) replaces this one.
struct SignalRequests {
  std::atomic<bool> flight_dump{false}, stacks{false};  // asked, not yet written
  struct sigaction previous_sigusr1 = {}, previous_sigusr2 = {};  // chained to
};
inline SignalRequests signal_requests;

inline void ChainTo(const struct sigaction& before, int signal, siginfo_t* info, void* context) {
  if (before.sa_flags & SA_SIGINFO) {
    if (before.sa_sigaction) before.sa_sigaction(signal, info, context);
  } else if (before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN) {
    before.sa_handler(signal);
  }
}

inline void OnSigusr1(int signal, siginfo_t* info, void* context) {
  signal_requests.flight_dump.store(true);
  ChainTo(signal_requests.previous_sigusr1, signal, info, context);
}

inline void OnSigusr2(int signal, siginfo_t* info, void* context) {
  signal_requests.stacks.store(true);
  ChainTo(signal_requests.previous_sigusr2, signal, info, context);
}

inline void InstallSignalHandlers() {
  struct sigaction action = {};
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_SIGINFO;
  action.sa_sigaction = OnSigusr1;
  sigaction(SIGUSR1, &action, &signal_requests.previous_sigusr1);
  action.sa_sigaction = OnSigusr2;
  sigaction(SIGUSR2, &action, &signal_requests.previous_sigusr2);
}

}  // namespace mpicoll

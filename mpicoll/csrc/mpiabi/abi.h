// JAX's own CPU collectives on mpicoll's MPI: what the two sides share.
//
// jaxlib embeds MPItrampoline, which loads the library MPITRAMPOLINE_LIB names
// and calls the MPI ABI ("MPIABI_Allreduce", constants such as
// "MPIABI_COMM_WORLD") through it when jax_cpu_collectives_implementation is
// "mpi".  mpicoll's library (library.cc, built as mpicoll/_mpicoll_mpiabi*.so,
// with no MPI of its own) exports every name jaxlib resolves (names.def) and
// forwards the calls XLA makes to mpicoll's extension, which connects to it at
// mpicoll.distributed.initialize() (jax_calls.cc) and runs them on the job's
// MPI, under mpicoll's watch.  So the library is the same for every MPI, and
// one MPI runs the job.
//
//   * Constants are 8-byte tokens, read by the trampoline as int or pointer
//     (little-endian: an int reads the low half).  The MPI standard's fixed
//     values where XLA relies on them (MPI_SUCCESS is 0, the thread levels are
//     ordered, PROC_NULL/ANY_SOURCE/ANY_TAG/UNDEFINED are negative, null handles
//     and MPI_BOTTOM are 0); every other constant a token made from its name,
//     the same in both units (Token), distinct (checked at compile time).
//   * Handles made at run time (communicators, requests) are pointers to boxes
//     the extension owns, told from the fixed tokens by a magic word.
//
// What the trampoline does (MPItrampoline 5.3.1 in jaxlib 0.10.2 and 0.12.0.1,
// read from its disassembly): it reads MPITRAMPOLINE_LIB (the environment, else
// a global `const char* MPITRAMPOLINE_LIB` symbol) once, in a constructor when
// jaxlib loads; dlopens with RTLD_LAZY | RTLD_DEEPBIND; requires ABI 2.x, x >= 9;
// calls mpiwrapper_export_fortran_constants_(); reads 140 constants as ints and
// 120 as pointers, then the 374 functions, and exit(1)s at the first name it
// cannot find.  XLA's CPU collectives call 15 functions (Init_thread, Comm_rank,
// Comm_size, Is_thread_main, Comm_split, Comm_free, Allreduce, Allgather,
// Reduce_scatter, Sendrecv, Isend, Irecv, Wait, Error_string, Finalize), pass
// MPI_STATUS_IGNORE and never MPI_IN_PLACE, and free their communicators after
// their exit-time Finalize.  With several CPU devices per process XLA asks
// Is_thread_main on each device's thread (the library answers yes: mpicoll's
// MPI is MPI_THREAD_MULTIPLE) and makes each device's communicator itself:
// xla_groups.h makes those groups of devices over the processes.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mpicoll::mpiabi {

// 32-bit FNV-1a of a constant's name, kept in [0x10000000, 0x20000000): positive
// as an int, never 0 or a small fixed value, never a heap address.
constexpr uint64_t HashToken(const char* name) {
  uint32_t hash = 2166136261u;
  for (const char* c = name; *c; ++c) hash = (hash ^ static_cast<uint8_t>(*c)) * 16777619u;
  return 0x10000000u | (hash & 0x0fffffffu);
}

constexpr bool Same(const char* a, const char* b) {
  while (*a && *a == *b) ++a, ++b;
  return *a == *b;
}

constexpr bool EndsWith(const char* name, const char* end) {
  size_t n = 0, m = 0;
  while (name[n]) ++n;
  while (end[m]) ++m;
  return n >= m && Same(name + n - m, end);
}

// The value of constant MPIABI_<name>.
constexpr uint64_t Token(const char* name) {
  constexpr uint64_t kNegative = ~uint64_t{0};  // -1 as 8 bytes (and as its low int)
  if (Same(name, "SUCCESS") || Same(name, "BOTTOM") || Same(name, "THREAD_SINGLE")) return 0;
  if (Same(name, "THREAD_FUNNELED")) return 1;
  if (Same(name, "THREAD_SERIALIZED")) return 2;
  if (Same(name, "THREAD_MULTIPLE")) return 3;
  if (Same(name, "PROC_NULL") || Same(name, "ANY_TAG")) return kNegative;
  if (Same(name, "ANY_SOURCE")) return kNegative - 1;
  if (Same(name, "ROOT")) return kNegative - 2;
  if (Same(name, "UNDEFINED")) return kNegative - 32765;
  if (Same(name, "IN_PLACE")) return kNegative;
  if (Same(name, "STATUS_IGNORE")) return 1;
  if (Same(name, "STATUSES_IGNORE")) return 2;
  if (EndsWith(name, "_NULL") && !Same(name, "MESSAGE_NO_PROC")) return 0;  // null handles
  return HashToken(name);
}

// Runs MPI for the library: filled by the extension (jax_calls.cc), the same
// layout on both sides (kCallsVersion says which).  Handles are the ABI's
// tokens or boxes, passed through; return values are MPI error codes (0:
// success; the extension's own errors are explained by error_string).
constexpr int kCallsVersion = 1;
struct Calls {
  int version;
  int (*comm_rank)(uintptr_t comm, int* rank);
  int (*comm_size)(uintptr_t comm, int* size);
  int (*comm_split)(uintptr_t comm, int color, int key, uintptr_t* made);
  int (*comm_free)(uintptr_t* comm);
  int (*is_thread_main)(int* flag);
  int (*query_thread)(int* level);
  int (*allreduce)(const void* send, void* receive, int count, uintptr_t type, uintptr_t op,
                   uintptr_t comm);
  int (*allgather)(const void* send, int send_count, uintptr_t send_type, void* receive,
                   int receive_count, uintptr_t receive_type, uintptr_t comm);
  int (*reduce_scatter)(const void* send, void* receive, const int* counts, uintptr_t type,
                        uintptr_t op, uintptr_t comm);
  int (*sendrecv)(const void* send, int send_count, uintptr_t send_type, int destination,
                  int send_tag, void* receive, int receive_count, uintptr_t receive_type,
                  int source, int receive_tag, uintptr_t comm, void* status);
  int (*isend)(const void* send, int count, uintptr_t type, int destination, int tag,
               uintptr_t comm, uintptr_t* request);
  int (*irecv)(void* receive, int count, uintptr_t type, int source, int tag, uintptr_t comm,
               uintptr_t* request);
  int (*wait)(uintptr_t* request, void* status);
  int (*barrier)(uintptr_t comm);
  int (*error_string)(int code, char* text, int* length);
  double (*wtime)();
  void (*abort)(int code, const char* why);
};

// The library's entry point for the extension (dlsym'd by name): takes the
// calls, returns 0, or the version it speaks where it is another.
using ConnectFunction = int (*)(const Calls* calls);
constexpr const char* kConnectSymbol = "mpicoll_mpiabi_connect";

// MPItrampoline 5.3.1's MPIABI_Status: 24 bytes of the MPI's own, then the
// public fields (XLA passes MPI_STATUS_IGNORE; a real status is filled anyway).
struct Status {
  uint8_t reserved[24];
  int source, tag, error;
  int pad;
};
static_assert(sizeof(Status) == 40, "MPItrampoline 5.3.1's status is 40 bytes");

}  // namespace mpicoll::mpiabi

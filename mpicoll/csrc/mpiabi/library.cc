// mpicoll's MPI ABI library for jaxlib's MPItrampoline (abi.h says the design):
// built as mpicoll/_mpicoll_mpiabi*.so with no MPI of its own, loaded by the
// trampoline at `import jax` where MPITRAMPOLINE_LIB names it
// (_mpicoll_jax_mpi.py sets it under an MPI launcher).
//
// Every name of names.def is exported: constants as 8-byte tokens, the
// functions XLA's CPU collectives call as forwards to the calls mpicoll's
// extension connects (until it has, they say so and fail), and every other
// function as a report naming it that ends the job: a call nobody expects is
// never a crash with no word.
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "abi.h"

namespace {

using mpicoll::mpiabi::Calls;
using mpicoll::mpiabi::Token;

// The constants' names, for the check that their tokens are distinct.
constexpr const char* kConstants[] = {
#define MPIABI_CONSTANT(name) #name,
#define MPIABI_FUNCTION(name)
#define MPIXABI_FUNCTION(name)
#include "names.def"
#undef MPIABI_CONSTANT
#undef MPIABI_FUNCTION
#undef MPIXABI_FUNCTION
};

constexpr bool HashedTokensDistinct() {
  constexpr size_t n = sizeof(kConstants) / sizeof(kConstants[0]);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t a = Token(kConstants[i]);
    if (a < 0x10000000u || a >= 0x20000000u) continue;  // a fixed value
    for (size_t j = i + 1; j < n; ++j) {
      if (Token(kConstants[j]) == a) return false;
    }
  }
  return true;
}
static_assert(HashedTokensDistinct(), "two MPIABI constants hash to one token");

std::atomic<const Calls*> connected{nullptr};

// Our own error code for "not connected" (error_string explains the others).
constexpr int kNotConnected = 0x7f000001;
constexpr const char* kNotConnectedText =
    "mpicoll: JAX's CPU collectives were set to \"mpi\" without mpicoll: they run on "
    "mpicoll's MPI once mpicoll.distributed.initialize() has run (docs/jax-vocabulary.md)";

const Calls* Need(const char* name) {
  const Calls* calls = connected.load(std::memory_order_acquire);
  if (!calls) std::fprintf(stderr, "%s (XLA called MPI_%s)\n", kNotConnectedText, name);
  return calls;
}

}  // namespace

// (unsupported.cc's stubs call it.)
[[noreturn]] void MpiabiUnsupported(const char* name) {
  char why[512];
  std::snprintf(why, sizeof(why),
                "mpicoll: JAX's CPU collectives called MPI_%s, which mpicoll's MPI ABI library "
                "does not provide (it runs what XLA's collectives call: Allreduce, Allgather, "
                "Reduce_scatter, Sendrecv, Isend, Irecv, Wait, Comm_split); ending the job",
                name);
  std::fprintf(stderr, "%s\n", why);
  std::fflush(stderr);
  const Calls* calls = connected.load(std::memory_order_acquire);
  if (calls) calls->abort(70, why);
  std::abort();
}

extern "C" {

#define MPICOLL_EXPORT __attribute__((visibility("default")))

// What the trampoline checks first: this ABI's version (2.9, MPItrampoline 5's),
// then it calls the Fortran constants' export (there is no Fortran here).
MPICOLL_EXPORT extern const int mpiwrapper_version_major = 2;
MPICOLL_EXPORT extern const int mpiwrapper_version_minor = 9;
MPICOLL_EXPORT extern const int mpiwrapper_version_patch = 0;
MPICOLL_EXPORT extern const int mpiabi_version_major = 2;
MPICOLL_EXPORT extern const int mpiabi_version_minor = 9;
MPICOLL_EXPORT extern const int mpiabi_version_patch = 0;
MPICOLL_EXPORT void mpiwrapper_export_fortran_constants_() {}

#define MPIABI_CONSTANT(name) \
  MPICOLL_EXPORT extern const uint64_t MPIABI_##name = Token(#name);
#define MPIABI_FUNCTION(name)
#define MPIXABI_FUNCTION(name)
#include "names.def"
#undef MPIABI_CONSTANT
#undef MPIABI_FUNCTION
#undef MPIXABI_FUNCTION

// The extension's entry point: abi.h's kConnectSymbol.
MPICOLL_EXPORT int mpicoll_mpiabi_connect(const Calls* calls) {
  if (calls && calls->version != mpicoll::mpiabi::kCallsVersion) {
    return mpicoll::mpiabi::kCallsVersion;
  }
  connected.store(calls, std::memory_order_release);
  return 0;
}

// --- What XLA's CPU collectives call (xla/backends/cpu/collectives/mpi_*.cc) -----------

// MPI is mpi4py's, initialized at `import mpicoll`: XLA's Init_thread and
// Finalize neither start nor end it (mpi4py finalizes it at exit).
MPICOLL_EXPORT int MPIABI_Init_thread(int*, char***, int, int* provided) {
  const Calls* calls = Need("Init_thread");
  if (!calls) return kNotConnected;
  return calls->query_thread(provided);
}
MPICOLL_EXPORT int MPIABI_Init(int*, char***) {
  return Need("Init") ? 0 : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Initialized(int* flag) {
  *flag = connected.load() != nullptr;
  return 0;
}
MPICOLL_EXPORT int MPIABI_Finalized(int* flag) {
  *flag = 0;
  return 0;
}
MPICOLL_EXPORT int MPIABI_Finalize() { return 0; }
MPICOLL_EXPORT int MPIABI_Query_thread(int* level) {
  const Calls* calls = Need("Query_thread");
  return calls ? calls->query_thread(level) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Is_thread_main(int* flag) {
  const Calls* calls = Need("Is_thread_main");
  return calls ? calls->is_thread_main(flag) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Comm_rank(uintptr_t comm, int* rank) {
  const Calls* calls = Need("Comm_rank");
  return calls ? calls->comm_rank(comm, rank) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Comm_size(uintptr_t comm, int* size) {
  const Calls* calls = Need("Comm_size");
  return calls ? calls->comm_size(comm, size) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Comm_split(uintptr_t comm, int color, int key, uintptr_t* made) {
  const Calls* calls = Need("Comm_split");
  return calls ? calls->comm_split(comm, color, key, made) : kNotConnected;
}
// XLA frees its communicators in a destructor that may run after exit's
// finalize: the extension checks.
MPICOLL_EXPORT int MPIABI_Comm_free(uintptr_t* comm) {
  const Calls* calls = connected.load(std::memory_order_acquire);
  return calls ? calls->comm_free(comm) : 0;
}
MPICOLL_EXPORT int MPIABI_Allreduce(const void* send, void* receive, int count, uintptr_t type,
                                    uintptr_t op, uintptr_t comm) {
  const Calls* calls = Need("Allreduce");
  return calls ? calls->allreduce(send, receive, count, type, op, comm) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Allgather(const void* send, int send_count, uintptr_t send_type,
                                    void* receive, int receive_count, uintptr_t receive_type,
                                    uintptr_t comm) {
  const Calls* calls = Need("Allgather");
  return calls ? calls->allgather(send, send_count, send_type, receive, receive_count,
                                  receive_type, comm)
               : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Reduce_scatter(const void* send, void* receive, const int* counts,
                                         uintptr_t type, uintptr_t op, uintptr_t comm) {
  const Calls* calls = Need("Reduce_scatter");
  return calls ? calls->reduce_scatter(send, receive, counts, type, op, comm) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Sendrecv(const void* send, int send_count, uintptr_t send_type,
                                   int destination, int send_tag, void* receive,
                                   int receive_count, uintptr_t receive_type, int source,
                                   int receive_tag, uintptr_t comm, void* status) {
  const Calls* calls = Need("Sendrecv");
  return calls ? calls->sendrecv(send, send_count, send_type, destination, send_tag, receive,
                                 receive_count, receive_type, source, receive_tag, comm, status)
               : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Isend(const void* send, int count, uintptr_t type, int destination,
                                int tag, uintptr_t comm, uintptr_t* request) {
  const Calls* calls = Need("Isend");
  return calls ? calls->isend(send, count, type, destination, tag, comm, request)
               : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Irecv(void* receive, int count, uintptr_t type, int source, int tag,
                                uintptr_t comm, uintptr_t* request) {
  const Calls* calls = Need("Irecv");
  return calls ? calls->irecv(receive, count, type, source, tag, comm, request)
               : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Wait(uintptr_t* request, void* status) {
  const Calls* calls = Need("Wait");
  return calls ? calls->wait(request, status) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Barrier(uintptr_t comm) {
  const Calls* calls = Need("Barrier");
  return calls ? calls->barrier(comm) : kNotConnected;
}
MPICOLL_EXPORT int MPIABI_Error_string(int code, char* text, int* length) {
  if (code == kNotConnected) {
    std::snprintf(text, 1024, "%s", kNotConnectedText);  // MPI_MAX_ERROR_STRING: 1024 there
    *length = static_cast<int>(std::strlen(text));
    return 0;
  }
  const Calls* calls = connected.load(std::memory_order_acquire);
  if (!calls) {
    *length = std::snprintf(text, 1024, "MPI error %d", code);
    return 0;
  }
  return calls->error_string(code, text, length);
}
MPICOLL_EXPORT double MPIABI_Wtime() {
  const Calls* calls = connected.load(std::memory_order_acquire);
  return calls ? calls->wtime() : 0.0;
}
MPICOLL_EXPORT int MPIABI_Abort(uintptr_t, int code) {
  const Calls* calls = connected.load(std::memory_order_acquire);
  if (calls) calls->abort(code, "MPI_Abort called through JAX's MPI collectives");
  std::abort();
}
MPICOLL_EXPORT int MPIABI_Get_version(int* version, int* subversion) {
  *version = 3;
  *subversion = 1;
  return 0;
}
MPICOLL_EXPORT int MPIABI_Get_library_version(char* text, int* length) {
  *length = std::snprintf(text, 8192, "mpicoll's MPI ABI library (the job's MPI, through mpicoll)");
  return 0;
}

// No GPU memory through this path (XLA:CPU's collectives only).
MPICOLL_EXPORT int MPIXABI_Query_cuda_support() { return 0; }
MPICOLL_EXPORT int MPIXABI_Query_hip_support() { return 0; }
MPICOLL_EXPORT int MPIXABI_Query_ze_support() { return 0; }

}  // extern "C"

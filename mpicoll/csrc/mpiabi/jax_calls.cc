// The extension's side of JAX's CPU collectives on mpicoll's MPI (abi.h says
// the design): the calls mpicoll's MPI ABI library forwards, on the job's MPI,
// and connect_jax_mpi(), which hands them to the library jaxlib's trampoline
// loaded.  XLA's collectives get a communicator of their own, a duplicate of
// COMM_WORLD made at connection (every rank, in mpicoll.distributed.initialize),
// so their messages never meet the program's or mpicoll's own.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "abi.h"
#include "jax_calls.h"

namespace mpicoll {
namespace {

using mpiabi::Token;

// Errors of this side, explained by ErrorString (MPI's own codes pass through).
constexpr int kUnknownHandle = 0x7f000010;
constexpr int kUnsupportedType = 0x7f000011;
constexpr int kUnsupportedOp = 0x7f000012;

constexpr uint64_t kCommMagic = 0x6d70636f6c6c436dull;     // "mpcollCm"
constexpr uint64_t kRequestMagic = 0x6d70636f6c6c5271ull;  // "mpcollRq"

struct CommBox {
  uint64_t magic = kCommMagic;
  MPI_Comm comm = MPI_COMM_NULL;
};
struct RequestBox {
  uint64_t magic = kRequestMagic;
  MPI_Request request = MPI_REQUEST_NULL;
};

MPI_Comm jax_world = MPI_COMM_NULL;  // XLA's COMM_WORLD: set once, at connection

bool Finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

bool CommOf(uintptr_t token, MPI_Comm* comm) {
  if (token == Token("COMM_WORLD")) {
    *comm = jax_world;
    return true;
  }
  if (token == Token("COMM_SELF")) {
    *comm = MPI_COMM_SELF;
    return true;
  }
  const auto* box = reinterpret_cast<const CommBox*>(token);
  if (token == 0 || box->magic != kCommMagic) return false;
  *comm = box->comm;
  return true;
}

// The datatypes XLA's collectives pass (S8..U64, PRED as UINT8_T, F32, F64, C64,
// C128), MPI_BYTE for its raw copies, and the C types beside them.
bool TypeOf(uintptr_t token, MPI_Datatype* type) {
  struct Pair {
    uint64_t token;
    MPI_Datatype type;
  };
  static const Pair pairs[] = {
      {Token("BYTE"), MPI_BYTE},         {Token("CHAR"), MPI_CHAR},
      {Token("INT8_T"), MPI_INT8_T},     {Token("UINT8_T"), MPI_UINT8_T},
      {Token("INT16_T"), MPI_INT16_T},   {Token("UINT16_T"), MPI_UINT16_T},
      {Token("INT32_T"), MPI_INT32_T},   {Token("UINT32_T"), MPI_UINT32_T},
      {Token("INT64_T"), MPI_INT64_T},   {Token("UINT64_T"), MPI_UINT64_T},
      {Token("INT"), MPI_INT},           {Token("LONG"), MPI_LONG},
      {Token("FLOAT"), MPI_FLOAT},       {Token("DOUBLE"), MPI_DOUBLE},
      {Token("C_BOOL"), MPI_C_BOOL},     {Token("C_COMPLEX"), MPI_C_COMPLEX},
      {Token("C_FLOAT_COMPLEX"), MPI_C_FLOAT_COMPLEX},
      {Token("C_DOUBLE_COMPLEX"), MPI_C_DOUBLE_COMPLEX},
  };
  for (const Pair& p : pairs) {
    if (p.token == token) {
      *type = p.type;
      return true;
    }
  }
  return false;
}

bool OpOf(uintptr_t token, MPI_Op* op) {
  struct Pair {
    uint64_t token;
    MPI_Op op;
  };
  static const Pair pairs[] = {
      {Token("SUM"), MPI_SUM},   {Token("PROD"), MPI_PROD}, {Token("MIN"), MPI_MIN},
      {Token("MAX"), MPI_MAX},   {Token("LAND"), MPI_LAND}, {Token("LOR"), MPI_LOR},
      {Token("BAND"), MPI_BAND}, {Token("BOR"), MPI_BOR},   {Token("LXOR"), MPI_LXOR},
      {Token("BXOR"), MPI_BXOR},
  };
  for (const Pair& p : pairs) {
    if (p.token == token) {
      *op = p.op;
      return true;
    }
  }
  return false;
}

// A rank or tag as the ABI's constants spell them (ints: PROC_NULL and ANY_TAG
// are -1, ANY_SOURCE -2).
int RankOf(int rank) {
  if (rank == static_cast<int>(Token("PROC_NULL"))) return MPI_PROC_NULL;
  if (rank == static_cast<int>(Token("ANY_SOURCE"))) return MPI_ANY_SOURCE;
  return rank;
}
int TagOf(int tag) { return tag == static_cast<int>(Token("ANY_TAG")) ? MPI_ANY_TAG : tag; }

const void* SendOf(const void* send) {
  return reinterpret_cast<uintptr_t>(send) == Token("IN_PLACE") ? MPI_IN_PLACE : send;
}

// Fills the ABI's status (STATUS_IGNORE: nothing) from MPI's.
void StatusOut(void* status, const MPI_Status& real) {
  if (reinterpret_cast<uintptr_t>(status) == Token("STATUS_IGNORE") || status == nullptr) return;
  mpiabi::Status out = {};
  out.source = real.MPI_SOURCE;
  out.tag = real.MPI_TAG;
  out.error = real.MPI_ERROR;
  std::memcpy(status, &out, sizeof(out));
}

// --- The calls (abi.h's Calls) ---------------------------------------------------------

int CommRank(uintptr_t token, int* rank) {
  MPI_Comm comm;
  return CommOf(token, &comm) ? MPI_Comm_rank(comm, rank) : kUnknownHandle;
}

int CommSize(uintptr_t token, int* size) {
  MPI_Comm comm;
  return CommOf(token, &comm) ? MPI_Comm_size(comm, size) : kUnknownHandle;
}

int CommSplit(uintptr_t token, int color, int key, uintptr_t* made) {
  MPI_Comm comm;
  if (!CommOf(token, &comm)) return kUnknownHandle;
  if (color == static_cast<int>(Token("UNDEFINED"))) color = MPI_UNDEFINED;
  MPI_Comm split = MPI_COMM_NULL;
  const int rc = MPI_Comm_split(comm, color, key, &split);
  if (rc != MPI_SUCCESS) return rc;
  if (split == MPI_COMM_NULL) {
    *made = Token("COMM_NULL");
    return MPI_SUCCESS;
  }
  auto* box = new CommBox;
  box->comm = split;
  *made = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

// XLA's communicators are freed by a destructor that may run after MPI was
// finalized at exit: then only the box goes.
int CommFree(uintptr_t* token) {
  auto* box = reinterpret_cast<CommBox*>(*token);
  if (*token == 0 || box->magic != kCommMagic) return kUnknownHandle;
  if (!Finalized()) MPI_Comm_free(&box->comm);
  box->magic = 0;
  delete box;
  *token = Token("COMM_NULL");
  return MPI_SUCCESS;
}

int IsThreadMain(int* flag) { return MPI_Is_thread_main(flag); }
int QueryThread(int* level) { return MPI_Query_thread(level); }

int Allreduce(const void* send, void* receive, int count, uintptr_t type_token,
              uintptr_t op_token, uintptr_t comm_token) {
  MPI_Comm comm;
  MPI_Datatype type;
  MPI_Op op;
  if (!CommOf(comm_token, &comm)) return kUnknownHandle;
  if (!TypeOf(type_token, &type)) return kUnsupportedType;
  if (!OpOf(op_token, &op)) return kUnsupportedOp;
  return MPI_Allreduce(send == receive ? MPI_IN_PLACE : SendOf(send), receive, count, type, op,
                       comm);
}

int Allgather(const void* send, int send_count, uintptr_t send_token, void* receive,
              int receive_count, uintptr_t receive_token, uintptr_t comm_token) {
  MPI_Comm comm;
  MPI_Datatype send_type, receive_type;
  if (!CommOf(comm_token, &comm)) return kUnknownHandle;
  if (!TypeOf(send_token, &send_type) || !TypeOf(receive_token, &receive_type)) {
    return kUnsupportedType;
  }
  return MPI_Allgather(SendOf(send), send_count, send_type, receive, receive_count,
                       receive_type, comm);
}

int ReduceScatter(const void* send, void* receive, const int* counts, uintptr_t type_token,
                  uintptr_t op_token, uintptr_t comm_token) {
  MPI_Comm comm;
  MPI_Datatype type;
  MPI_Op op;
  if (!CommOf(comm_token, &comm)) return kUnknownHandle;
  if (!TypeOf(type_token, &type)) return kUnsupportedType;
  if (!OpOf(op_token, &op)) return kUnsupportedOp;
  return MPI_Reduce_scatter(SendOf(send), receive, counts, type, op, comm);
}

int Sendrecv(const void* send, int send_count, uintptr_t send_token, int destination,
             int send_tag, void* receive, int receive_count, uintptr_t receive_token, int source,
             int receive_tag, uintptr_t comm_token, void* status) {
  MPI_Comm comm;
  MPI_Datatype send_type, receive_type;
  if (!CommOf(comm_token, &comm)) return kUnknownHandle;
  if (!TypeOf(send_token, &send_type) || !TypeOf(receive_token, &receive_type)) {
    return kUnsupportedType;
  }
  MPI_Status real;
  const int rc = MPI_Sendrecv(send, send_count, send_type, RankOf(destination), TagOf(send_tag),
                              receive, receive_count, receive_type, RankOf(source),
                              TagOf(receive_tag), comm, &real);
  if (rc == MPI_SUCCESS) StatusOut(status, real);
  return rc;
}

// A nonblocking call (`start`: MPI_Isend or MPI_Irecv with its buffer and
// peer bound) on the ABI's handles; its request boxed for Wait.
template <typename Start>
int StartRequest(uintptr_t type_token, uintptr_t comm_token, uintptr_t* request, Start start) {
  MPI_Comm comm;
  MPI_Datatype type;
  if (!CommOf(comm_token, &comm)) return kUnknownHandle;
  if (!TypeOf(type_token, &type)) return kUnsupportedType;
  auto* box = new RequestBox;
  const int rc = start(type, comm, &box->request);
  if (rc != MPI_SUCCESS) {
    delete box;
    return rc;
  }
  *request = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

int Isend(const void* send, int count, uintptr_t type_token, int destination, int tag,
          uintptr_t comm_token, uintptr_t* request) {
  return StartRequest(type_token, comm_token, request,
                      [&](MPI_Datatype type, MPI_Comm comm, MPI_Request* made) {
                        return MPI_Isend(send, count, type, RankOf(destination), TagOf(tag),
                                         comm, made);
                      });
}

int Irecv(void* receive, int count, uintptr_t type_token, int source, int tag,
          uintptr_t comm_token, uintptr_t* request) {
  return StartRequest(type_token, comm_token, request,
                      [&](MPI_Datatype type, MPI_Comm comm, MPI_Request* made) {
                        return MPI_Irecv(receive, count, type, RankOf(source), TagOf(tag), comm,
                                         made);
                      });
}

int Wait(uintptr_t* request, void* status) {
  if (*request == Token("REQUEST_NULL")) return MPI_SUCCESS;
  auto* box = reinterpret_cast<RequestBox*>(*request);
  if (box->magic != kRequestMagic) return kUnknownHandle;
  MPI_Status real;
  const int rc = MPI_Wait(&box->request, &real);
  if (rc == MPI_SUCCESS) StatusOut(status, real);
  box->magic = 0;
  delete box;
  *request = Token("REQUEST_NULL");
  return rc;
}

int Barrier(uintptr_t comm_token) {
  MPI_Comm comm;
  return CommOf(comm_token, &comm) ? MPI_Barrier(comm) : kUnknownHandle;
}

int ErrorString(int code, char* text, int* length) {
  const char* ours = code == kUnknownHandle ? "mpicoll: a handle JAX's collectives passed is "
                                              "not one mpicoll's MPI ABI library made"
                     : code == kUnsupportedType
                         ? "mpicoll: JAX's collectives passed an MPI datatype mpicoll's MPI "
                           "ABI library does not map (it maps the integer, float and complex "
                           "types XLA's CPU collectives use)"
                     : code == kUnsupportedOp
                         ? "mpicoll: JAX's collectives passed a reduction mpicoll's MPI ABI "
                           "library does not map"
                         : nullptr;
  if (ours) {
    *length = std::snprintf(text, 1024, "%s", ours);  // the trampoline's MPI_MAX_ERROR_STRING
    return MPI_SUCCESS;
  }
  char real[MPI_MAX_ERROR_STRING];
  int real_length = 0;
  if (MPI_Error_string(code, real, &real_length) != MPI_SUCCESS) {
    *length = std::snprintf(text, 1024, "MPI error %d", code);
    return MPI_SUCCESS;
  }
  *length = std::snprintf(text, 1024, "%.*s", real_length, real);
  return MPI_SUCCESS;
}

double Wtime() { return MPI_Wtime(); }

[[noreturn]] void Abort(int code, const char* why) {
  std::fprintf(stderr, "%s\n", why);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();
}

const mpiabi::Calls calls = {
    mpiabi::kCallsVersion, CommRank, CommSize, CommSplit, CommFree, IsThreadMain,
    QueryThread, Allreduce, Allgather, ReduceScatter, Sendrecv, Isend, Irecv, Wait, Barrier,
    ErrorString, Wtime, Abort,
};

// The library at `path` if this process has loaded it (the trampoline did, at
// `import jax`), and its entry point; else why not.
mpiabi::ConnectFunction LoadedLibrary(const char* path, void** library, std::string* why) {
  *library = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
  if (!*library) {
    *why = "jaxlib's MPItrampoline has not loaded it";
    return nullptr;
  }
  auto connect =
      reinterpret_cast<mpiabi::ConnectFunction>(dlsym(*library, mpiabi::kConnectSymbol));
  if (!connect) {
    dlclose(*library);
    *why = "the loaded library has no mpicoll_mpiabi_connect";
  }
  return connect;
}

// jax_mpi_library_problem(path) -> "" where the library at `path` is loaded
// and connectable, else why not (no MPI call: each rank asks for itself).
PyObject* JaxMpiLibraryProblem(PyObject*, PyObject* arg) {
  const char* path = PyUnicode_AsUTF8(arg);
  if (!path) return nullptr;
  void* library = nullptr;
  std::string why;
  if (LoadedLibrary(path, &library, &why)) dlclose(library);
  return PyUnicode_FromString(why.c_str());
}

// connect_jax_mpi(path) -> "" or why not: hands the calls to the library at
// `path` (loaded: jax_mpi_library_problem said so on every rank), after
// duplicating COMM_WORLD for XLA (collective: every rank calls it).
PyObject* ConnectJaxMpi(PyObject*, PyObject* arg) {
  const char* path = PyUnicode_AsUTF8(arg);
  if (!path) return nullptr;
  void* library = nullptr;
  std::string why;
  const mpiabi::ConnectFunction connect = LoadedLibrary(path, &library, &why);
  if (!connect) return PyUnicode_FromString(why.c_str());
  int rc = MPI_SUCCESS;
  Py_BEGIN_ALLOW_THREADS
  if (jax_world == MPI_COMM_NULL) rc = MPI_Comm_dup(MPI_COMM_WORLD, &jax_world);
  Py_END_ALLOW_THREADS
  if (rc != MPI_SUCCESS) return PyUnicode_FromString("MPI_Comm_dup of COMM_WORLD failed");
  MPI_Comm_set_name(jax_world, "mpicoll:JAX's CPU collectives");
  const int spoken = connect(&calls);
  dlclose(library);  // the trampoline holds it
  if (spoken != 0) {
    return PyUnicode_FromFormat("the loaded library speaks version %d of the calls, this "
                                "extension %d (rebuild mpicoll)", spoken, mpiabi::kCallsVersion);
  }
  return PyUnicode_FromString("");
}

}  // namespace

PyMethodDef jax_mpi_methods[] = {
    {"jax_mpi_library_problem", JaxMpiLibraryProblem, METH_O,
     "(path of mpicoll's MPI ABI library) -> '' where jaxlib's trampoline loaded it, else why "
     "not."},
    {"connect_jax_mpi", ConnectJaxMpi, METH_O,
     "(path of mpicoll's MPI ABI library) -> '' or why JAX's CPU collectives cannot run on "
     "mpicoll's MPI; collective."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace mpicoll

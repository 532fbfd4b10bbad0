// The extension's side of JAX's CPU collectives on mpicoll's MPI (abi.h says
// the design): the calls mpicoll's MPI ABI library forwards, on the job's MPI,
// and connect_jax_mpi(), which hands them to the library jaxlib's trampoline
// loaded.  XLA's collectives get a communicator of their own, a duplicate of
// COMM_WORLD made at connection (every rank, in mpicoll.distributed.initialize),
// so their messages never meet the program's or mpicoll's own.
//
// Every call XLA makes that can wait for another rank runs under mpicoll's
// watch (watch/guard.h), in its own slot (kXlaSlot): the timeout, the stall
// report, the flight records and the check across ranks cover it as they
// cover mpicoll's own collectives, named for what XLA inserted ("all-reduce
// (float32[8], op=sum), inserted by XLA").  A failure reaches XLA as an error
// code whose text (ErrorString) is the watch's message, which XLA raises.
//
// The handles' translation is xla_handles.h, the watch xla_watched.h, the calls
// of several devices per process xla_group_calls.h; this file holds the calls
// themselves (abi.h's Calls) and the connection.
#define PY_SSIZE_T_CLEAN

#include <Python.h>
#include <dlfcn.h>
#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "../engine/call.h"
#include "../engine/comm_table.h"
#include "../watch/guard.h"
#include "../watch/rank_state.h"
#include "abi.h"
#include "jax_calls.h"
#include "xla_group_calls.h"
#include "xla_groups.h"
#include "xla_handles.h"
#include "xla_watched.h"

namespace mpicoll {
namespace {

using namespace jax_mpi;  // NOLINT: this file is the one user of the three headers

int CommRank(uintptr_t token, int* rank) {
  if (token == Token("COMM_SELF")) return MPI_Comm_rank(MPI_COMM_SELF, rank);
  const CommBox* box = CommOf(token);
  if (!box) return kUnknownHandle;
  *rank = box->rank;
  return MPI_SUCCESS;
}

int CommSize(uintptr_t token, int* size) {
  if (token == Token("COMM_SELF")) return MPI_Comm_size(MPI_COMM_SELF, size);
  const CommBox* box = CommOf(token);
  if (!box) return kUnknownHandle;
  *size = box->size;
  return MPI_SUCCESS;
}

// Fills `box` for `comm` (its rank, size, watch key, the checks' duplicate),
// named `name` for the reports.  Collective over `comm`.
int Boxed(MPI_Comm comm, const std::string& name, CommBox* box) {
  box->comm = comm;
  Key(box);
  MPI_Comm_set_name(comm, name.c_str());
  int rc = MPI_Comm_rank(comm, &box->rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(comm, &box->size);
  if (rc == MPI_SUCCESS && box->size > 1) rc = MPI_Comm_dup(comm, &box->internal);
  return rc;
}

int CommSplit(uintptr_t token, int color, int key, uintptr_t* made) {
  const CommBox* parent = CommOf(token);
  if (!parent) return kUnknownHandle;
  if (color == static_cast<int>(Token("UNDEFINED"))) color = MPI_UNDEFINED;
  if (splits.local_devices > 1) {
    if (parent != &jax_world || color == MPI_UNDEFINED) return kUnknownHandle;
    return GroupSplit(color, key, made);
  }
  Call c = XlaCall("communicator split", *parent, TypeFacts{MPI_INT, ffi::DataType::S32, 4}, 0,
                   nullptr, nullptr);
  auto* box = new CommBox;
  // Named in split order, the same on every rank (each makes XLA's communicators
  // in its program's order): two groups led by one device are told apart.
  static int splits_made = 0;
  const std::string group = "mpicoll:XLA's communicator " + std::to_string(++splits_made) +
                            " (group led by device " + std::to_string(color) + ")";
  const int rc = Watched(c, *parent, Kind::kCollective, "communicator split(), made by XLA", [&] {
    MPI_Comm split = MPI_COMM_NULL;
    int rc = MPI_Comm_split(parent->comm, color, key, &split);
    if (rc == MPI_SUCCESS && split != MPI_COMM_NULL) rc = Boxed(split, group, box);
    return rc;
  });
  if (rc != MPI_SUCCESS || box->comm == MPI_COMM_NULL) {
    delete box;
    *made = Token("COMM_NULL");
    return rc;
  }
  *made = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

// XLA's communicators are freed by a destructor that may run after MPI was
// finalized at exit: then only the box goes.
int CommFree(uintptr_t* token) {
  auto* box = reinterpret_cast<CommBox*>(*token);
  if (*token == 0 || box == &jax_world || box->magic != kCommMagic) return kUnknownHandle;
  // A device's box in a group of several devices per process shares the
  // group's communicators, kept for the process (xla_groups.h).
  if (!Finalized() && !box->place.group) {
    if (box->internal != MPI_COMM_NULL) MPI_Comm_free(&box->internal);
    MPI_Comm_free(&box->comm);
  }
  box->magic = 0;
  delete box;
  *token = Token("COMM_NULL");
  return MPI_SUCCESS;
}

// XLA asks before it makes a communicator, and refuses a thread MPI does not
// call its main one; mpicoll's MPI takes calls from any thread
// (MPI_THREAD_MULTIPLE: jax_transport.py keeps gloo otherwise), and with
// several devices each device's thread makes its own.
int IsThreadMain(int* flag) {
  *flag = 1;
  return MPI_SUCCESS;
}
int QueryThread(int* level) { return MPI_Query_thread(level); }

int Allreduce(const void* send, void* receive, int count, uintptr_t type_token,
              uintptr_t op_token, uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts type;
  MPI_Op op;
  const char* op_name = nullptr;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(type_token, &type)) return kUnsupportedType;
  if (!OpOf(op_token, &op, &op_name)) return kUnsupportedOp;
  if (comm->place.group) return GroupAllreduce(*comm, send, receive, count, type, op, op_name);
  Call c = XlaCall("all-reduce", *comm, type, count, send, receive);
  return Watched(c, *comm, Kind::kCompared, Described(c, op_name), [&] {
    return MPI_Allreduce(send == receive ? MPI_IN_PLACE : SendOf(send), receive, count,
                         type.mpi, op, comm->comm);
  });
}

int Allgather(const void* send, int send_count, uintptr_t send_token, void* receive,
              int receive_count, uintptr_t receive_token, uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts send_type, receive_type;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(send_token, &send_type) || !TypeOf(receive_token, &receive_type)) {
    return kUnsupportedType;
  }
  if (comm->place.group) return GroupAllgather(*comm, send, send_count, send_type, receive);
  Call c = XlaCall("all-gather", *comm, send_type, send_count, send, receive);
  return Watched(c, *comm, Kind::kCompared, Described(c, nullptr), [&] {
    return MPI_Allgather(SendOf(send), send_count, send_type.mpi, receive, receive_count,
                         receive_type.mpi, comm->comm);
  });
}

int ReduceScatter(const void* send, void* receive, const int* counts, uintptr_t type_token,
                  uintptr_t op_token, uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts type;
  MPI_Op op;
  const char* op_name = nullptr;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(type_token, &type)) return kUnsupportedType;
  if (!OpOf(op_token, &op, &op_name)) return kUnsupportedOp;
  if (comm->place.group) {
    return GroupReduceScatter(*comm, send, receive, counts, type, op, op_name);
  }
  size_t total = 0;
  bool equal = true;
  for (int r = 0; r < comm->size; ++r) {
    total += static_cast<size_t>(counts[r]);
    equal = equal && counts[r] == counts[0];
  }
  Call c = XlaCall("reduce-scatter", *comm, type, total, send, receive);
  std::string more;
  if (!equal) {
    more = ", counts=(";
    for (int r = 0; r < comm->size; ++r) more += (r ? "," : "") + std::to_string(counts[r]);
    more += ")";
  }
  return Watched(c, *comm, Kind::kCompared, Described(c, op_name, more), [&] {
    return MPI_Reduce_scatter(SendOf(send), receive, counts, type.mpi, op, comm->comm);
  });
}

// One pair of all-to-all's exchange (XLA sends to one rank and receives from
// another in each step): a point-to-point call for the watch.
int Sendrecv(const void* send, int send_count, uintptr_t send_token, int destination,
             int send_tag, void* receive, int receive_count, uintptr_t receive_token, int source,
             int receive_tag, uintptr_t comm_token, void* status) {
  const CommBox* comm = CommOf(comm_token);
  TypeFacts send_type, receive_type;
  if (!comm) return kUnknownHandle;
  if (!TypeOf(send_token, &send_type) || !TypeOf(receive_token, &receive_type)) {
    return kUnsupportedType;
  }
  Route to{RankOf(destination), TagOf(send_tag)}, from{RankOf(source), TagOf(receive_tag)};
  MPI_Comm on = comm->comm;
  if (comm->place.group) {
    if (!RoutesOf(*comm, destination, source, &to, &from)) return kUnknownHandle;
    on = comm->place.group->messages;
  }
  Call c = XlaCall("sendrecv", *comm, send_type, send_count, send, receive);
  c.comm = on;
  const std::string more = ", to rank " + std::to_string(destination) + ", from rank " +
                           std::to_string(source);
  MPI_Status real;
  const int rc = Watched(c, *comm, Kind::kPointToPoint, Described(c, nullptr, more), [&] {
    return MPI_Sendrecv(send, send_count, send_type.mpi, to.process, to.tag, receive,
                        receive_count, receive_type.mpi, from.process, from.tag, on, &real);
  });
  if (rc == MPI_SUCCESS) StatusOut(status, real);
  return rc;
}

// A nonblocking call (`start`: MPI_Isend or MPI_Irecv with its buffer and
// peer bound) on the ABI's handles; its request boxed for Wait, which is
// where it is watched.
template <typename Start>
int StartRequest(uintptr_t type_token, uintptr_t comm_token, int count, int peer, bool sends,
                 uintptr_t* request, Start start) {
  auto* box = new RequestBox;
  box->comm = CommOf(comm_token);
  if (!box->comm || !TypeOf(type_token, &box->type)) {
    const int rc = box->comm ? kUnsupportedType : kUnknownHandle;
    delete box;
    return rc;
  }
  box->count = count;
  box->peer = peer;
  box->sends = sends;
  Route route{RankOf(peer), 0};
  MPI_Comm on = box->comm->comm;
  if (box->comm->place.group) {
    Route unused;
    const int none = static_cast<int>(Token("PROC_NULL"));  // the ABI's, as XLA passes it
    const bool routed = sends ? RoutesOf(*box->comm, peer, none, &route, &unused)
                              : RoutesOf(*box->comm, none, peer, &unused, &route);
    if (!routed) {
      delete box;
      return kUnknownHandle;
    }
    on = box->comm->place.group->messages;
  }
  const int rc = start(box->type.mpi, on, route, &box->request);
  if (rc != MPI_SUCCESS) {
    delete box;
    return rc;
  }
  *request = reinterpret_cast<uintptr_t>(box);
  return MPI_SUCCESS;
}

int Isend(const void* send, int count, uintptr_t type_token, int destination, int tag,
          uintptr_t comm_token, uintptr_t* request) {
  return StartRequest(type_token, comm_token, count, destination, true, request,
                      [&](MPI_Datatype type, MPI_Comm comm, Route route, MPI_Request* made) {
                        const bool grouped = comm != CommOf(comm_token)->comm;
                        return MPI_Isend(send, count, type, route.process,
                                         grouped ? route.tag : TagOf(tag), comm, made);
                      });
}

int Irecv(void* receive, int count, uintptr_t type_token, int source, int tag,
          uintptr_t comm_token, uintptr_t* request) {
  return StartRequest(type_token, comm_token, count, source, false, request,
                      [&](MPI_Datatype type, MPI_Comm comm, Route route, MPI_Request* made) {
                        const bool grouped = comm != CommOf(comm_token)->comm;
                        return MPI_Irecv(receive, count, type, route.process,
                                         grouped ? route.tag : TagOf(tag), comm, made);
                      });
}

// The end of one of collective-permute's messages.
int Wait(uintptr_t* request, void* status) {
  if (*request == Token("REQUEST_NULL")) return MPI_SUCCESS;
  auto* box = reinterpret_cast<RequestBox*>(*request);
  if (box->magic != kRequestMagic) return kUnknownHandle;
  Call c = XlaCall(box->sends ? "send" : "recv", *box->comm, box->type, box->count, nullptr,
                   nullptr);
  const std::string more = (box->sends ? ", to rank " : ", from rank ") + std::to_string(box->peer);
  MPI_Status real;
  const int rc = Watched(c, *box->comm, Kind::kPointToPoint, Described(c, nullptr, more), [&] {
    return MPI_Wait(&box->request, &real);
  });
  if (rc == MPI_SUCCESS) StatusOut(status, real);
  box->magic = 0;
  delete box;
  *request = Token("REQUEST_NULL");
  return rc;
}

int Barrier(uintptr_t comm_token) {
  const CommBox* comm = CommOf(comm_token);
  if (!comm) return kUnknownHandle;
  if (comm->place.group) {
    xla_groups::Group& g = *comm->place.group;
    return GroupMeeting(*comm, nullptr, nullptr,
                        [&](const std::vector<const void*>&, const std::vector<void*>&) {
      return OverProcesses(g, "barrier", TypeFacts{MPI_BYTE, ffi::DataType::U8, 1}, 0, nullptr,
                           [&] { return MPI_Barrier(g.processes); });
    });
  }
  Call c = XlaCall("barrier", *comm, TypeFacts{MPI_BYTE, ffi::DataType::U8, 1}, 0, nullptr,
                   nullptr);
  return Watched(c, *comm, Kind::kCompared, "barrier(), inserted by XLA",
                 [&] { return MPI_Barrier(comm->comm); });
}

// `text` into the trampoline's buffer of MPI_MAX_ERROR_STRING (1024) bytes,
// cut to fit; *length is what was written.
void CopyText(const std::string& text, char* out, int* length) {
  constexpr size_t kRoom = 1024;
  const size_t n = std::min(text.size(), kRoom - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
  *length = static_cast<int>(n);
}

int ErrorString(int code, char* text, int* length) {
  switch (code) {
    case kWatchedFailure:
      CopyText(failure_text, text, length);
      return MPI_SUCCESS;
    case kUnknownHandle:
      CopyText("mpicoll: a handle JAX's collectives passed is not one mpicoll's MPI ABI "
               "library made", text, length);
      return MPI_SUCCESS;
    case kUnsupportedType:
      CopyText("mpicoll: JAX's collectives passed an MPI datatype mpicoll's MPI ABI library "
               "does not map (it maps the integer, float and complex types XLA's CPU "
               "collectives use)", text, length);
      return MPI_SUCCESS;
    case kUnsupportedOp:
      CopyText("mpicoll: JAX's collectives passed a reduction mpicoll's MPI ABI library does "
               "not map", text, length);
      return MPI_SUCCESS;
  }
  char real[MPI_MAX_ERROR_STRING];
  int real_length = 0;
  if (MPI_Error_string(code, real, &real_length) != MPI_SUCCESS) {
    CopyText("MPI error " + std::to_string(code), text, length);
  } else {
    CopyText(std::string(real, real_length), text, length);
  }
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
PyObject* PyJaxMpiLibraryProblem(PyObject*, PyObject* arg) {
  const char* path = PyUnicode_AsUTF8(arg);
  if (!path) return nullptr;
  void* library = nullptr;
  std::string why;
  if (LoadedLibrary(path, &library, &why)) dlclose(library);
  return PyUnicode_FromString(why.c_str());
}

// connect_jax_mpi(path, local_devices) -> "" or why not: hands the calls to the library at
// `path` (loaded: jax_mpi_library_problem said so on every rank), after
// duplicating COMM_WORLD for XLA (collective: every rank calls it).
PyObject* PyConnectJaxMpi(PyObject*, PyObject* args) {
  const char* path = nullptr;
  int local_devices = 1;
  if (!PyArg_ParseTuple(args, "si", &path, &local_devices)) return nullptr;
  if (local_devices < 1 || local_devices > kMaxLocalDevices) {
    return PyUnicode_FromFormat("%d local CPU devices: mpicoll takes 1 to %d", local_devices,
                                kMaxLocalDevices);
  }
  void* library = nullptr;
  std::string why;
  const mpiabi::ConnectFunction connect = LoadedLibrary(path, &library, &why);
  if (!connect) return PyUnicode_FromString(why.c_str());
  int rc = MPI_SUCCESS;
  Py_BEGIN_ALLOW_THREADS
  if (jax_world.comm == MPI_COMM_NULL) {
    MPI_Comm world = MPI_COMM_NULL;
    rc = MPI_Comm_dup(MPI_COMM_WORLD, &world);
    // (No checks' duplicate: only splits, which are not compared, run on it.)
    if (rc == MPI_SUCCESS) {
      jax_world.comm = world;
      Key(&jax_world);
      MPI_Comm_set_name(world, "mpicoll:XLA's COMM_WORLD");
      MPI_Comm_rank(world, &jax_world.rank);
      MPI_Comm_size(world, &jax_world.size);
    }
  }
  Py_END_ALLOW_THREADS
  if (rc != MPI_SUCCESS) return PyUnicode_FromString("MPI_Comm_dup of COMM_WORLD failed");
  splits.local_devices = local_devices;
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
    {"jax_mpi_library_problem", PyJaxMpiLibraryProblem, METH_O,
     "(path of mpicoll's MPI ABI library) -> '' where jaxlib's trampoline loaded it, else why "
     "not."},
    {"connect_jax_mpi", PyConnectJaxMpi, METH_VARARGS,
     "(path of mpicoll's MPI ABI library, local CPU devices) -> '' or why JAX's CPU "
     "collectives cannot run on mpicoll's MPI; collective."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace mpicoll

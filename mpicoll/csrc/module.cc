// The CPython module `mpicoll._mpicoll_ffi_<mpi>` (one per MPI family, setup.py):
// the FFI targets' registrations, set-up (initialize, register_comm, the
// device ordinals), and settings (check mode, serialized MPI, GPU transport,
// the meeting's pieces); the other units bind one concern each and module.cc
// joins their tables to its own (module_parts.h).
//
// How the extension is built: several translation units, listed in setup.py
// and linked into this one module:
//   module.cc              this file
//   module_watch.cc        the module's functions for watching the job
//   module_tables.cc       the extension's tables as Python data
//   module_survive.cc      surviving a lost rank
//   module_testing.cc      hooks for tests alone
//   mpiabi/jax_calls.cc    JAX's own collectives on mpicoll's MPI (XLA's calls)
//   entries/cpu.cc         CPU handlers (data, fused, overlapped), the barrier
//   entries/cuda.cc        CUDA handlers (empty without MPICOLL_CUDA)
//   entries/host_staged.cc the staged GPU pipeline on host memory, for tests
//   meeting/meeting.cc     the local devices' meeting: every ranks x devices collective
//                          on CPU, its kinds in meeting/kinds.def
// They share engine/, watch/ and memory/, which are headers: every function there is a
// template or `inline` and every piece of state an `inline` variable (C++17),
// so each exists once in the module whichever units include it, and each
// header includes what it uses.  Separate units rather than one that
// #includes the others: a .cc file's private helpers stay private (unnamed
// namespace), the CUDA unit can be compiled (or syntax-checked) alone, and
// the hot path loses nothing, since what it calls is inline in its own unit.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#if defined(OMPI_MAJOR_VERSION) && __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/algorithms.h"
#include "engine/collectives.h"
#include "engine/comm_table.h"
#include "engine/dtypes.h"
#include "watch/guard.h"
#include "engine/reduce_ops.h"
#include "entries/entries.h"
#include "module_parts.h"
#include "mpiabi/jax_calls.h"
#include "xla/ffi/api/ffi.h"
#ifdef MPICOLL_CUDA
#include "memory/cuda_driver.h"
#endif

namespace mpicoll {
namespace {

PyObject* RegistrationDict(const std::vector<Registration>& registrations) {
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  for (const Registration& r : registrations) {
    PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(r.handler), nullptr, nullptr);
    if (!capsule || PyDict_SetItemString(dict, r.name.c_str(), capsule) < 0) {
      Py_XDECREF(capsule);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return dict;
}

// FFI target name -> handler capsule, per platform ("cpu", and "cuda" when built with it).
PyObject* PyRegistrations(PyObject*, PyObject* args) {
  const char* platform = "cpu";
  if (!PyArg_ParseTuple(args, "|s", &platform)) return nullptr;
  if (std::strcmp(platform, "cpu") == 0) return RegistrationDict(CpuRegistrations());
#ifdef MPICOLL_CUDA
  if (std::strcmp(platform, "cuda") == 0) return RegistrationDict(CudaRegistrations());
#endif
  PyErr_Format(PyExc_ValueError, "mpicoll: this build has no handlers for platform %s",
               platform);
  return nullptr;
}

bool initialized = false;

// Called once MPI is initialized (by mpi4py): checks the thread level and
// creates the operators for 16-bit floats.
PyObject* PyInitialize(PyObject*, PyObject*) {
  if (initialized) Py_RETURN_NONE;
  int flag = 0;
  MPI_Initialized(&flag);
  if (!flag) {
    PyErr_SetString(PyExc_RuntimeError, "mpicoll: MPI is not initialized");
    return nullptr;
  }
  int provided = 0;
  MPI_Query_thread(&provided);
  if (CreateReductionOps() != MPI_SUCCESS) {
    PyErr_SetString(PyExc_RuntimeError, "mpicoll: creating the reduction operators failed");
    return nullptr;
  }
  initialized = true;
  return PyLong_FromLong(provided);
}

// (key, bool): whether the communicator's local meetings start their turns on
// XLA's thread (engine/comm_table.h), the same on each of its ranks.
PyObject* PySetMeetingsStartHere(PyObject*, PyObject* args) {
  long long key;
  int here;
  if (!PyArg_ParseTuple(args, "Lp", &key, &here)) return nullptr;
  if (key < 0) {
    PyErr_SetString(PyExc_ValueError, "mpicoll: communicator key out of range");
    return nullptr;
  }
  meetings_start_here[key % kMaxComms].store(here != 0, std::memory_order_release);
  Py_RETURN_NONE;
}

PyObject* PyRegisterComm(PyObject*, PyObject* args) {
  long long key;
  int device;
  unsigned long long handle;
  if (!PyArg_ParseTuple(args, "LiK", &key, &device, &handle)) return nullptr;
  if (key < 0 || device < 0 || device >= kMaxLocalDevices) {
    PyErr_Format(PyExc_ValueError, "mpicoll: communicator key %lld / device %d out of range "
                 "(at most %d local devices)", key, device, kMaxLocalDevices);
    return nullptr;
  }
  const MPI_Comm comm = HandleFromInteger<MPI_Comm>(handle);
  if (int rc = RegisterDeviceComm(key, device, comm); rc != MPI_SUCCESS) {
    // Registering makes the internal duplicate, collectively: a rank lost then is
    // a failed collective (RuntimeError with the marker: Python raises RankLost).
    const std::string text = MpiFailureText(
        "mpicoll: cannot register communicator " + std::to_string(key), comm, rc);
    const bool lost = text.find(kRankLostMarker) != std::string::npos;
    PyErr_SetString(lost ? PyExc_RuntimeError : PyExc_ValueError, text.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// [(XLA device ordinal, local device index), ...]: see LocalDeviceIndex.
PyObject* PySetDeviceOrdinals(PyObject*, PyObject* arg) {
  PyObject* seq = PySequence_Fast(arg, "mpicoll: device ordinals must be a sequence of pairs");
  if (!seq) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<std::array<int32_t, 2>> pairs(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    int ordinal = 0, index = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ii", &ordinal, &index)) {
      Py_DECREF(seq);
      return nullptr;
    }
    pairs[static_cast<size_t>(i)] = {ordinal, index};
  }
  Py_DECREF(seq);
  static_assert(sizeof(std::array<int32_t, 2>) == sizeof(int32_t[2]));
  if (!SetDeviceOrdinals(reinterpret_cast<const int32_t (*)[2]>(pairs.data()),
                         static_cast<int>(n))) {
    PyErr_SetString(PyExc_ValueError, "mpicoll: the device ordinals differ from those set "
                    "before (or are too many)");
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* PyUnregisterComm(PyObject*, PyObject* args) {
  long long key;
  if (!PyArg_ParseTuple(args, "L", &key)) return nullptr;
  UnregisterDeviceComms(key);
  Py_RETURN_NONE;
}

PyObject* PyBuildInfo(PyObject*, PyObject*) {
#if defined(OMPI_MAJOR_VERSION)
  const char* vendor = "Open MPI";
  PyObject* version = Py_BuildValue("(iii)", OMPI_MAJOR_VERSION, OMPI_MINOR_VERSION,
                                    OMPI_RELEASE_VERSION);
#elif defined(I_MPI_NUMVERSION)  // before MPICH: Intel MPI defines MPICH_NUMVERSION too
  const char* vendor = "Intel MPI";
  PyObject* version = Py_BuildValue("(iii)", static_cast<int>(I_MPI_NUMVERSION / 10000000),
                                    static_cast<int>((I_MPI_NUMVERSION / 100000) % 100),
                                    static_cast<int>((I_MPI_NUMVERSION / 1000) % 100));
#elif defined(MPICH_NUMVERSION)
  const char* vendor = "MPICH";
  PyObject* version = Py_BuildValue("(iii)", MPICH_NUMVERSION / 10000000,
                                    (MPICH_NUMVERSION / 100000) % 100,
                                    (MPICH_NUMVERSION / 1000) % 100);
#else
  const char* vendor = "unknown";
  PyObject* version = Py_BuildValue("()");
#endif
  if (!version) return nullptr;
#ifdef MPICOLL_CUDA
  PyObject* platforms = Py_BuildValue("(ss)", "cpu", "cuda");
#else
  PyObject* platforms = Py_BuildValue("(s)", "cpu");
#endif
  if (!platforms) return nullptr;
  return Py_BuildValue("{s:s,s:N,s:i,s:i,s:i,s:i,s:i,s:N}", "mpi_vendor", vendor,
                       "mpi_version", version, "mpi_standard_version", MPI_VERSION,
                       "mpi_standard_subversion", MPI_SUBVERSION, "max_comms", kMaxComms,
                       "max_local_devices", kMaxLocalDevices, "xla_slot", kXlaSlot,
                       "platforms", platforms);
}

// Whether this MPI takes CUDA device pointers in its calls: True or False where
// the MPI can say (Open MPI's MPIX_Query_cuda_support, MPICH's
// MPIX_GPU_query_support; both answer at run time, e.g. for a library built with
// CUDA but run with GPU support switched off), None where it cannot.
PyObject* PyCudaAwareMpi(PyObject*, PyObject*) {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return PyBool_FromLong(MPIX_Query_cuda_support());
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
  Py_RETURN_FALSE;  // Open MPI built without CUDA
#elif defined(MPIX_GPU_SUPPORT_CUDA)
  int supported = 0;
  if (MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported) != MPI_SUCCESS) Py_RETURN_NONE;
  return PyBool_FromLong(supported);
#else
  Py_RETURN_NONE;
#endif
}

PyObject* PySetCheckMode(PyObject*, PyObject* arg) {
  long mode = PyLong_AsLong(arg);
  if (mode == -1 && PyErr_Occurred()) return nullptr;
  if (mode < kCheckOff || mode > kCheckEveryCall) {
    PyErr_SetString(PyExc_ValueError, "check mode must be 0 (off), 1 (first run) or 2 (every call)");
    return nullptr;
  }
  watch_settings.check_mode.store(static_cast<int>(mode));
  Py_RETURN_NONE;
}

// (min block bytes, segment bytes) -> the previous pair; (-1, -1) only reads.
PyObject* PyPairwiseReduceScatter(PyObject*, PyObject* args) {
  long long min_block = -1, segment = -1;
  if (!PyArg_ParseTuple(args, "|LL", &min_block, &segment)) return nullptr;
  const unsigned long long old_min = pairwise_min_block_bytes.load(),
                           old_segment = pairwise_segment_bytes.load();
  if (min_block >= 0) pairwise_min_block_bytes.store(static_cast<size_t>(min_block));
  if (segment > 0) pairwise_segment_bytes.store(static_cast<size_t>(segment));
  return Py_BuildValue("(KK)", old_min, old_segment);
}

PyObject* PyMeetingTurns(PyObject*, PyObject*) {
  const std::array<int64_t, 3> counts = MeetingTurns();
  return Py_BuildValue("(LLL)", static_cast<long long>(counts[0]),
                       static_cast<long long>(counts[1]), static_cast<long long>(counts[2]));
}

PyObject* PyComparisonsMade(PyObject*, PyObject*) {
  return PyLong_FromLongLong(comparisons_made.load());
}

// (slot, device, description) -> "" or the mismatch message: a call that this
// rank rejected while the others may run it, compared as the call in its
// place (the next sequence number on that communicator), so that the others'
// checks meet it, or the watchdog names it beside their calls.
PyObject* PyCompareCall(PyObject*, PyObject* args) {
  long long slot;
  int device;
  const char* description;
  if (!PyArg_ParseTuple(args, "Lis", &slot, &device, &description)) return nullptr;
  Call c{};
  c.name = "rejected call";
  if (Resolve(c, device, slot).failure()) {
    PyErr_SetString(PyExc_ValueError, "mpicoll: no communicator registered for this slot");
    return nullptr;
  }
  const std::string text = description;
  std::string message;
  Py_BEGIN_ALLOW_THREADS
  {  // released before the GIL is taken back
    SerializedMpiScope serialized;
    CheckPlan plan = PlanCheck(c, device, [&] { return text; });
    plan.check = c.size > 1;
    InFlightScope watched(c, device, /*new_call=*/true, /*queued_ns=*/0, plan.facts);
    ffi::Error result = CheckSameCall(c, device, plan, watched);
    if (result.failure()) message = std::string(result.message());
  }
  Py_END_ALLOW_THREADS
  return PyUnicode_FromStringAndSize(message.data(), static_cast<Py_ssize_t>(message.size()));
}

// True: mpicoll's MPI calls take serialized_mpi.mutex (MPI_THREAD_SERIALIZED mode).
PyObject* PySetSerializedMpi(PyObject*, PyObject* arg) {
  return StoreFlag(serialized_mpi.on, arg);
}

// Python: set_gather_pieces(pieces: int), 0 = automatic (meeting/meeting.cc).
PyObject* PySetGatherPieces(PyObject*, PyObject* arg) {
  const long pieces = PyLong_AsLong(arg);
  if (pieces == -1 && PyErr_Occurred()) return nullptr;
  SetGatherPieces(static_cast<int>(std::min<long>(std::max<long>(pieces, 0), 1 << 20)));
  Py_RETURN_NONE;
}

#ifdef MPICOLL_CUDA
// Python: set_gpu_transport(cuda_aware: bool, chunk_bytes: int).
PyObject* PySetGpuTransport(PyObject*, PyObject* args) {
  int cuda_aware;
  unsigned long long chunk_bytes;
  if (!PyArg_ParseTuple(args, "pK", &cuda_aware, &chunk_bytes)) return nullptr;
  SetGpuTransport(cuda_aware != 0, static_cast<size_t>(chunk_bytes));
  Py_RETURN_NONE;
}

// Python: cuda_driver() -> {"error": str or None, "version": int, "devices": int}.
PyObject* PyCudaDriver(PyObject*, PyObject*) {
  const CudaDriver& cu = Driver();
  int devices = 0;
  if (cu.error.empty()) cu.cuDeviceGetCount(&devices);
  if (!cu.error.empty()) {
    return Py_BuildValue("{s:s,s:i,s:i}", "error", cu.error.c_str(), "version", 0, "devices", 0);
  }
  return Py_BuildValue("{s:O,s:i,s:i}", "error", Py_None, "version", cu.version, "devices",
                       devices);
}
#endif

// The module's functions.  Each binding is named for the Python function it is:
// Py + that name in CamelCase (set_check_mode: PySetCheckMode), the same in
// module_watch.cc's table; a leading underscore marks a test's hook.
PyMethodDef methods[] = {
    {"set_check_mode", PySetCheckMode, METH_O,
     "Compare call fingerprints across ranks: 0 never, 1 each call site's first run, 2 always."},
    {"pairwise_reduce_scatter", PyPairwiseReduceScatter, METH_VARARGS,
     "(min block bytes, segment bytes) of mpicoll's own reduce-scatter -> the previous pair; "
     "a negative value leaves that one; every rank must set the same."},
    {"comparisons_made", PyComparisonsMade, METH_NOARGS,
     "How many times this process has compared a call across ranks."},
    {"compare_call", PyCompareCall, METH_VARARGS,
     "(slot, device, description) -> '' if every rank passed the same, else the mismatch."},
    {"registrations", PyRegistrations, METH_VARARGS,
     "FFI target name -> handler capsule for a platform ('cpu' or 'cuda')."},
    {"meeting_turns", PyMeetingTurns, METH_NOARGS,
     "This process's local meeting turns: (ended on XLA's thread, handed to the progress "
     "thread past the bound, queued whole)."},
    {"set_gather_pieces", PySetGatherPieces, METH_O,
     "The pieces the local meeting's allgather is gathered in (0 = automatic)."},
#ifdef MPICOLL_CUDA
    {"set_gpu_transport", PySetGpuTransport, METH_VARARGS,
     "Choose the GPU memory strategy: (cuda_aware, pipeline chunk bytes)."},
    {"cuda_driver", PyCudaDriver, METH_NOARGS, "The CUDA driver: error, version, devices."},
#endif
    {"initialize", PyInitialize, METH_NOARGS, "Set up MPI operators; returns the thread level."},
    {"register_comm", PyRegisterComm, METH_VARARGS, "Store an MPI_Comm handle in a table slot."},
    {"set_meetings_start_here", PySetMeetingsStartHere, METH_VARARGS,
     "(key, here): whether the communicator's local meetings start their turns on XLA's "
     "thread (its ranks agreed)."},
    {"set_device_ordinals", PySetDeviceOrdinals, METH_O,
     "Map XLA's device ordinals to local device indices: [(ordinal, index), ...]."},
    {"unregister_comm", PyUnregisterComm, METH_VARARGS, "Empty a slot (its communicator was freed)."},
    {"build_info", PyBuildInfo, METH_NOARGS, "The MPI this extension was compiled against."},
    {"cuda_aware_mpi", PyCudaAwareMpi, METH_NOARGS,
     "True/False: whether MPI accepts CUDA device buffers; None: this MPI cannot tell."},
    {"set_serialized_mpi", PySetSerializedMpi, METH_O,
     "True: mpicoll's MPI calls take one lock (MPI_THREAD_SERIALIZED mode)."},
    {nullptr, nullptr, 0, nullptr}};

// This file's table and the other units' (module_parts.h), as one (the module keeps a
// pointer to it).
PyMethodDef* AllMethods() {
  static std::vector<PyMethodDef> all = [] {
    std::vector<PyMethodDef> joined;
    for (const PyMethodDef* table : {methods, watch_methods, table_methods, survive_methods,
                                     testing_methods, jax_mpi_methods}) {
      for (const PyMethodDef* m = table; m->ml_name; ++m) joined.push_back(*m);
    }
    joined.push_back({nullptr, nullptr, 0, nullptr});
    return joined;
  }();
  return all.data();
}

// The module's name carries the MPI family it was built against
// (_mpicoll_ffi_mpich, _mpicoll_ffi_openmpi: setup.py's mpi_family), so that
// venvs of one checkout built against different MPIs each import their own.
#ifndef MPICOLL_MODULE
#define MPICOLL_MODULE _mpicoll_ffi
#endif
#define MPICOLL_TEXT_(name) #name
#define MPICOLL_TEXT(name) MPICOLL_TEXT_(name)
#define MPICOLL_JOIN_(a, b) a##b
#define MPICOLL_JOIN(a, b) MPICOLL_JOIN_(a, b)

PyModuleDef module = {PyModuleDef_HEAD_INIT, MPICOLL_TEXT(MPICOLL_MODULE),
                      "XLA FFI handlers for MPI collectives.", -1, nullptr};

}  // namespace
}  // namespace mpicoll

PyMODINIT_FUNC MPICOLL_JOIN(PyInit_, MPICOLL_MODULE)() {
  mpicoll::module.m_methods = mpicoll::AllMethods();
  return PyModule_Create(&mpicoll::module);
}

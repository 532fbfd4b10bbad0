// The CPython module `mpicoll._mpicoll_ffi_<mpi>` (one per MPI family, setup.py):
// the FFI targets' registrations,
// set-up (initialize, register_comm), settings (check mode, serialized MPI,
// GPU transport), and the tables as Python data (reduction_ops(),
// collectives(), op_codes()); module_watch.cc has the functions for watching
// the job (timeouts, stall reports, aborts, flight records, the timeline).
//
// How the extension is built: several translation units, listed in setup.py
// and linked into this one module:
//   module.cc              this file
//   module_watch.cc        the module's functions for watching the job
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
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "engine/algorithms.h"
#include "engine/collectives.h"
#include "engine/comm_table.h"
#include "engine/dtypes.h"
#include "watch/guard.h"
#include "engine/reduce_ops.h"
#include "engine/test_kill.h"
#include "meeting/kinds.def"
#include "entries/entries.h"
#include "module_watch.h"
#include "mpiabi/jax_calls.h"
#include "ops.def"
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

// Survival of a lost rank (ULFM: docs/surviving.md): whether this MPI can (MPIX_Comm_revoke
// and its error classes compiled in), and whether a call has seen a rank die.
PyObject* PyFaultTolerance(PyObject*, PyObject*) {
#if defined(MPIX_ERR_PROC_FAILED) && defined(MPIX_ERR_REVOKED)
  const bool built = true;
#else
  const bool built = false;
#endif
  return Py_BuildValue("{s:O,s:O,s:i}", "built", built ? Py_True : Py_False, "rank_lost",
                       rank_lost.load() ? Py_True : Py_False, "recoveries", recoveries.load());
}

// rank_lost_failure(error_code, handles): whether an MPI error code Python met
// (mpi4py's MPI.Exception, from a communicator's set-up) says a process failed
// or a communicator was revoked.  If so, the communicators in `handles` are
// revoked as well as every one mpicoll talks on (RankLostFailure), so that
// every survivor, wherever it waits, wakes to the same RankLost.
PyObject* PyRankLostFailure(PyObject*, PyObject* args) {
  int code = 0;
  PyObject* handles = nullptr;
  if (!PyArg_ParseTuple(args, "iO", &code, &handles)) return nullptr;
  PyObject* seq = PySequence_Fast(handles, "mpicoll: handles must be a sequence of integers");
  if (!seq) return nullptr;
  std::vector<MPI_Comm> comms;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const unsigned long long handle =
        PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (PyErr_Occurred()) {
      Py_DECREF(seq);
      return nullptr;
    }
    comms.push_back(HandleFromInteger<MPI_Comm>(handle));
  }
  Py_DECREF(seq);
  bool lost = false;
  for (MPI_Comm comm : comms) lost = RankLostFailure(comm, code) || lost;
  if (comms.empty()) lost = RankLostFailure(MPI_COMM_NULL, code);
  return PyBool_FromLong(lost);
}

// mpicoll.shrink() has gone on with the survivors: the next failure revokes
// every communicator again (call.h, RankLostFailure).
PyObject* PyFaultRecovered(PyObject*, PyObject*) {
  rank_lost.store(false);
  recoveries.fetch_add(1);
  Py_RETURN_NONE;
}

// At exit after a survived failure: Open MPI's MPI_Finalize may wait forever for
// the dead process (seen in about 1 run in 6 under load, in ompi_mpi_finalize), so
// a native thread ends the process with its exit status if finalizing takes
// longer than `seconds` (a Python thread cannot: finalization holds the GIL).
PyObject* PyExitAfter(PyObject*, PyObject* args) {
  double seconds = 0;
  int status = 0;
  if (!PyArg_ParseTuple(args, "di", &seconds, &status)) return nullptr;
  std::thread([seconds, status] {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    std::fflush(nullptr);
    std::_Exit(status);
  }).detach();
  Py_RETURN_NONE;
}

// The reduction operators by name, so Python never duplicates the numbering.
PyObject* PyOpCodes(PyObject*, PyObject*) {
  PyObject* codes = PyDict_New();
  for (int64_t code = 0; codes && code < kNumOps; ++code) {
    PyObject* value = PyLong_FromLongLong(code);
    if (!value || PyDict_SetItemString(codes, kReduceOps[code].name, value) < 0) Py_CLEAR(codes);
    Py_XDECREF(value);
  }
  return codes;
}

// reduce_ops.def as Python data: name -> (code, the dtype families it is defined for).
PyObject* PyReductionOps(PyObject*, PyObject*) {
  PyObject* ops = PyDict_New();
  for (int64_t code = 0; ops && code < kNumOps; ++code) {
    const ReduceOpFacts& facts = kReduceOps[code];
    PyObject* families = PyList_New(0);
    const std::pair<bool, const char*> valid[] = {{facts.bool_, "bool"},
                                                  {facts.integer, "integer"},
                                                  {facts.floating, "floating"},
                                                  {facts.complex, "complex"}};
    for (const auto& [is_valid, family] : valid) {
      if (!families || !is_valid) continue;
      PyObject* text = PyUnicode_FromString(family);
      if (!text || PyList_Append(families, text) < 0) Py_CLEAR(families);
      Py_XDECREF(text);
    }
    PyObject* row = families ? Py_BuildValue("(LN)", static_cast<long long>(code),
                                             PyList_AsTuple(families))
                             : nullptr;
    Py_XDECREF(families);
    if (!row || PyDict_SetItemString(ops, facts.name, row) < 0) Py_CLEAR(ops);
    Py_XDECREF(row);
  }
  return ops;
}

// dtypes.def as Python data: numpy's name -> the dtype family (in the table's order).
PyObject* PyDtypes(PyObject*, PyObject*) {
  PyObject* dtypes = PyDict_New();
#define MPICOLL_DTYPE_ROW(xla, name, mpi, family)                          \
  if (dtypes) {                                                            \
    PyObject* text = PyUnicode_FromString(family);                         \
    if (!text || PyDict_SetItemString(dtypes, name, text) < 0) Py_CLEAR(dtypes); \
    Py_XDECREF(text);                                                      \
  }
  MPICOLL_DTYPES(MPICOLL_DTYPE_ROW)
#undef MPICOLL_DTYPE_ROW
  return dtypes;
}

const char* FamilyName(Family family) {
  switch (family) {
    case kBlocks: return "blocks";
    case kVector: return "vector";
    case kVectorPairs: return "vector_pairs";
    case kPeer: return "peer";
  }
  return "?";
}

const char* ZerosName(Zeros zeros) {
  switch (zeros) {
    case kNever: return "never";
    case kOffRoot: return "off_root";
    case kOnRankZero: return "on_rank_zero";
    case kFromProcNull: return "from_proc_null";
  }
  return "?";
}

// ops.def as Python data: name -> the row's facts.
PyObject* PyCollectives(PyObject*, PyObject*) {
  PyObject* collectives = PyDict_New();
#define MPICOLL_COLLECTIVE_FACTS(Type, ...)                                                    \
  if (collectives) {                                                                          \
    PyObject* row = Py_BuildValue(                                                            \
        "{s:s,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:s}", "family", FamilyName(Type::kFamily),           \
        "reduces", Type::kReduces ? Py_True : Py_False, "rooted",                              \
        Type::kRooted ? Py_True : Py_False, "blocks_in", Type::kBlocksIn ? Py_True : Py_False, \
        "blocks_out", Type::kBlocksOut ? Py_True : Py_False, "in_place",                       \
        Type::kInPlace ? Py_True : Py_False, "root_input",                                     \
        Type::kRootInput ? Py_True : Py_False, "chunked", Type::kChunked ? Py_True : Py_False, \
        "zeros", ZerosName(Type::kZeros));                                                      \
    if (!row || PyDict_SetItemString(collectives, Type::kName, row) < 0) Py_CLEAR(collectives); \
    Py_XDECREF(row);                                                                          \
  }
  MPICOLL_OPS(MPICOLL_COLLECTIVE_FACTS)
#undef MPICOLL_COLLECTIVE_FACTS
  return collectives;
}

// Test only: (collective, comm handle, dtype name, x, out, root, op, chunk bytes)
// runs the GPU staging pipeline on host arrays (entries/host_staged.cc).
PyObject* PyRunStagedOnHost(PyObject*, PyObject* args) {
  const char* name;
  unsigned long long handle;
  const char* dtype_name;
  Py_buffer x, out;
  int root;
  long long op;
  unsigned long long chunk_bytes;
  if (!PyArg_ParseTuple(args, "sKsy*w*iLK", &name, &handle, &dtype_name, &x, &out, &root, &op,
                        &chunk_bytes)) {
    return nullptr;
  }
  const ffi::DataType dtype = DtypeFromName(dtype_name);
  std::string error = dtype == ffi::DataType::INVALID ? "mpicoll: unsupported dtype" : "";
  if (error.empty()) {
    const size_t elem_bytes = ffi::ByteWidth(dtype);
    char* in_data = static_cast<char*>(x.buf);
    char* out_data = static_cast<char*>(out.buf);
    const size_t in_count = static_cast<size_t>(x.len) / elem_bytes;
    const size_t out_count = static_cast<size_t>(out.len) / elem_bytes;
    Py_BEGIN_ALLOW_THREADS
    error = RunStagedOnHost(name, HandleFromInteger<MPI_Comm>(handle), dtype, in_data, in_count,
                            out_data, out_count, root, op, static_cast<size_t>(chunk_bytes));
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&x);
  PyBuffer_Release(&out);
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// The dtypes whose sum uses mpicoll's wrapping operator instead of MPI_SUM.
PyObject* PyReplacedSums(PyObject*, PyObject*) {
  PyObject* names = PyList_New(0);
  if (!names) return nullptr;
  for (int i = 0; i < kNumNarrowInts; ++i) {
    if (wrapping_sums[i] == MPI_OP_NULL) continue;
    PyObject* name = PyUnicode_FromString(kNarrowIntNames[i]);
    if (!name || PyList_Append(names, name) < 0) {
      Py_XDECREF(name);
      Py_DECREF(names);
      return nullptr;
    }
    Py_DECREF(name);
  }
  return names;
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

// Test only: seconds to wait after a comparison that found a mismatch (see watch/check.h).
PyObject* PyPauseAfterMismatch(PyObject*, PyObject* args) {
  double seconds = 0;
  if (!PyArg_ParseTuple(args, "d", &seconds)) return nullptr;
  watch_settings.pause_after_mismatch.store(seconds);
  Py_RETURN_NONE;
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

// Python: meeting_kinds() -> {name: (code, rows_in)}, meeting/kinds.def's rows.
PyObject* PyMeetingKinds(PyObject*, PyObject*) {
  PyObject* kinds = PyDict_New();
#define MPICOLL_MEETING_KIND_ROW(Enum, Type, name, code, rows_in, reduces)               \
  if (kinds) {                                                                          \
    PyObject* value = Py_BuildValue("(iO)", code, (rows_in) ? Py_True : Py_False);      \
    if (!value || PyDict_SetItemString(kinds, name, value) < 0) Py_CLEAR(kinds);       \
    Py_XDECREF(value);                                                                  \
  }
  MPICOLL_MEETING_KINDS(MPICOLL_MEETING_KIND_ROW)
#undef MPICOLL_MEETING_KIND_ROW
  return kinds;
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
    {"op_codes", PyOpCodes, METH_NOARGS, "Reduction operator name -> code used by the handlers."},
    {"reduction_ops", PyReductionOps, METH_NOARGS,
     "Reduction operator name -> (code, the dtype families it is defined for), from reduce_ops.def."},
    {"dtypes", PyDtypes, METH_NOARGS,
     "numpy dtype name -> its family (bool, integer, floating, complex), from dtypes.def."},
    {"collectives", PyCollectives, METH_NOARGS,
     "Collective name -> its row of ops.def (family, reduces, rooted, blocks_in, ...)."},
    {"_pause_after_mismatch", PyPauseAfterMismatch, METH_VARARGS,
     "Test only: seconds this rank waits after a comparison that found a mismatch."},
    {"_run_staged_on_host", PyRunStagedOnHost, METH_VARARGS,
     "Test only: (collective, comm handle, dtype, x, out, root, op, chunk bytes) runs the GPU "
     "staging pipeline on host arrays."},
    {"registrations", PyRegistrations, METH_VARARGS,
     "FFI target name -> handler capsule for a platform ('cpu' or 'cuda')."},
    {"meeting_kinds", PyMeetingKinds, METH_NOARGS,
     "Local meeting kind name -> (code, rows_in): meeting/kinds.def's rows."},
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
    {"exit_after", PyExitAfter, METH_VARARGS,
     "exit_after(seconds, status): end the process then, if it has not ended."},
    {"fault_recovered", PyFaultRecovered, METH_NOARGS,
     "After mpicoll.shrink(): the next failure revokes every communicator again."},
    {"fault_tolerance", PyFaultTolerance, METH_NOARGS,
     "{'built': ULFM's calls compiled in, 'rank_lost': a call saw a process die, "
     "'recoveries': shrinks so far}."},
    {"rank_lost_failure", PyRankLostFailure, METH_VARARGS,
     "rank_lost_failure(error_code, comm_handles): whether the code says a process failed "
     "(then every communicator, these too, is revoked)."},
    {"cuda_aware_mpi", PyCudaAwareMpi, METH_NOARGS,
     "True/False: whether MPI accepts CUDA device buffers; None: this MPI cannot tell."},
    {"set_serialized_mpi", PySetSerializedMpi, METH_O,
     "True: mpicoll's MPI calls take one lock (MPI_THREAD_SERIALIZED mode)."},
    {"replaced_sums", PyReplacedSums, METH_NOARGS,
     "Dtypes whose MPI_SUM saturates in this MPI and is replaced by a wrapping operator."},
    {nullptr, nullptr, 0, nullptr}};

// This file's table and module_watch.cc's, as one (the module keeps a pointer to it).
PyMethodDef* AllMethods() {
  static std::vector<PyMethodDef> all = [] {
    std::vector<PyMethodDef> joined;
    for (const PyMethodDef* table : {methods, watch_methods, jax_mpi_methods}) {
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

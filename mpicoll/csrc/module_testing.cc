// The module's hooks for tests alone (their Python names start with an
// underscore; nothing of mpicoll calls them): the GPU staging pipeline run on
// host arrays, and a pause after a mismatch found by the check across ranks.
// module.cc joins this table to its own at import.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include <cstring>
#include <string>

#include "engine/call.h"
#include "engine/dtypes.h"
#include "entries/entries.h"
#include "module_parts.h"
#include "watch/check.h"
#include "xla/ffi/api/ffi.h"

namespace mpicoll {
namespace {

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

// Test only: seconds to wait after a comparison that found a mismatch (see watch/check.h).
PyObject* PyPauseAfterMismatch(PyObject*, PyObject* args) {
  double seconds = 0;
  if (!PyArg_ParseTuple(args, "d", &seconds)) return nullptr;
  watch_settings.pause_after_mismatch.store(seconds);
  Py_RETURN_NONE;
}

}  // namespace

PyMethodDef testing_methods[] = {
    {"_pause_after_mismatch", PyPauseAfterMismatch, METH_VARARGS,
     "Test only: seconds this rank waits after a comparison that found a mismatch."},
    {"_run_staged_on_host", PyRunStagedOnHost, METH_VARARGS,
     "Test only: (collective, comm handle, dtype, x, out, root, op, chunk bytes) runs the GPU "
     "staging pipeline on host arrays."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mpicoll

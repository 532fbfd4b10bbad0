// The module's functions for surviving a lost rank (docs/surviving.md; Python:
// runtime/faults.py, _src/survive.py): whether this MPI can, whether a rank was
// lost, the revoke of every communicator on a failure Python met, the
// recovery after shrink(), and the exit that Open MPI's finalize after a loss
// cannot be trusted to make.  module.cc joins this table to its own at import.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "engine/call.h"
#include "engine/test_kill.h"  // recoveries: the kill points count them too
#include "module_parts.h"

namespace mpicoll {
namespace {

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

}  // namespace

PyMethodDef survive_methods[] = {
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
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mpicoll

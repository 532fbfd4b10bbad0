// The module's functions for watching the job (mpicoll.failures, _settings,
// comm.py): the watchdog's thresholds and side channel, the watched
// communicator setup, the abort that ends the job, and the flight recorder and
// timeline (core/watchdog.h, core/flight.h).  module.cc joins their table to
// its own at import.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/comm_table.h"
#include "core/flight.h"
#include "core/guard.h"
#include "core/watchdog.h"
#include "module_watch.h"

namespace mpicoll {
namespace {

// A watchdog threshold in seconds (0 or less: off); the watchdog starts with the first.
PyObject* SetWatchdogSeconds(PyObject* arg, std::atomic<double>& threshold) {
  double seconds = PyFloat_AsDouble(arg);
  if (seconds == -1.0 && PyErr_Occurred()) return nullptr;
  threshold.store(seconds > 0 ? seconds : 0.0);
  if (seconds > 0) StartWatchdog();
  Py_RETURN_NONE;
}

PyObject* SetTimeout(PyObject*, PyObject* arg) { return SetWatchdogSeconds(arg, timeout_seconds); }

PyObject* SetStallReport(PyObject*, PyObject* arg) {
  return SetWatchdogSeconds(arg, stall_report_seconds);
}

// The watchdogs' private duplicate of COMM_WORLD (made once, collectively, in Python).
PyObject* SetSideChannel(PyObject*, PyObject* arg) {
  unsigned long long handle = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  side_channel.store(HandleFromInteger<MPI_Comm>(handle));
  Py_RETURN_NONE;
}

PyObject* DescribeSite(PyObject*, PyObject* args) {
  long long site;
  const char* text;
  if (!PyArg_ParseTuple(args, "Ls", &site, &text)) return nullptr;
  std::lock_guard<std::mutex> lock(site_mutex);
  site_descriptions[site] = text;
  Py_RETURN_NONE;
}

PyObject* PyAnnounceAbort(PyObject*, PyObject* arg) {
  const long settle_ms = PyLong_AsLong(arg);
  if (settle_ms == -1 && PyErr_Occurred()) return nullptr;
  int printing;  // the rank that prints the traceback
  Py_BEGIN_ALLOW_THREADS
  printing = AnnounceAbort(static_cast<int>(settle_ms));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(printing);
}

PyObject* PyStopWatchdog(PyObject*, PyObject*) {
  Py_BEGIN_ALLOW_THREADS
  StopWatchdog();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// The flight recorder and the timeline (core/flight.h): set once, at import,
// before the first collective.  set_flight(records per device, dump directory).
PyObject* SetFlight(PyObject*, PyObject* args) {
  long long capacity;
  const char* dir;
  if (!PyArg_ParseTuple(args, "Ls", &capacity, &dir)) return nullptr;
  const long long most = static_cast<long long>(kChunkRecords * kMaxChunks);
  {
    std::lock_guard<std::mutex> lock(flight_setup_mutex);
    flight_dir = dir;
  }
  flight_capacity.store(capacity < 0 ? 0 : std::min(capacity, most));
  NoteWorld();
  if (capacity > 0) StartWatchdog();  // it writes the dumps SIGUSR1 asks for
  Py_RETURN_NONE;
}

// set_trace(directory): keep every record and write it there ("" = off).
PyObject* SetTrace(PyObject*, PyObject* arg) {
  const char* dir = PyUnicode_AsUTF8(arg);
  if (!dir) return nullptr;
  {
    std::lock_guard<std::mutex> lock(flight_setup_mutex);
    trace_dir = dir;
  }
  tracing.store(dir[0] != '\0');
  NoteWorld();
  Py_RETURN_NONE;
}

PyObject* SetClockOffset(PyObject*, PyObject* arg) {
  const long long offset = PyLong_AsLongLong(arg);
  if (offset == -1 && PyErr_Occurred()) return nullptr;
  clock_offset_ns.store(offset);
  Py_RETURN_NONE;
}

PyObject* SetHostNames(PyObject*, PyObject* arg) {
  PyObject* items = PySequence_Fast(arg, "set_host_names: a sequence of str");
  if (!items) return nullptr;
  std::vector<std::string> hosts;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); ++i) {
    const char* host = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(items, i));
    if (!host) {
      Py_DECREF(items);
      return nullptr;
    }
    hosts.emplace_back(host);
  }
  Py_DECREF(items);
  std::lock_guard<std::mutex> lock(hosts_mutex);
  world_hosts = std::move(hosts);
  Py_RETURN_NONE;
}

// write_trace(reason) / dump_flight(reason) -> whether a file was written.
template <typename Write>
PyObject* WriteRecordsNow(PyObject* arg, Write&& write) {
  const char* reason = PyUnicode_AsUTF8(arg);
  if (!reason) return nullptr;
  const std::string why = reason;
  bool written;
  Py_BEGIN_ALLOW_THREADS
  written = write(why);
  Py_END_ALLOW_THREADS
  return PyBool_FromLong(written);
}

PyObject* PyWriteTrace(PyObject*, PyObject* arg) {
  return WriteRecordsNow(arg, [](const std::string& why) {
    return WriteTrace(WorldRank(), world_size.load(), why);
  });
}

PyObject* PyDumpFlight(PyObject*, PyObject* arg) {
  return WriteRecordsNow(arg, [](const std::string& why) {
    last_flight_dump_ns.store(0);  // asked for: not rate-limited
    return DumpFlight(WorldRank(), world_size.load(), why);
  });
}

// The clock the records use (steady_clock), for measuring offsets between ranks.
PyObject* PyNowNs(PyObject*, PyObject*) { return PyLong_FromLongLong(NowNs()); }

PyObject* PyAbortJob(PyObject*, PyObject* arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) return nullptr;
  AbortJob(static_cast<int>(code));
}

// Python's collective communicator setup, watched like a collective.
PyObject* BeginSetup(PyObject*, PyObject* args) {
  const char* description;
  if (!PyArg_ParseTuple(args, "s", &description)) return nullptr;
  InFlight& slot = in_flight[kSetupSlot];
  slot.started_ns.store(0);
  setup_description = description;
  slot.name.store(setup_description.c_str());
  slot.started_ns.store(NowNs());
  Py_RETURN_NONE;
}

PyObject* EndSetup(PyObject*, PyObject*) {
  in_flight[kSetupSlot].started_ns.store(0);
  Py_RETURN_NONE;
}

}  // namespace

PyMethodDef watch_methods[] = {
    {"set_timeout", SetTimeout, METH_O, "Abort the job if a collective waits longer (0 = off)."},
    {"set_stall_report", SetStallReport, METH_O,
     "Report a collective that waits longer than this, for the whole job (0 = off)."},
    {"set_side_channel", SetSideChannel, METH_O,
     "The communicator (handle) the watchdogs ask each other's state on."},
    {"describe_site", DescribeSite, METH_VARARGS, "(site, where it was traced) for reports."},
    {"set_flight", SetFlight, METH_VARARGS,
     "(records kept per device, 0 = off; directory the dumps go to)."},
    {"set_trace", SetTrace, METH_O, "Keep every record, written to this directory ('' = off)."},
    {"set_clock_offset", SetClockOffset, METH_O,
     "Rank 0's clock minus this rank's, in ns (written with the records)."},
    {"set_host_names", SetHostNames, METH_O, "Every rank's host name, in rank order."},
    {"write_trace", PyWriteTrace, METH_O, "Write the timeline's records now (reason)."},
    {"dump_flight", PyDumpFlight, METH_O, "Write the flight recorder's records now (reason)."},
    {"now_ns", PyNowNs, METH_NOARGS, "The records' clock, in ns."},
    {"announce_abort", PyAnnounceAbort, METH_O,
     "Tell every rank this one ends the job; after settling (ms), the rank that prints "
     "the traceback."},
    {"stop_watchdog", PyStopWatchdog, METH_NOARGS,
     "At exit, before MPI is finalized: the watchdog makes no more MPI calls."},
    {"begin_setup", BeginSetup, METH_VARARGS,
     "Watch a collective setup step (MPICOLL_TIMEOUT) described by the argument."},
    {"end_setup", EndSetup, METH_NOARGS, "End the watched setup step."},
    {"abort_job", PyAbortJob, METH_O,
     "Abort every rank with this exit code, after letting the launcher forward stderr."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mpicoll

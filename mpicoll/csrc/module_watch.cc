// The module's functions for watching the job (observe/failures.py, runtime/settings.py,
// runtime/comm.py): the watchdog's thresholds and side channel, the watched
// communicator setup, the abort that ends the job, and the flight recorder and
// timeline (watch/watchdog.h, watch/flight.h).  module.cc joins their table to
// its own at import.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <atomic>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/comm_table.h"
#include "watch/call_sites.h"
#include "watch/records_file.h"
#include "watch/guard.h"
#include "watch/watchdog.h"
#include "module_parts.h"

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

PyObject* PySetTimeout(PyObject*, PyObject* arg) {
  return SetWatchdogSeconds(arg, watch_settings.timeout_seconds);
}

PyObject* PySetStallReport(PyObject*, PyObject* arg) {
  return SetWatchdogSeconds(arg, watch_settings.stall_report_seconds);
}

// The watchdogs' private duplicate of COMM_WORLD, made in Python at
// COMM_WORLD's first use in the serialized mode.
PyObject* PySetSideChannel(PyObject*, PyObject* arg) {
  unsigned long long handle = PyLong_AsUnsignedLongLong(arg);
  if (PyErr_Occurred()) return nullptr;
  side_channel.store(HandleFromInteger<MPI_Comm>(handle));
  Py_RETURN_NONE;
}

// At import (MPI_THREAD_MULTIPLE): duplicate COMM_WORLD for the side channel
// without blocking on a rank that never imports mpicoll (rank_state.h).
PyObject* PyOpenSideChannel(PyObject*, PyObject*) {
  NoteWorld();
  side_channel_opening.Begin();
  StartWatchdog();
  // Completed here when every rank imports within 10 s (the usual case): Open
  // MPI 4.1 can deadlock a blocking MPI_Comm_dup (the user's, or a first use's)
  // against a nonblocking one still pending.  A rank that has not imported by
  // then leaves it to the watchdog.
  Py_BEGIN_ALLOW_THREADS
  side_channel_opening.Finish(/*seconds=*/10.0);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// The side channel's handle once it is open, else None; RuntimeError saying why
// where its opening failed (a rank lost first: Python raises RankLost).
PyObject* PySideChannelHandle(PyObject*, PyObject*) {
  const MPI_Comm comm = side_channel.load();
  if (comm == MPI_COMM_NULL) {
    if (const std::string failure = side_channel_opening.Failure(); !failure.empty()) {
      PyErr_SetString(PyExc_RuntimeError, failure.c_str());
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  return PyLong_FromUnsignedLongLong(IntegerFromHandle(comm));
}

// announce_end(ending, exit code, where): this rank's script finished (1) or
// its process exits (2); see AnnounceEnd.
PyObject* PyAnnounceEnd(PyObject*, PyObject* args) {
  int ending, code;
  const char* where;
  if (!PyArg_ParseTuple(args, "iis", &ending, &code, &where)) return nullptr;
  const std::string text = where;
  Py_BEGIN_ALLOW_THREADS
  AnnounceEnd(ending, code, text);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// describe_site(site, "file:line (function)", compared, written_as): compared=False
// for an eager call's site (JAX caches its program by signature, so the line is
// its first caller's): every-call checks then leave the site out.  written_as:
// the collective as the user wrote it where that was not mpicoll's own name
// ("jax.lax.psum over ('mpicoll.RANKS', 'dev')"), "" otherwise.
PyObject* PyDescribeSite(PyObject*, PyObject* args) {
  long long site;
  const char* text;
  int compared = 1;
  const char* written_as = "";
  if (!PyArg_ParseTuple(args, "Ls|ps", &site, &text, &compared, &written_as)) return nullptr;
  std::lock_guard<std::mutex> lock(call_sites.mutex);
  if (*text) call_sites.descriptions[site] = text;
  if (*written_as) call_sites.written_as[site] = written_as;
  if (!compared) call_sites.uncompared.insert(site);
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

// The rank that prints the traceback ending the job: the other ranks' records
// into its folder (GatherRecords), before it aborts.
PyObject* PyGatherRecords(PyObject*, PyObject* arg) {
  const double seconds = PyFloat_AsDouble(arg);
  if (seconds == -1.0 && PyErr_Occurred()) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  GatherRecords(seconds);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// At import, with the GIL: the main thread's identifier
// (threading.main_thread().ident), mpicoll's package folder, and the
// interpreter, for the watchdog to read Python stacks
// without the GIL (watch/python_stacks.h).
PyObject* PyWatchPythonThreads(PyObject*, PyObject* args) {
  unsigned long main_thread;
  const char* package_dir;
  if (!PyArg_ParseTuple(args, "ks", &main_thread, &package_dir)) return nullptr;
  // set once, before the watchdog reads it
  if (watched_python.package_dir.empty()) watched_python.package_dir = package_dir;
  watched_python.main_thread.store(main_thread);
  watched_python.interpreter.store(PyInterpreterState_Get());
  Py_RETURN_NONE;
}

// This process's Python stacks as a report prints them (tests, and a check
// that this Python lets them be read).
PyObject* PyPythonStacks(PyObject*, PyObject*) {
  std::string text;
  Py_BEGIN_ALLOW_THREADS
  text = PythonStacks();
  Py_END_ALLOW_THREADS
  return PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
}

PyObject* PyStopWatchdog(PyObject*, PyObject*) {
  Py_BEGIN_ALLOW_THREADS
  StopWatchdog();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// The flight recorder and the timeline (watch/flight.h): set once, at import,
// before the first collective.  set_flight(records per device, dump
// directory, temporary directory): with dir "", the job's folder in this
// user's private folder of the temporary directory (watch/own_files.h), named
// when the ranks have met; this process's own until then.
PyObject* PySetFlight(PyObject*, PyObject* args) {
  long long capacity;
  const char* dir;
  const char* temp;
  if (!PyArg_ParseTuple(args, "Lss", &capacity, &dir, &temp)) return nullptr;
  const long long most = static_cast<long long>(kChunkRecords * kMaxChunks);
  {
    std::lock_guard<std::mutex> lock(flight.mutex);
    flight.flight_dir = dir;
    flight.private_root = PrivateRootIn(temp);
    flight.job_flight_dir = !dir[0];
  }
  if (!dir[0]) {
    const ProcessId me = ThisProcess();
    ChooseJobFlightDir(me.host, me.pid);
  }
  flight.capacity.store(capacity < 0 ? 0 : std::min(capacity, most));
  NoteWorld();
  if (capacity > 0) StartWatchdog();  // it writes the dumps SIGUSR1 asks for
  Py_RETURN_NONE;
}

// set_trace(directory, skip=0): start a trace there, each call site's first
// `skip` calls per device left out ("" = off, nothing written).
PyObject* PySetTrace(PyObject*, PyObject* args) {
  const char* dir;
  long long skip = 0;
  if (!PyArg_ParseTuple(args, "s|L", &dir, &skip)) return nullptr;
  if (dir[0]) {
    StartTrace(dir, skip < 0 ? 0 : skip);
  } else {
    flight.tracing.store(false);
    std::lock_guard<std::mutex> lock(flight.mutex);
    flight.trace_dir.clear();
  }
  NoteWorld();
  Py_RETURN_NONE;
}

PyObject* PySetClockOffset(PyObject*, PyObject* arg) {
  const long long offset = PyLong_AsLongLong(arg);
  if (offset == -1 && PyErr_Occurred()) return nullptr;
  flight.clock_offset_ns.store(offset);
  Py_RETURN_NONE;
}

// set_world_processes([(host, pid), ...]) in rank order (the serialized mode's
// side channel gathers them in Python).
PyObject* PySetWorldProcesses(PyObject*, PyObject* arg) {
  PyObject* items = PySequence_Fast(arg, "set_world_processes: a sequence of (host, pid)");
  if (!items) return nullptr;
  std::vector<ProcessId> all;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); ++i) {
    const char* host;
    long long pid;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(items, i), "sL", &host, &pid)) {
      Py_DECREF(items);
      return nullptr;
    }
    all.emplace_back();
    Copy(all.back().host, sizeof(all.back().host), host);
    all.back().pid = pid;
  }
  Py_DECREF(items);
  SetWorldProcesses(all);
  Py_RETURN_NONE;
}

// The flight records' folder now (it is chosen for the job when the ranks meet).
// check_folder(path, private root, create) -> "" or why mpicoll would not write
// there (watch/own_files.h's rule; runtime/own_files.py is its Python twin).
PyObject* PyCheckFolder(PyObject*, PyObject* args) {
  const char* path;
  const char* root;
  int create;
  if (!PyArg_ParseTuple(args, "ssp", &path, &root, &create)) return nullptr;
  std::string problem;
  Py_BEGIN_ALLOW_THREADS
  problem = OpenOwnFolder(path, root, create != 0).problem();
  Py_END_ALLOW_THREADS
  return PyUnicode_FromString(problem.c_str());
}

PyObject* PyPrivateRoot(PyObject*, PyObject*) {
  return PyUnicode_FromString(FolderOf(flight.private_root).c_str());
}

PyObject* PyFlightDir(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> lock(flight.mutex);
  return PyUnicode_FromString(flight.flight_dir.c_str());
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
    return WriteTrace(WorldRank(), comm_world.size.load(), why);
  });
}

PyObject* PyStopTrace(PyObject*, PyObject* arg) {
  return WriteRecordsNow(arg, [](const std::string& why) {
    return StopTrace(WorldRank(), comm_world.size.load(), why);
  });
}

PyObject* PyDumpFlight(PyObject*, PyObject* arg) {
  return WriteRecordsNow(arg, [](const std::string& why) {
    flight.last_dump_ns.store(0);  // asked for: not rate-limited
    return DumpFlight(WorldRank(), comm_world.size.load(), why);
  });
}

// The clock the records use (steady_clock), for measuring offsets between ranks.
PyObject* PyNowNs(PyObject*, PyObject*) { return PyLong_FromLongLong(NowNs()); }

PyObject* PyAbortJob(PyObject*, PyObject* arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) return nullptr;
  AbortJob(static_cast<int>(code));
}

// Python's collective communicator setup, watched like a collective:
// begin_setup(the call that uses it first, the communicator's name, its
// members' COMM_WORLD ranks as "0,1,2").
PyObject* PyBeginSetup(PyObject*, PyObject* args) {
  const char* call;
  const char* name;
  const char* members;
  if (!PyArg_ParseTuple(args, "sss", &call, &name, &members)) return nullptr;
  InFlight& slot = in_flight[kSetupSlot];
  slot.started_ns.store(0);
  {
    std::lock_guard<std::mutex> lock(comm_setup.mutex);
    comm_setup.call = call;
    comm_setup.comm = name;
    // Device 0's duplicate's identity (comm.py names it so).
    comm_setup.identity = CommIdentity{std::string("mpicoll:") + name + ":device0", members};
  }
  slot.name.store("communicator setup");
  slot.started_ns.store(NowNs());
  Py_RETURN_NONE;
}

PyObject* PyEndSetup(PyObject*, PyObject*) {
  in_flight[kSetupSlot].started_ns.store(0);
  Py_RETURN_NONE;
}

// set_communication_totals(on): count every call's time for the end-of-job
// summary (watch/totals.h), from now on.
PyObject* PySetCommunicationTotals(PyObject*, PyObject* arg) {
  return StoreFlag(communication_totals.on, arg);
}

// communication_totals() -> [(slot, kind, calls, ns, bytes, max_ns)], the slots
// that made calls.
PyObject* PyCommunicationTotals(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  if (!out) return nullptr;
  for (int slot = 0; slot < kCallSlots; ++slot) {
    std::vector<KindTotals> kinds;
    {
      std::lock_guard<std::mutex> lock(communication_totals.slots[slot].mutex);
      kinds = communication_totals.slots[slot].kinds;
    }
    for (const KindTotals& k : kinds) {
      PyObject* row = Py_BuildValue("(isLLLL)", slot, k.kind, static_cast<long long>(k.calls),
                                    static_cast<long long>(k.ns), static_cast<long long>(k.bytes),
                                    static_cast<long long>(k.max_ns));
      if (!row || PyList_Append(out, row) < 0) {
        Py_XDECREF(row);
        Py_DECREF(out);
        return nullptr;
      }
      Py_DECREF(row);
    }
  }
  return out;
}

}  // namespace

PyMethodDef watch_methods[] = {
    {"set_timeout", PySetTimeout, METH_O, "Abort the job if a collective waits longer (0 = off)."},
    {"set_stall_report", PySetStallReport, METH_O,
     "Report a collective that waits longer than this, for the whole job (0 = off)."},
    {"set_side_channel", PySetSideChannel, METH_O,
     "The communicator (handle) the watchdogs ask each other's state on."},
    {"describe_site", PyDescribeSite, METH_VARARGS,
     "(site, where it was traced, whether every-call checks compare it) for reports."},
    {"set_communication_totals", PySetCommunicationTotals, METH_O,
     "Count each call's kind, time and bytes for the end-of-job summary (on/off)."},
    {"communication_totals", PyCommunicationTotals, METH_NOARGS,
     "[(slot, kind, calls, ns, bytes, max ns)] counted so far."},
    {"set_flight", PySetFlight, METH_VARARGS,
     "(records kept per device, 0 = off; directory the dumps go to, '' = a folder for the "
     "job under the third argument)."},
    {"set_trace", PySetTrace, METH_VARARGS,
     "Start a trace to this directory, each site's first skip calls left out ('' = off)."},
    {"set_clock_offset", PySetClockOffset, METH_O,
     "Rank 0's clock minus this rank's, in ns (written with the records)."},
    {"set_world_processes", PySetWorldProcesses, METH_O,
     "Every rank's (host, pid), in rank order."},
    {"flight_dir", PyFlightDir, METH_NOARGS, "The folder flight records are written to now."},
    {"private_root", PyPrivateRoot, METH_NOARGS,
     "This user's folder in the temporary directory (the stacks report, the job's records)."},
    {"check_folder", PyCheckFolder, METH_VARARGS,
     "(path, private root, create) -> '' or why mpicoll would not write there."},
    {"gather_records", PyGatherRecords, METH_O,
     "Ask the other ranks for their flight records and write them beside this rank's."},
    {"watch_python_threads", PyWatchPythonThreads, METH_VARARGS,
     "Let the watchdog read this interpreter's stacks (main thread id, package folder)."},
    {"python_stacks", PyPythonStacks, METH_NOARGS,
     "This process's Python stacks as a report prints them."},
    {"open_side_channel", PyOpenSideChannel, METH_NOARGS,
     "Start opening the watchdogs' side channel (MPI_THREAD_MULTIPLE, at import)."},
    {"side_channel_handle", PySideChannelHandle, METH_NOARGS,
     "The side channel's MPI handle once open, else None."},
    {"announce_end", PyAnnounceEnd, METH_VARARGS,
     "(ending, exit code, where): this rank's script finished (1) or its process exits (2)."},
    {"write_trace", PyWriteTrace, METH_O, "Write the timeline's records now (reason)."},
    {"stop_trace", PyStopTrace, METH_O, "Stop the trace and write it (reason) -> written."},
    {"dump_flight", PyDumpFlight, METH_O, "Write the flight recorder's records now (reason)."},
    {"now_ns", PyNowNs, METH_NOARGS, "The records' clock, in ns."},
    {"announce_abort", PyAnnounceAbort, METH_O,
     "Tell every rank this one ends the job; after settling (ms), the rank that prints "
     "the traceback."},
    {"stop_watchdog", PyStopWatchdog, METH_NOARGS,
     "At exit, before MPI is finalized: the watchdog makes no more MPI calls."},
    {"begin_setup", PyBeginSetup, METH_VARARGS,
     "Watch a collective setup step (MPICOLL_TIMEOUT) described by the argument."},
    {"end_setup", PyEndSetup, METH_NOARGS, "End the watched setup step."},
    {"abort_job", PyAbortJob, METH_O,
     "Abort every rank with this exit code, after letting the launcher forward stderr."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mpicoll

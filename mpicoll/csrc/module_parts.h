// The method tables of the module's units, which module.cc joins into one at
// import (AllMethods): each unit binds one concern.
//   module.cc          set-up (registrations, initialize, communicators) and settings
//   module_watch.cc    watching the job: timeouts, stall reports, aborts, records
//   module_tables.cc   the extension's tables as Python data
//   module_survive.cc  surviving a lost rank
//   module_testing.cc  hooks for tests alone
//   mpiabi/jax_calls.cc  JAX's own collectives on mpicoll's MPI (jax_calls.h)
#pragma once

#include <Python.h>

#include <atomic>

namespace mpicoll {

// flag = bool(arg): the body of each on/off setter Python calls.
inline PyObject* StoreFlag(std::atomic<bool>& flag, PyObject* arg) {
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return nullptr;
  flag.store(on != 0);
  Py_RETURN_NONE;
}

// Each ends with a {nullptr} entry, like every method table.
extern PyMethodDef watch_methods[];
extern PyMethodDef table_methods[];
extern PyMethodDef survive_methods[];
extern PyMethodDef testing_methods[];

}  // namespace mpicoll

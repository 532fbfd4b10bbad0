// The module's functions for watching the job, defined in module_watch.cc.
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

// Ends with a {nullptr} entry, like every method table; module.cc appends it to
// its own.
extern PyMethodDef watch_methods[];

}  // namespace mpicoll

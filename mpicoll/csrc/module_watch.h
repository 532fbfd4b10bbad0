// The module's functions for watching the job, defined in module_watch.cc.
#pragma once

#include <Python.h>

namespace mpicoll {

// Ends with a {nullptr} entry, like every method table; module.cc appends it to
// its own.
extern PyMethodDef watch_methods[];

}  // namespace mpicoll

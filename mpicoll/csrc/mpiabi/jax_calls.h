// The module's functions for JAX's CPU collectives on mpicoll's MPI, defined in
// mpiabi/jax_calls.cc.
#pragma once

#include <Python.h>

namespace mpicoll {

// Ends with a {nullptr} entry; module.cc appends it to its own.
extern PyMethodDef jax_mpi_methods[];

}  // namespace mpicoll

// The module's functions that hand the extension's tables to Python as data
// (reduce_ops.def, dtypes.def, ops.def, meeting/kinds.def, and which sums this
// MPI needs replaced), so Python never duplicates a numbering or a row.
// module.cc joins this table to its own at import.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>

#include <cstdint>
#include <utility>

#include "engine/collectives.h"
#include "engine/dtypes.h"
#include "engine/reduce_ops.h"
#include "meeting/kinds.def"
#include "module_parts.h"
#include "ops.def"

namespace mpicoll {
namespace {

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

}  // namespace

PyMethodDef table_methods[] = {
    {"op_codes", PyOpCodes, METH_NOARGS, "Reduction operator name -> code used by the handlers."},
    {"reduction_ops", PyReductionOps, METH_NOARGS,
     "Reduction operator name -> (code, the dtype families it is defined for), from reduce_ops.def."},
    {"dtypes", PyDtypes, METH_NOARGS,
     "numpy dtype name -> its family (bool, integer, floating, complex), from dtypes.def."},
    {"collectives", PyCollectives, METH_NOARGS,
     "Collective name -> its row of ops.def (family, reduces, rooted, blocks_in, ...)."},
    {"meeting_kinds", PyMeetingKinds, METH_NOARGS,
     "Local meeting kind name -> (code, rows_in): meeting/kinds.def's rows."},
    {"replaced_sums", PyReplacedSums, METH_NOARGS,
     "Dtypes whose MPI_SUM saturates in this MPI and is replaced by a wrapping operator."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace mpicoll

// Every function of names.def that library.cc does not define: a weak stub
// that names the function and ends the job (library.cc's definitions, strong,
// take their place at link time).  The stubs take no arguments: whatever the
// caller passed is left unread (the System V calling convention lets a caller
// pass what it likes to a function that reads nothing).
[[noreturn]] void MpiabiUnsupported(const char* name);

extern "C" {
#define MPIABI_CONSTANT(name)
#define MPIABI_FUNCTION(name)                                                          \
  __attribute__((weak, visibility("default"))) int MPIABI_##name() {                  \
    MpiabiUnsupported(#name);                                                          \
  }
#define MPIXABI_FUNCTION(name)                                                         \
  __attribute__((weak, visibility("default"))) int MPIXABI_##name() {                 \
    MpiabiUnsupported(#name);                                                          \
  }
#include "names.def"
#undef MPIABI_CONSTANT
#undef MPIABI_FUNCTION
#undef MPIXABI_FUNCTION
}

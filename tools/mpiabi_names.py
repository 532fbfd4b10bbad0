#!/usr/bin/env python3
"""The MPI ABI names a jaxlib's embedded MPItrampoline resolves, as mpicoll's table.

    tools/mpiabi_names.py [LIBJAX_COMMON]      print the names (default: the installed jaxlib's)
    tools/mpiabi_names.py --write [LIBJAX_COMMON]   rewrite mpicoll/csrc/mpiabi/names.def

The trampoline (MPItrampoline 5.3.1 in jaxlib 0.10 and 0.12) looks up every
function and constant of the MPI ABI in the library MPITRAMPOLINE_LIB names, and
ends the process at the first it cannot find; mpicoll's library
(csrc/mpiabi/library.cc) exports one symbol per line of names.def.  The names
are the strings `MPIABI_*` / `MPIXABI_*` of libjax_common.so; by the MPI
standard's spelling a name with a lower-case letter after the prefix is a
function (MPIABI_Allreduce), one without a constant (MPIABI_COMM_WORLD,
MPIABI_COMM_DUP_FN).  tests/test_jax_collectives.py checks that the installed
jaxlib's names are all in the table.
"""

import os
import re
import sys
from pathlib import Path

TABLE = Path(__file__).resolve().parent.parent / "mpicoll" / "csrc" / "mpiabi" / "names.def"
_NAME = re.compile(rb"(MPIX?ABI)_([A-Za-z0-9_]+)\0")


def installed_libjax_common():
    import importlib.util

    spec = importlib.util.find_spec("jaxlib")
    if spec is None:
        sys.exit("tools/mpiabi_names.py: no jaxlib installed; give libjax_common.so's path")
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder / "libjax_common.so"


def names_in(library):
    """{(prefix, name, kind)} of the ABI names in `library` (kind: function or constant)."""
    data = Path(library).read_bytes()
    found = set()
    for prefix, name in _NAME.findall(data):
        prefix, name = prefix.decode(), name.decode()
        kind = "FUNCTION" if re.search("[a-z]", name) else "CONSTANT"
        found.add((prefix, name, kind))
    return found


def table_lines(found):
    return [f"{prefix}_{kind}({name})" for prefix, name, kind in
            sorted(found, key=lambda f: (f[0], f[2], f[1]))]


def read_table(path=TABLE):
    """{(prefix, name, kind)} listed in names.def."""
    rows = set()
    for line in Path(path).read_text().splitlines():
        match = re.fullmatch(r"(MPIX?ABI)_(FUNCTION|CONSTANT)\((\w+)\)", line.strip())
        if match:
            rows.add((match[1], match[3], match[2]))
    return rows


HEADER = """\
// Every name of the MPI ABI that jaxlib's MPItrampoline resolves in the library
// MPITRAMPOLINE_LIB names: csrc/mpiabi/library.cc exports one symbol per line
// (a constant, or a function: the ones XLA's CPU collectives call forward to
// mpicoll's MPI, every other one says it is unsupported and ends the job).
// Made by tools/mpiabi_names.py from jaxlib 0.10.2 and 0.12.0.1 (the same 634
// names); tests/test_jax_collectives.py checks the installed jaxlib against it.
"""


def main(argv):
    write = "--write" in argv
    paths = [a for a in argv if a != "--write"]
    library = paths[0] if paths else installed_libjax_common()
    found = names_in(library)
    if not found:
        sys.exit(f"tools/mpiabi_names.py: no MPIABI names in {library}")
    lines = table_lines(found)
    if write:
        TABLE.write_text(HEADER + "\n".join(lines) + "\n")
        print(f"{TABLE}: {len(lines)} names from {library}")
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

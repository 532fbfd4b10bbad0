"""benchmarks/mpi_floor.c from Python: built with the MPI compiler wrapper, loaded with ctypes."""

import ctypes
import os
import shlex
import subprocess
import sys
from pathlib import Path

from cases import OPS

FLOOR_SOURCE = Path(__file__).resolve().parent / "mpi_floor.c"
OP_CODES = {name: i for i, name in enumerate(OPS)}  # benchmarks/mpi_floor.c's numbering


class FloorLibrary:
    """benchmarks/mpi_floor.c through ctypes, on a private duplicate of COMM_WORLD."""

    def __init__(self, path, comm):
        self.lib = ctypes.CDLL(str(path))
        self.fn = self.lib.mpi_floor_run
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                            ctypes.POINTER(ctypes.c_double)]
        self.comm = comm
        self.comm_f = comm.py2f()

    def call(self, op, x, out, count, iters, repeats=0):
        times = (ctypes.c_double * max(1, repeats))()
        rc = self.fn(OP_CODES[op], self.comm_f, x.ctypes.data, out.ctypes.data, count, iters,
                     repeats, times)
        if rc != 0:
            raise RuntimeError(f"mpi_floor_run({op}) returned MPI error {rc}")
        return list(times)[:repeats]


def load_floor(path, comm):
    """(FloorLibrary, its path) or (None, why not): `path`, else built (rank 0) next to this venv."""
    error = None
    if path is None:
        path = Path(sys.prefix) / "mpi_floor.so"
        if comm.Get_rank() == 0:
            stale = not path.exists() or path.stat().st_mtime < FLOOR_SOURCE.stat().st_mtime
            if stale:
                error = build_floor(path)
        error = comm.bcast(error, root=0)
    if error is None and not Path(path).exists():
        error = f"{path} does not exist (make bench builds it)"
    if error is None:
        try:
            return FloorLibrary(path, comm.Dup()), f"{path}"
        except OSError as e:
            error = f"cannot load {path}: {e}"
    return None, error


def find_mpicc():
    """The MPI compiler wrapper of the MPI mpi4py uses: $MPICC, the one the Makefile chose
    for this venv, the venv's own (PyPI MPI wheel), or mpicc on PATH."""
    choice = Path(sys.prefix) / ".mpicc-choice"
    candidates = [os.environ.get("MPICC"),
                  choice.read_text().strip() if choice.exists() else None,
                  str(Path(sys.prefix) / "bin" / "mpicc"), "mpicc"]
    for candidate in candidates:
        if candidate and (Path(shlex.split(candidate)[0]).exists()
                          or subprocess.run(["sh", "-c", f"command -v {shlex.split(candidate)[0]}"],
                                            capture_output=True).returncode == 0):
            return candidate
    return None


def build_floor(path):
    """Compile mpi_floor.c into the shared library `path`; None, or what went wrong."""
    mpicc = find_mpicc()
    if mpicc is None:
        return "no MPI compiler wrapper (set MPICC) to build benchmarks/mpi_floor.c"
    command = [*shlex.split(mpicc), "-O2", "-fPIC", "-shared", str(FLOOR_SOURCE),
               "-o", str(path)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}"
    return None

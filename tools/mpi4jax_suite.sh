#!/bin/sh
# mpi4jax's own test suite run against mpicoll.mpi4jax (`make test-mpi4jax-suite`).
#
#   tools/mpi4jax_suite.sh PYTHON "MPIEXEC [FLAGS]" "RANKS" [TIMEOUT]
#
# Downloads mpi4jax's source distribution from PyPI (pip, with a timeout; the
# tests are not in the wheel) into build/mpi4jax-suite, unpacks its tests/ and
# examples/, and runs them with a shim first on PYTHONPATH: a package named
# `mpi4jax` whose only content is `from mpicoll.mpi4jax import *`, so every
# `import mpi4jax` in those files gets mpicoll's adapter.  Run at each rank
# count in RANKS (1 = plain pytest).  Without network access it fails, saying so.
#
# Left out: the tests of mpi4jax's private modules (mpi4jax._src: its version
# check, its CUDA/XPU import decorators, its argument-type decorator, its
# logging switch and its MPI ABI check).  They test how mpi4jax is built, not
# its API, and mpicoll.mpi4jax is an adapter over mpicoll's public API only.
set -eu

PYTHON=$1
MPIEXEC=$2
RANKS=$3
TIMEOUT=${4:-900}
VERSION=0.9.1.post2
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=$HERE/build/mpi4jax-suite
SDIST=$WORK/mpi4jax-$VERSION.tar.gz
SRC=$WORK/mpi4jax-$VERSION
SHIM=$WORK/shim

mkdir -p "$WORK"
if [ ! -f "$SDIST" ]; then
    echo "=== downloading mpi4jax $VERSION's source distribution (pip download, 300 s limit)"
    if ! timeout 300 "$PYTHON" -m pip --disable-pip-version-check download -q --no-deps \
            --no-binary mpi4jax --no-build-isolation "mpi4jax==$VERSION" -d "$WORK.tmp"; then
        rm -rf "$WORK.tmp"
        echo "mpi4jax suite: could not download mpi4jax==$VERSION's sdist from PyPI" \
             "(offline, or PyPI unreachable); put mpi4jax-$VERSION.tar.gz in $WORK to run" \
             "without the network" >&2
        exit 2
    fi
    mv "$WORK.tmp/mpi4jax-$VERSION.tar.gz" "$SDIST"
    rm -rf "$WORK.tmp"
fi
rm -rf "$SRC" "$SHIM"
# pyproject.toml: its pytest settings, and it makes the suite its own pytest rootdir.
tar -xzf "$SDIST" -C "$WORK" "mpi4jax-$VERSION/tests" "mpi4jax-$VERSION/examples" \
    "mpi4jax-$VERSION/pyproject.toml"
mkdir -p "$SHIM/mpi4jax"
cat > "$SHIM/mpi4jax/__init__.py" <<'EOF'
"""mpi4jax's name for mpicoll's adapter: tests written for mpi4jax import this."""
from mpicoll.mpi4jax import *  # noqa: F401,F403
from mpicoll.mpi4jax import __all__, __version__  # noqa: F401
EOF

# The tests of mpi4jax's private modules (see above), and two deliberate
# differences (docs/mpi4jax.md, "Differences"): test_abort_on_error sends to
# rank 100 of a 1-rank communicator and expects MPI_Send's error text from
# mpi4jax's C code, where mpicoll rejects the rank before any MPI call
# (ValueError); test_sendrecv_jacfwd expects forward-mode AD of sendrecv to
# raise, where mpicoll differentiates it (the JVP is the sendrecv of tangents).
PRIVATE="--ignore=tests/test_jax_compat.py --ignore=tests/test_decorators.py
 --deselect=tests/collective_ops/test_common.py::test_abort_on_error
 --deselect=tests/collective_ops/test_sendrecv.py::test_sendrecv_jacfwd
 --ignore=tests/test_validation.py
 --deselect=tests/collective_ops/test_common.py::test_debug_logging
 --deselect=tests/collective_ops/test_common.py::test_set_logging_from_envvar
 --deselect=tests/collective_ops/test_common.py::test_mpi_abi_info
 --deselect=tests/collective_ops/test_common.py::test_mpi_abi_compatibility_check
 --deselect=tests/collective_ops/test_common.py::test_mpi_abi_skip_check"

cd "$SRC"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
failed=""
for n in $RANKS; do
    echo "=== mpi4jax $VERSION's tests on mpicoll.mpi4jax, $n rank(s)"
    if [ "$n" = 1 ]; then
        # shellcheck disable=SC2086
        timeout --kill-after=20 "$TIMEOUT" "$PYTHON" -m pytest -q -rfE -p no:cacheprovider \
            $PRIVATE tests || failed="$failed $n"
    else
        # shellcheck disable=SC2086
        timeout --kill-after=20 "$TIMEOUT" $MPIEXEC -n "$n" \
            "$PYTHON" -m pytest -q -rfE -p no:cacheprovider $PRIVATE tests \
            || failed="$failed $n"
    fi
done
if [ -n "$failed" ]; then
    echo "mpi4jax suite: failures at rank count(s):$failed" >&2
    exit 1
fi

PY=/opt/torch/.venv/bin/python
$PY -c 'import pytest_mpi' 2>/dev/null || $PY -m pip install -q --no-deps --no-index --find-links .gpu-wheels pytest-mpi
MPICC=/usr/bin/mpicc timeout 300 $PY setup.py -q build_ext --inplace > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
export PYTHONPATH=$PWD MPICOLL_MPIEXEC=/usr/bin/mpiexec OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 JAX_PLATFORMS=cpu
timeout -s KILL 420 $PY -m pytest tests/test_divergence.py tests/test_watchdog.py -q -p no:cacheprovider --durations=8 2>&1 | tail -25

#!/usr/bin/env bash
# The GPU suite on a GPU node, in one call: build mpicoll with CUDA in place,
# print `python -m mpicoll info`, run the tests on GPU arrays at 1 and 2 ranks
# (two ranks share one GPU when there is only one), and optionally the GPU
# benchmark.  Works offline: wheels it needs (pytest-mpi, the mpi4jax sdist for
# the benchmark) are taken from $GPU_WHEELS (default .gpu-wheels/, filled here
# by `make gpu-wheels`).  Every step runs under a timeout.
#
#   tools/gpu_suite.sh [test|bench|mesh|all]   (default: test)
#
# mesh: the global-mesh benchmark on the node's CPU cores, where each device
# thread has a core: benchmarks/global_mesh_collectives.py at 2
# processes x L = 1, 2, 4 CPU devices, and at L = 2, 4 again with the
# meeting's all_gather gathered whole (MPICOLL_GATHER_PIECES=1, tag -whole),
# the A/B of its pieces; the results' JSON files go to $OUT.
#
# Variables: GPU_PYTHON (python3: the interpreter whose jax has the CUDA plugin),
# MPICC (mpicc on PATH), GPU_TESTS (the test files), GPU_RANKS ("1 2"),
# GPU_TEST_TIMEOUT (seconds per pytest run), BENCH_ARGS, OUT (a directory for
# logs and results; default a fresh one from mktemp).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-test}
PY=$(command -v "${GPU_PYTHON:-python3}")  # absolute: ranks may get another PATH
MPICC=${MPICC:-$(command -v mpicc)}
MPIEXEC=$(dirname "$(command -v "$MPICC")")/mpiexec
WHEELS=${GPU_WHEELS:-.gpu-wheels}
# A fresh private folder unless OUT names one: a fixed /tmp name could be another
# user's, and the C floor library built there is loaded.
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-gpu.XXXXXX")}
mkdir -p "$OUT"
echo "gpu_suite: logs and results in $OUT"
TESTS=${GPU_TESTS:-tests/test_gpu.py tests/test_collectives.py tests/test_fusion.py tests/test_transforms.py tests/test_ordering.py tests/test_errors.py tests/test_comms.py tests/test_lowering.py}
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # ranks sharing a GPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build, for scripts outside the root
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PIP_NO_INDEX=1
failed=""

step() { echo; echo "=== gpu_suite: $*"; }

step "build with CUDA ($MPICC, $PY)"
"$PY" -c 'import pytest_mpi' 2>/dev/null || "$PY" -m pip install -q --no-deps --find-links "$WHEELS" pytest-mpi
MPICOLL_CUDA=1 MPICC="$MPICC" timeout 300 "$PY" setup.py -q build_ext --inplace || exit 1
timeout 120 "$MPIEXEC" --oversubscribe -n 2 "$PY" -m mpicoll info || failed="$failed info"

if [ "$what" = test ] || [ "$what" = all ]; then
    for n in ${GPU_RANKS:-1 2}; do
        step "tests at $n rank(s): $TESTS"
        start=$SECONDS
        if [ "$n" = 1 ]; then
            cmd=("$PY" -m pytest -q -rs -p no:cacheprovider $TESTS)
        else
            cmd=("$MPIEXEC" --oversubscribe -n "$n" sh tools/rank-output.sh "$PY" -m pytest
                 --with-mpi -q --color=no -p no:cacheprovider $TESTS)
            export RANK_LOG_DIR="$OUT/ranks-$n"; mkdir -p "$RANK_LOG_DIR"
        fi
        timeout --kill-after=20 "${GPU_TEST_TIMEOUT:-500}" "${cmd[@]}" || failed="$failed tests@$n"
        echo "=== gpu_suite: tests at $n rank(s) took $((SECONDS - start)) s"
    done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
    step "mpi4jax with CUDA (for the benchmark)"
    if ! "$PY" -c 'import mpi4jax' 2>/dev/null; then
        CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} MPI4JAX_BUILD_MPICC="$MPICC" timeout 300 \
            "$PY" -m pip install -q --no-build-isolation --no-deps "$WHEELS"/mpi4jax-*.tar.gz \
            > "$OUT/mpi4jax-build.log" 2>&1 || tail -5 "$OUT/mpi4jax-build.log"
    fi
    "$MPICC" -O2 -fPIC -shared benchmarks/mpi_floor.c -o "$OUT/mpi_floor.so"
    for n in 1 2; do
        step "GPU benchmark at $n rank(s)"
        timeout --kill-after=20 "${GPU_BENCH_TIMEOUT:-400}" "$MPIEXEC" --oversubscribe -n "$n" \
            "$PY" benchmarks/gpu_bench.py --floor-lib "$OUT/mpi_floor.so" --out "$OUT" \
            ${BENCH_ARGS:-} || failed="$failed bench@$n"
    done
fi

if [ "$what" = mesh ] || [ "$what" = all ]; then
    "$MPICC" -O2 -fPIC -shared benchmarks/mpi_floor.c -o "$OUT/mpi_floor.so"
    for run in "1 -" "2 -" "4 -" "2 -whole" "4 -whole"; do
        set -- $run
        tag=${2#-}; tag=${tag:+-$tag}
        step "global mesh on CPU cores: 2 processes x $1 devices${tag:+ ($tag)}"
        env JAX_PLATFORMS=cpu ${tag:+MPICOLL_GATHER_PIECES=1} timeout --kill-after=20 \
            "${MESH_BENCH_TIMEOUT:-300}" "$MPIEXEC" --oversubscribe -n 2 "$PY" \
            benchmarks/global_mesh_collectives.py --local "$1" --no-gloo --repeats 7 \
            --floor-lib "$OUT/mpi_floor.so" --tag="$tag" || failed="$failed mesh@$1$tag"
    done
    cp benchmarks/results/global_mesh_collectives_2proc*.json "$OUT"/ 2>/dev/null
fi

echo
if [ -n "$failed" ]; then echo "=== gpu_suite: FAILED:$failed"; exit 1; fi
echo "=== gpu_suite: all passed"

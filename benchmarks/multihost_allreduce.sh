#!/usr/bin/env bash
# The measurements behind the allreduce cost model (`make bench-multihost`):
# benchmarks/multihost_allreduce.py at 2, 3 and 4 simulated hosts, "flat" (2 ranks per
# host) and "devices" (1 rank per host x 2 devices), and at 2 hosts with 4 and 8 devices
# per host (how the thresholds scale with the device count); then
# benchmarks/allreduce_model.py fits the model to them and writes the table and
# docs/allreduce-model.svg.
#   usage: multihost_allreduce.sh PYTHON   (the venv's python; MPICOLL_MPIEXEC its mpiexec)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: benchmarks/multihost_allreduce.sh PYTHON}
for hosts in ${MULTIHOST_BENCH_HOSTS:-2 3 4}; do
    for mode in flat devices; do
        per_host=$([ "$mode" = flat ] && echo 2 || echo 1)
        echo "=== $hosts hosts, $mode ($per_host rank(s) per host)"
        "$python" launch/simcluster.py run --hosts "$hosts" --ranks-per-host "$per_host" \
            --timeout 400 -- "$python" benchmarks/multihost_allreduce.py "$mode"
    done
done
for local in ${MULTIHOST_BENCH_LOCAL:-4 8}; do
    echo "=== 2 hosts, devices, $local devices per host"
    "$python" launch/simcluster.py run --hosts 2 --ranks-per-host 1 \
        --timeout 400 -- "$python" benchmarks/multihost_allreduce.py devices --local "$local"
done
"$python" benchmarks/allreduce_model.py

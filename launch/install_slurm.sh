#!/usr/bin/env bash
# Install what tests/test_slurm.py needs to run a one-node SLURM cluster on localhost:
# Debian's slurm-wlm (slurmctld, slurmd, the sbatch/srun/squeue clients and the
# basic plugins) and munge (SLURM's authentication daemon).
#
# CI calls this before the test suite.  It never fails the build: where packages
# cannot be installed (not root, no apt, no network) it says why and exits 0, and
# the SLURM test then skips with its own printed reason.
set -uo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there, often not on a user's PATH

have_slurm() { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null 2>&1

if have_slurm; then
    echo "install_slurm: SLURM and munge are already installed ($(slurmctld -V 2>/dev/null))"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_slurm: not root, cannot apt-get install slurm-wlm munge; the SLURM test will skip"
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "install_slurm: no apt-get (not Debian/Ubuntu); the SLURM test will skip"
    exit 0
fi

# noninteractive: the packages' postinst scripts must not prompt (there is no stdin in CI).
# They try to start the services; with no init system that fails harmlessly, and the
# test starts its own daemons with its own configuration anyway.
export DEBIAN_FRONTEND=noninteractive
echo "install_slurm: apt-get install slurm-wlm munge"
if ! apt-get update -qq; then
    echo "install_slurm: apt-get update failed; the SLURM test will skip"
    exit 0
fi
# The log in a fresh file of mktemp's (a fixed /tmp name could be another user's link).
log=$(mktemp "${TMPDIR:-/tmp}/install_slurm.XXXXXX.log")
if ! apt-get install -y -qq --no-install-recommends slurm-wlm munge >"$log" 2>&1; then
    tail -n 20 "$log"
    echo "install_slurm: apt-get install failed; the SLURM test will skip"
    exit 0
fi
have_slurm && echo "install_slurm: installed $(slurmctld -V)"
exit 0

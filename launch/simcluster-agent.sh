#!/bin/sh
# The ssh stand-in of launch/simcluster.py: mpiexec runs it, as it would run ssh, to
# start its daemon on a simulated host ("simcluster-agent.sh [-x] HOST COMMAND...",
# Open MPI's orted or MPICH's hydra_pmi_proxy).  Instead of logging in somewhere
# it makes the host: new UTS (own hostname), mount (own /dev/shm, so shared
# memory never crosses hosts) and PID namespaces, the command's parent a shell
# that is PID 1 there.  All of the host's processes live in that PID namespace,
# so SIGKILL to its PID 1 ends the whole host at once (what `simcluster.py
# kill-host` does).
# The cluster's network namespace and /etc/hosts are inherited.
set -eu
[ "${1:-}" = -x ] && shift  # hydra passes ssh's "no X11 forwarding"
host=${1:?usage: simcluster-agent.sh [-x] HOST COMMAND...}
shift
state=${SIMCLUSTER_STATE:?simcluster-agent.sh runs under launch/simcluster.py}
grep -q -x "$host" "$state/hostnames" || {
    echo "simcluster-agent.sh: $host is not a host of this simulated cluster ($(paste -sd' ' "$state/hostnames"))" >&2
    exit 255  # what ssh returns when it cannot reach a host
}
# Like ssh, hand the command line to a shell on the "remote" side as one string.
status=0
unshare --uts --mount --pid --fork --kill-child --mount-proc --propagation private \
    sh -c '
        hostname "$1"
        mount -t tmpfs -o mode=1777 "shm-$1" /dev/shm
        readlink /proc/self/ns/uts > "$2/$1.uts"
        # Not the last command, so that this shell stays PID 1 (dash would exec it).
        status=0; sh -c "$3" || status=$?
        exit "$status"
    ' simcluster-host "$host" "$state" "$*" || status=$?
# A host that kill-host took down does not tell the login node: an ssh to a
# crashed machine hangs, it does not exit.  So neither does this agent (until
# mpiexec ends it, or the cluster ends), and mpiexec has to notice by itself.
if [ -e "$state/$host.killed" ]; then
    exec sleep 3600
fi
exit "$status"

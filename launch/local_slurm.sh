#!/usr/bin/env bash
# A throwaway one-node SLURM cluster on localhost, for testing launch/slurm.sbatch
# for real (tests/test_slurm.py).  Needs root and Debian's slurm-wlm + munge
# (launch/install_slurm.sh installs them).
#
#   launch/local_slurm.sh start DIR [OWNER_PID]
#                                     configure and start munged, slurmctld, slurmd in DIR;
#                                     returns once the node accepts jobs (about 2 s).  With
#                                     OWNER_PID, they are also stopped when that process
#                                     ends (a test run that is killed leaves nothing behind)
#   launch/local_slurm.sh stop DIR    stop them (safe to call twice, or after a failed start)
#
# Then point the clients at it:  export SLURM_CONF=DIR/slurm.conf; sbatch ...
#
# Everything lives in DIR (config, state, spool, logs, munge socket and key) and
# the daemons listen on free ports on 127.0.0.1, so a real SLURM or munge on the
# machine is neither used nor disturbed.  DIR must be traversable by the munge
# user (e.g. created by mktemp -d and chmod 755), which is why it is not under a
# private pytest temp dir.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there, often not on a user's PATH

usage() { echo "usage: $0 start DIR [OWNER_PID] | stop DIR" >&2; exit 2; }
[ $# = 2 ] || [ $# = 3 ] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
owner=${3:-}

# Every process of this cluster: the daemons started here, and whatever is left of
# jobs (slurmstepd and the jobs' own processes, which outlive slurmd).  All of
# them carry this cluster's SLURM_CONF in their environment (exported before the
# daemons start; sbatch passes it on to jobs), so they are found by that and never
# by name: another SLURM or munge on the machine is not ours.
cluster_pids() {
    local name proc pid
    for name in slurmd slurmctld munged; do
        [ -f "$dir/$name.pid" ] && cat "$dir/$name.pid"
    done
    for proc in /proc/[0-9]*; do
        pid=${proc#/proc/}
        if [ "$pid" = "$self" ] || [ "$pid" = "$BASHPID" ]; then continue; fi
        { tr '\0' '\n' <"$proc/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$dir/slurm.conf" \
            && echo "$pid"
    done
    return 0
}

stop() {
    local pid pids alive
    self=$BASHPID  # the watchdog runs stop too: it must not find itself
    if [ -f "$dir/watchdog.pid" ]; then
        kill "$(cat "$dir/watchdog.pid")" 2>/dev/null || true
        rm -f "$dir/watchdog.pid"
    fi
    pids=$(cluster_pids | sort -u)
    [ -n "$pids" ] || return 0
    # All at once (each daemon takes a second or two to shut down); KILL what is
    # left after 10 s (slurmstepd ignores TERM once its slurmd is gone).
    # shellcheck disable=SC2086  # $pids is a list: word splitting intended
    kill $pids 2>/dev/null || true
    for _ in $(seq 100); do
        alive=0
        for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    rm -f "$dir"/{slurmd,slurmctld,munged}.pid
}

# The first port from $1 upwards that nothing on 127.0.0.1 listens on.
free_port() {
    local port=$1
    while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
    echo "$port"
}

# In the background: stop the cluster once $owner has gone.  It drops its own pid
# file first, so that stop does not kill it mid-way.
watch_owner() {
    (
        unset SLURM_CONF  # the commands stop runs from here are not the cluster's
        while kill -0 "$owner" 2>/dev/null; do sleep 1; done
        rm -f "$dir/watchdog.pid"
        stop
    ) </dev/null >/dev/null 2>&1 &
    echo $! > "$dir/watchdog.pid"
}

start() {
    for tool in munged mungekey slurmctld slurmd sinfo setpriv; do
        command -v "$tool" >/dev/null || { echo "local_slurm: $tool not found (run launch/install_slurm.sh)" >&2; exit 1; }
    done
    [ "$(id -u)" = 0 ] || { echo "local_slurm: must run as root (slurmd starts jobs as their user)" >&2; exit 1; }

    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 755 "$dir"

    # munge authenticates every SLURM message.  munged refuses to run as root and
    # checks that its key and socket directory belong to its user, so it gets its
    # own key and directory, owned by munge, and runs as munge.
    chown munge:munge "$dir/munge"
    chmod 711 "$dir/munge"  # munged wants o+x on its socket directory (clients connect)
    if [ ! -f "$dir/munge/munge.key" ]; then
        setpriv --reuid=munge --regid=munge --init-groups mungekey --create --keyfile="$dir/munge/munge.key"
    fi
    if ! setpriv --reuid=munge --regid=munge --init-groups munged \
            --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
            --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
            --seed-file="$dir/munge/munged.seed" </dev/null >"$dir/munged.out" 2>&1; then
        echo "local_slurm: munged did not start:" >&2; cat "$dir/munged.out" >&2; exit 1
    fi
    # munged forks into the background and writes its pid file; wait for it.
    for _ in $(seq 50); do [ -s "$dir/munge/munged.pid" ] && break; sleep 0.1; done
    cp "$dir/munge/munged.pid" "$dir/munged.pid"

    local host ctld_port slurmd_port first_job
    host=$(hostname -s)  # slurmctld only runs on the host named in SlurmctldHost
    # Job ids unique across runs, not 1, 2, ... every time: MPICH names its
    # shared-memory segment after the PMI job id ("1.0" -> /dev/shm/mpich_shm_<hash>_0),
    # and a rank that was killed leaves it behind.  The next cluster's job 1.0 would
    # then attach to that stale segment and fail in MPI_Init with garbled addresses.
    first_job=$(( ($(date +%s) % 600000) * 100 + $$ % 100 + 1000 ))
    ctld_port=$(free_port 16817)
    slurmd_port=$(free_port $((ctld_port + 1)))

    # The smallest configuration that runs jobs in a container:
    #  proctrack/linuxproc + task/none: no cgroups (not writable in most containers);
    #  select/cons_tres with CR_CPU: tasks get CPUs, as on a real cluster;
    #  no accounting database (slurmdbd), no job completion log;
    #  config_overrides: trust CPUs=2 even if slurmd counts another number of cores;
    #  SlurmUser=root: the daemons own DIR, no slurm user needed.
    cat > "$dir/slurm.conf" <<EOF
ClusterName=mpicoll-local
FirstJobId=$first_job
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd-%n
SlurmctldPidFile=$dir/slurmctld.daemon.pid
SlurmdPidFile=$dir/slurmd.daemon.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
NodeName=localnode NodeHostname=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=local Nodes=localnode Default=YES MaxTime=INFINITE State=UP
EOF

    export SLURM_CONF="$dir/slurm.conf"
    # -D: stay in the foreground, so the pid we record is the daemon's; -i: ignore
    # state from an earlier run.  Their output goes to files next to their logs
    # (and not to our caller's pipes, which would then never close).
    slurmctld -D -i -f "$SLURM_CONF" </dev/null >"$dir/slurmctld.out" 2>&1 &
    echo $! > "$dir/slurmctld.pid"
    slurmd -D -N localnode -f "$SLURM_CONF" </dev/null >"$dir/slurmd.out" 2>&1 &
    echo $! > "$dir/slurmd.pid"

    # Ready when the node is idle (registered with the controller, accepting jobs).
    local state=""
    for _ in $(seq 150); do
        state=$(sinfo -h -n localnode -o %t 2>/dev/null || true)
        if [ "$state" = idle ]; then
            [ -n "$owner" ] && watch_owner
            echo "local_slurm: up (SLURM_CONF=$SLURM_CONF)"
            return 0
        fi
        for name in slurmctld slurmd; do
            kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null || {
                echo "local_slurm: $name exited; its log:" >&2; tail -n 20 "$dir/$name.log" "$dir/$name.out" >&2 || true
                stop; exit 1; }
        done
        sleep 0.2
    done
    echo "local_slurm: node not idle after 30 s (state: '$state'); logs in $dir" >&2
    stop
    exit 1
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac

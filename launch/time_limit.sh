#!/usr/bin/env bash
# Run a job's launcher (mpiexec, srun) with a time limit that says where the ranks
# are before it ends the job:
#
#   launch/time_limit.sh LIMIT PYTHON COMMAND...
#
# LIMIT: seconds, or with ms, s, min or h (mpicoll's duration spellings,
# docs/settings.md).  PYTHON: a python with mpicoll (the job's venv's).  At the
# limit it runs `PYTHON -m mpicoll stacks --launcher` on the launcher's process
# (which asks the job's rank 0 on this host, else its lowest: a descendant, or a
# task of its SLURM job), and that rank prints every rank's collective or Python
# stack to the job's output; then it sends TERM, so the
# launcher can take its ranks down, and KILL 20 s later if it cannot.  Exit
# status: the command's, else 124 (137 where KILL was needed), as coreutils
# timeout's.  Used by launch/mpirun.sh and launch/slurm.sbatch
# (MPICOLL_LAUNCH_TIMEOUT).
set -uo pipefail

[ $# -ge 3 ] || { echo "usage: launch/time_limit.sh LIMIT PYTHON COMMAND..." >&2; exit 2; }
given=$1 python=$2
shift 2
# In sleep's spellings (which reads 10m as minutes and has no ms).
limit=$(echo "$given" | tr 'A-Z' 'a-z' | tr -d ' ')
case $limit in
    *ms) limit=$(awk -v v="${limit%ms}" 'BEGIN { print v / 1000 }') ;;
    *min) limit=${limit%min}m ;;
    *[0-9]|*s|*h) ;;
    *) echo "launch: MPICOLL_LAUNCH_TIMEOUT=$given: seconds, or with ms, s, min or h" >&2; exit 2 ;;
esac

ended_by=""  # the watcher's signals: 124 when the limit ended the job, 137 when KILL did
trap 'ended_by=${ended_by:-124}' USR1
trap 'ended_by=137' USR2
"$@" &
job=$!
trap 'kill -TERM "$job" 2>/dev/null || true' INT TERM  # Ctrl-C, scancel: to the launcher
# The watcher's own commands run in its background and it waits for them: when
# the job ends first and they are ended below, bash then reports nothing (a
# foreground child ended by a signal makes it print "Terminated", which read as
# if the job had been killed).
(
    sleep "$limit" & wait $!
    kill -0 "$job" 2>/dev/null || exit 0
    kill -USR1 $$
    echo "launch: MPICOLL_LAUNCH_TIMEOUT=$given s reached; where the ranks are:" >&2
    timeout -s KILL 30 "$python" -m mpicoll stacks --launcher "$job" > /dev/null & wait $!
    kill -TERM "$job" 2>/dev/null || exit 0
    sleep 20 & wait $!
    if kill -0 "$job" 2>/dev/null; then kill -USR2 $$; kill -KILL "$job" 2>/dev/null; fi
) &
watcher=$!
status=0
wait "$job" || status=$?
while kill -0 "$job" 2>/dev/null; do  # wait returned for a signal: the trap's, or the watcher's
    status=0
    wait "$job" || status=$?
done
pkill -P "$watcher" 2>/dev/null
kill "$watcher" 2>/dev/null
if [ -n "$ended_by" ]; then
    status=$ended_by
    echo "launch: exit $status: ended by MPICOLL_LAUNCH_TIMEOUT=$given s" \
         "(a deadlock? ranks waiting in different collectives?): $*" >&2
fi
exit "$status"

#!/bin/sh
# End every process a test run left behind: tools/end-test-run.sh RUN_ID
#
# `make test` gives each pytest run MPICOLL_TEST_RUN=RUN_ID in its environment;
# the jobs the tests start inherit it, also those started in sessions of their
# own (tests/conftest.py run_mpiexec: start_new_session, so that a job can be
# ended as a group) and the busy processes of the tests under load.  When a run
# ends, normally or killed at TEST_TIMEOUT, whatever still carries the marker is
# ended here (TERM, then KILL): a job left spinning (MPICH busy-polls) would
# otherwise slow every run after it.  Processes are found by the marker alone,
# never by name: another user's or another run's are not ours.
run=$1
[ -n "$run" ] || { echo "usage: $0 RUN_ID" >&2; exit 2; }
marked() {
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}; pid=${pid%/environ}
        [ "$pid" = $$ ] && continue
        { tr '\0' '\n' <"$environ"; } 2>/dev/null | grep -qx "MPICOLL_TEST_RUN=$run" && echo "$pid"
    done
}
left=$(marked)
[ -n "$left" ] || exit 0
echo "=== the test run left $(echo $left | wc -w) process(es) behind; ending them:" >&2
ps -o pid=,etime=,args= -p "$(echo $left | tr ' ' ',')" 2>/dev/null | cut -c1-160 >&2
kill -TERM $left 2>/dev/null
sleep 2
left=$(marked)
[ -z "$left" ] || kill -KILL $left 2>/dev/null
exit 0

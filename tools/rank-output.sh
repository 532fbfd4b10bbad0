#!/bin/sh
# Run a command as one rank of an mpiexec job, keeping the ranks' output apart:
# rank 0 writes to the terminal, rank N to $RANK_LOG_DIR/rank-N.log (`make test`
# shows those afterwards).  Without RANK_LOG_DIR every rank writes to the terminal.
# The rank comes from the launcher: PMI_RANK (MPICH's hydra), OMPI_COMM_WORLD_RANK
# (Open MPI), PMIX_RANK (other PMIx launchers).
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}
if [ "$rank" = 0 ] || [ -z "${RANK_LOG_DIR:-}" ]; then
    exec "$@"
fi
exec "$@" > "$RANK_LOG_DIR/rank-$rank.log" 2>&1

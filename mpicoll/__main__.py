"""Command line: `python -m mpicoll COMMAND`.

    mpiexec -n 2 python -m mpicoll info     what every rank sees, printed by rank 0

`info` answers "is this job wired up right?": which MPI library and thread level
(the one mpicoll was compiled against, the one mpi4py loaded, CUDA-awareness),
how many ranks on which hosts (from MPI itself, cross-checked against the
launcher's variables), what JAX each rank runs on, every setting in force and
where it came from (a setting that differs between ranks is a problem), and
whether one mpicoll collective gives the right answer.  It exits non-zero if something is wrong, so
it doubles as a smoke test of an installation or a batch allocation.

`python -m mpicoll script.py [args]` (or `-m module [args]`) runs a script so
that an uncaught exception on any rank prints its traceback and aborts the
whole job, whatever MPICOLL_ABORT_ON_ERROR says (as mpi4py's `-m mpi4py` does).

Commands are looked up in COMMANDS by their first argument.
"""

import sys

USAGE = """usage: python -m mpicoll COMMAND       (or the installed command: mpicoll COMMAND)
       python -m mpicoll script.py [args]     run a script; an uncaught exception aborts the job
       python -m mpicoll -m module [args]

commands:
  info    the MPI library, thread level, ranks per host, the settings in force, and each
          rank's JAX backend and devices (run it under mpiexec / srun like any MPI program)
  flight DIR
          read every rank's flight recorder dump in DIR (MPICOLL_FLIGHT_DIR, written on a
          stall, a timeout, an abort or SIGUSR1) and say where the ranks diverge: which
          rank is behind or ahead on which communicator, or wrote no dump; exits 1 unless
          every rank has a dump and they agree
  trace DIR [--all]
          merge every rank's timeline in DIR (MPICOLL_TRACE=DIR, mpicoll.trace(DIR)) onto
          one clock: writes DIR/merged.json (wait and transfer spans, for ui.perfetto.dev)
          and DIR/timeline.svg, and prints each rank's wait and transfer and names the
          straggler, each call site's first call (compilation) left out (--all: counted)
  stacks [PID | --launcher PID]
          where every rank of a live job is: its collective, or its Python stack (main
          thread, and threads inside JAX); asks one rank on this host (PID, else the job's
          rank 0 here; --launcher PID: a rank that launcher, mpiexec or srun, started
          here) with SIGUSR2, which asks the others (run it outside mpiexec)"""

def info(argv):
    """`info`: gather every rank's report on rank 0 and print it; exit 1 on a problem."""
    if argv:
        print(USAGE, file=sys.stderr)
        return 2
    from mpi4py import MPI

    from . import _info_report

    world = MPI.COMM_WORLD
    reports = world.gather(_info_report.rank_report(), root=0)
    ok = True
    if world.Get_rank() == 0:
        text, ok = _info_report.format_report(reports)
        print(text, flush=True)
    ok = world.bcast(ok, root=0)  # every rank exits with the same status
    return 0 if ok else 1


def _one_directory(argv, command):
    if len(argv) != 1:
        print(f"python -m mpicoll {command}: give one directory\n{USAGE}", file=sys.stderr)
        return None
    return argv[0]


def flight(argv):
    """`flight DIR`: where the ranks' flight records diverge (exit 1 unless they agree)."""
    from ._src.observe import records

    directory = _one_directory(argv, "flight")
    if directory is None:
        return 2
    try:
        text, diverged = records.flight_report(records.load(directory))
    except ValueError as error:
        print(f"python -m mpicoll flight: {error}", file=sys.stderr)
        return 2
    print(text)
    return 1 if diverged else 0


def trace(argv):
    """`trace DIR`: merge the ranks' timelines; the picture and the straggler."""
    from ._src.observe import timeline

    every = "--all" in argv
    directory = _one_directory([a for a in argv if a != "--all"], "trace")
    if directory is None:
        return 2
    try:
        print(timeline.write_merged(directory, warm_up=not every))
    except ValueError as error:
        print(f"python -m mpicoll trace: {error}", file=sys.stderr)
        return 2
    return 0


def stacks(argv):
    """`stacks [PID | --launcher PID]`: where every rank of a live job is, asked through
    one rank on this host."""
    from ._src.observe.stacks import ask, choose_process, mpicoll_processes, ranks_of_launcher

    launcher = argv[:1] == ["--launcher"]
    given = argv[1:] if launcher else argv
    if len(given) > 1 or (given and not given[0].isdigit()) or (launcher and not given):
        print(f"python -m mpicoll stacks: give at most one process id (--launcher: one)\n{USAGE}",
              file=sys.stderr)
        return 2
    try:
        if launcher:  # the job that launcher started: its rank 0 here, else its lowest
            ranks = ranks_of_launcher(int(given[0]))
            if not ranks:
                raise LookupError(f"process {given[0]} launched no mpicoll rank on this host")
            pid = choose_process(ranks)
        else:
            pid = int(given[0]) if given else choose_process(mpicoll_processes())
        print(ask(pid), end="")
    except (LookupError, TimeoutError, OSError) as error:  # OSError: own_files.Refused too
        print(f"python -m mpicoll stacks: {error}", file=sys.stderr)
        return 1
    return 0


COMMANDS = {"info": info, "flight": flight, "trace": trace, "stacks": stacks}


def run(argv):
    """Run a script or module (`-m name`) as __main__ with abort-on-error installed."""
    import runpy

    from ._src.observe import failures

    failures.install_abort_on_error()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(f"python -m mpicoll: -m needs a module name\n{USAGE}", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _once_per_job(text, file=None):
    """Print a message every rank would print alike (usage, a wrong command) on rank 0
    only: under mpiexec the job shows it once.  (Importing mpicoll has set MPI up.)"""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(text, file=file or sys.stdout, flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        _once_per_job(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None and (argv[0] == "-m" or argv[0].endswith(".py")):
        return run(argv)
    if command is None:
        _once_per_job(f"python -m mpicoll: unknown command {argv[0]!r}\n{USAGE}", sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

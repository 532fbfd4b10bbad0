"""Never hang, never fail silently: abort on error, check mode, timeout.

* Abort on error: an uncaught exception on any rank prints the rank and the
  traceback and aborts the whole job (MPI_Abort), instead of leaving the other
  ranks waiting in a collective until the wall-clock limit.  On by default when
  the job has more than one rank; MPICOLL_ABORT_ON_ERROR=0 turns it off.
* Checks across ranks: before a collective runs, the ranks compare a
  fingerprint of (op, dtype, shape, root, reduction, communicator); a mismatch
  raises jax.errors.JaxRuntimeError on every rank, listing what each rank
  called.  By default ("first-run") each call site of a compiled program is
  checked the first time it runs, then never again; MPICOLL_CHECK=1 ("every
  call") checks every call; MPICOLL_CHECK=0 ("off") none.
* Stall report (MPICOLL_STALL_REPORT=seconds, default 60; csrc/watch/watchdog.h):
  a collective waiting longer gets one report for the job: its call site and
  sequence number, the ranks that have arrived, and what every other rank is
  doing (asked over a private communicator, so stuck ranks still answer);
  repeated with back-off while the stall lasts.
* Timeout (MPICOLL_TIMEOUT=seconds, default 600, or set_timeout(seconds)): a
  collective not completed in time writes that report as the reason and
  aborts the job.
* Flight recorder (MPICOLL_FLIGHT_RECORDS, default 1000 per local device) and
  timeline (MPICOLL_TRACE=dir, or mpicoll.trace(dir) in code: observe/tracing.py),
  csrc/watch/flight.h: every rank's recent (or every) collective, written on a
  stall, a timeout, an abort, SIGUSR1 or (the timeline) when it stops; read by
  `python -m mpicoll flight|trace DIR` (observe/records.py).
"""

import atexit
import os
import sys
import tempfile
import threading
import traceback

from mpi4py import MPI

from .. import PACKAGE_DIR
from .. import _compat
from . import summary, tracing
from ..runtime import native, own_files, settings
from ..runtime.native import extension


CHECK_MODES = settings.CHECK_MODES  # the handler's codes 0, 1, 2
_check_mode = "first-run"


def set_check_mode(mode=True):
    """Choose which calls compare their fingerprint across ranks; returns the previous mode.

    Before a compared call runs, the ranks of its communicator compare (op, dtype,
    shape, root, reduction, its sequence number on the communicator) in one small
    allgather on a private duplicate; on a mismatch every rank raises
    jax.errors.JaxRuntimeError listing what each rank called (ValueError where JAX
    ran a jitted program from its cache: jax-ml/jax#34083), and the mismatched
    collective does not run (docs/failures.md).

    Args:
        mode: "first-run" (the default; MPICOLL_CHECK sets the initial mode):
            a call whose description is new on its communicator, then never
            again.  "every-call" (or True): every call, its jitted call site
            too (a small allreduce carries its data in the check: about 1.2x
            a 4-byte allreduce's time).  "off" (or False): never.
    Returns:
        The previous mode, "off", "first-run" or "every-call".
    Raises:
        ValueError: for another mode.
    Note:
        Read at run time, so switching needs no recompilation.  Set it the same
        on every rank.

    Example::

        previous = mpicoll.set_check_mode("every-call")   # while chasing a hang
        ...
        mpicoll.set_check_mode(previous)
    """
    global _check_mode
    if mode is True or mode is False:
        mode = "every-call" if mode else "off"
    if mode not in CHECK_MODES:
        raise ValueError(f"mpicoll.set_check_mode: mode must be one of {CHECK_MODES} or a "
                         f"bool, got {mode!r}")
    extension.set_check_mode(CHECK_MODES.index(mode))
    previous, _check_mode = _check_mode, mode
    return previous


def check_mode():
    """The current check mode (see set_check_mode).

    Returns:
        "off", "first-run" (the default) or "every-call".

    Example::

        if mpicoll.check_mode() == "off":
            print("mismatched calls are not caught")
    """
    return _check_mode


def clear_error():
    """After catching an error a collective raised, let the next collectives run.

    A collective that failed (a mismatch, a freed communicator, an MPI error)
    raises on every rank; on a GPU it raises when its result is read, and JAX's
    ordering token then carries that error into every later collective.  Call
    this once the error is handled, on every rank, to start from a fresh token.

    Returns:
        None.

    Example::

        try:
            y = step(x).block_until_ready()
        except jax.errors.JaxRuntimeError as error:
            print(error)
            mpicoll.clear_error()        # on every rank, then carry on
    """
    _compat.reset_effect_tokens()


def set_timeout(seconds):
    """End the job when a collective waits longer than seconds.

    The watchdog ends the job (MPI_Abort, exit status 3) with the stall report
    as its reason, naming the collective, the rank and the communicator; it also
    watches point-to-point calls and a communicator's first use
    (docs/failures.md).

    Args:
        seconds: the limit, a number >= 0; None or 0: wait forever.  The default
            is 600 (MPICOLL_TIMEOUT).  Choose it above the longest legitimate
            wait (load imbalance between collectives counts).
    Returns:
        None.
    Raises:
        ValueError: for a negative number.

    Example::

        mpicoll.set_timeout(120)         # a job stuck for 2 minutes ends
    """
    seconds = float(seconds or 0)
    if seconds < 0:
        raise ValueError(f"mpicoll.set_timeout: seconds must be >= 0, got {seconds}")
    extension.set_timeout(seconds)


def set_stall_report(seconds):
    """Report a collective waiting longer than seconds, once for the whole job.

    The watchdog of the lowest stalled rank writes one report: the collective,
    its call site and sequence number, the ranks that have arrived, and what
    every other rank is doing (or that it does not answer); repeated after 2x,
    4x, ... the threshold while the stall lasts (docs/failures.md).

    Args:
        seconds: the threshold, a number >= 0; None or 0: no reports.  The
            default is 60 (MPICOLL_STALL_REPORT).
    Returns:
        None.
    Raises:
        ValueError: for a negative number.

    Example::

        mpicoll.set_stall_report(5)         # report sooner while debugging
    """
    seconds = float(seconds or 0)
    if seconds < 0:
        raise ValueError(f"mpicoll.set_stall_report: seconds must be >= 0, got {seconds}")
    extension.set_stall_report(seconds)


def abort_on_error(exc_type, exc, tb, *, thread=None):
    """Print the rank and traceback of an uncaught exception, then abort every rank.

    The other ranks' watchdogs say in one line which rank ends the job; where
    several ranks raise (the same error everywhere, typically), one prints the
    traceback (the lowest of those that raised together) and the others one line each.
    """
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    where = f" in thread {thread.name}" if thread is not None else ""
    printing = extension.announce_abort(_ABORT_SETTLE_MS)
    if printing != rank:
        first_line = (str(exc).splitlines() or [""])[0]
        sys.stderr.write(f"mpicoll: uncaught {exc_type.__name__} on rank {rank} too{where}: "
                         f"{first_line} (rank {printing} prints its traceback; aborting the job)\n")
    else:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"mpicoll: uncaught exception on rank {rank} of "
                         f"{world.Get_size()}{where}; aborting the job\n{text}")
        if settings.current().flight_records:
            sys.stderr.flush()
            extension.gather_records(_GATHER_RECORDS_SECONDS)  # every rank's, beside this one's
            folder = extension.flight_dir()
            sys.stderr.write(f"mpicoll: the ranks' last collectives: {folder}/"
                             f"rank*.json (python -m mpicoll flight {folder})\n")
    sys.stderr.flush()
    extension.abort_job(1)  # MPI_Abort, once the launcher has had time to forward the report


# How long a rank about to abort waits for ranks that raised at the same moment.
_ABORT_SETTLE_MS = 100
# How long the rank that prints the traceback waits for the others' flight records.
_GATHER_RECORDS_SECONDS = 2.0


_abort_installed = False


def abort_on_error_installed():
    """Whether uncaught exceptions abort the job in this process."""
    return _abort_installed


def install_abort_on_error():
    """Route uncaught exceptions (main thread and other threads) to abort_on_error."""
    global _abort_installed
    _abort_installed = True
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            return previous_hook(exc_type, exc, tb)
        abort_on_error(exc_type, exc, tb)

    def thread_excepthook(args):
        if args.exc_type is SystemExit:
            return
        abort_on_error(args.exc_type, args.exc_value, args.exc_traceback, thread=args.thread)

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook


# Old jobs' flight records in this user's private folder of the temporary
# directory (MPICOLL_FLIGHT_DIR unset): kept for a week, and at most the newest
# 20 (docs/failures.md says the rule); stacks reports nobody read, after a day.
FLIGHT_FOLDERS_KEPT, FLIGHT_FOLDER_DAYS = 20, 7
STACKS_REPORT_DAYS = 1


def prune_flight_folders(root, now=None):
    """Remove from `root`, this user's private folder (<tmp>/mpicoll-<uid>), its
    flight-<host>-<pid> folders older than FLIGHT_FOLDER_DAYS and beyond the
    FLIGHT_FOLDERS_KEPT newest, except those of a process still running on this host,
    and its stacks reports older than STACKS_REPORT_DAYS; returns the paths removed.
    Only this user's own entries, never through a link, and nothing where `root` itself
    fails the private rule (runtime/own_files.py).  Every rank may run it at once: an
    entry another rank removed first is skipped."""
    import shutil
    import socket
    import stat
    import time

    now = time.time() if now is None else now
    try:
        folder = own_files.open_folder(root, root, create=False)
    except own_files.Refused:
        return []
    host, me = socket.gethostname(), os.geteuid()
    try:
        found = []
        for entry in os.scandir(folder):
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid != me or stat.S_ISLNK(info.st_mode):
                continue
            if entry.name.startswith("flight-") and stat.S_ISDIR(info.st_mode):
                found.append((info.st_mtime, entry.name))
            elif (entry.name.startswith("stacks-") and stat.S_ISREG(info.st_mode)
                  and now - info.st_mtime > STACKS_REPORT_DAYS * 86400):
                found.append((-1, entry.name))  # removed below, whatever the count
        found.sort(reverse=True)
        removed = []
        kept = 0
        for mtime, name in found:
            if mtime >= 0:
                if kept < FLIGHT_FOLDERS_KEPT and now - mtime < FLIGHT_FOLDER_DAYS * 86400:
                    kept += 1
                    continue
                owner, _, pid = name[len("flight-"):].rpartition("-")
                if owner == host and pid.isdigit() and _running(int(pid)):
                    continue
                shutil.rmtree(name, ignore_errors=True, dir_fd=folder)
            else:
                try:
                    os.unlink(name, dir_fd=folder)
                except OSError:
                    continue
            removed.append(os.path.join(root, name))
    finally:
        os.close(folder)
    return removed


def check_private_root(temporary_directory):
    """Warn (once, this rank) where this user's folder in the temporary directory is not
    safe to write in; returns the reason, or None."""
    import warnings

    root = own_files.private_root(temporary_directory)
    if not os.path.lexists(root):
        return None  # made when a file is first due
    problem = own_files.folder_problem(root, root)
    if problem:
        warnings.warn_explicit(
            f"mpicoll: {problem}: the stacks report and this job's flight records are not "
            "written there (only a folder of your own is trusted in the shared temporary "
            "directory; set TMPDIR, or MPICOLL_FLIGHT_DIR, to a folder of yours)",
            own_files.UnsafeFolderWarning, "<temporary directory>", 0)
    return problem


def _running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: alive
    return True


def configure(current):
    """Apply the settings read at import (runtime/settings.py): abort on error, check mode, timeout,
    stall report."""
    # For reports' Python stacks (watch/python_stacks.h): mpicoll's own frames are left out.
    extension.watch_python_threads(threading.main_thread().ident, PACKAGE_DIR)
    world_size = MPI.COMM_WORLD.Get_size()
    abort = current.abort_on_error if current.abort_on_error is not None else world_size > 1
    if abort:
        install_abort_on_error()
    set_check_mode(current.check)
    set_timeout(current.timeout)
    set_stall_report(current.stall_report)
    temporary_directory = tempfile.gettempdir()
    extension.set_flight(current.flight_records, current.flight_dir, temporary_directory)
    if check_private_root(temporary_directory) is None:
        prune_flight_folders(own_files.private_root(temporary_directory))
    tracing.start_at_import(current)
    # Registered after mpi4py's MPI_Finalize handler, so they run before it
    # (atexit runs the last registered first: the end notice, the timeline,
    # then the watchdog's stop).
    atexit.register(extension.stop_watchdog)
    atexit.register(tracing.stop_at_exit)
    summarizing = ""
    if current.summary:  # after the end notice: a rank another waits for is still named
        summarizing = "; " + summary.install()
        atexit.register(summary.summarize_at_exit)
    if world_size > 1 and not native.SERIALIZED:
        global _announcing
        extension.open_side_channel()
        _announcing = True
        atexit.register(announce_finished)
        _watch_process_exit()
    return (f"abort on error {'on' if abort else 'off'}; "
            + ("end notices to the other ranks (atexit, os._exit)" if _announcing
               else "no end notices (one rank, or serialized)") + summarizing)


# --- Ranks that end: the others' watchdogs hold their waits against it --------------------
#
# A rank whose script finishes (or that exits) while another waits for it in a
# collective would leave that rank waiting until MPICOLL_TIMEOUT.  So it tells
# every rank its last calls and where it ended; a rank waiting for it ends the
# job at once with a report naming both (csrc/watch/watchdog.h).

def _script_frame():
    """The __main__ module's frame (the user's script), or None (an interactive session)."""
    main = sys.modules.get("__main__")
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and main is not None \
                and frame.f_globals is getattr(main, "__dict__", None):
            return frame
        frame = frame.f_back
    return None


# Held from import on: once the script has run, its frame's line is the last
# one it ran (where it finished, or where an uncaught SystemExit left it).
_SCRIPT_FRAME = _script_frame()
_PROCESS = os.getpid()


def _ended_at():
    frame = _SCRIPT_FRAME
    where = "" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
    # Python's own hook keeps an uncaught exception there (without abort on error).
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if error is not None and not isinstance(error, SystemExit):
        where += f" (an uncaught {type(error).__name__})"
    return where


_announcing = False  # the side channel is open: tell the others where this rank ended


def announce_finished():
    """Tell every rank that this one's script has finished, and its last calls (once;
    at exit, or earlier from an exit handler that may wait for the other ranks)."""
    global _announcing
    if not _announcing:
        return
    _announcing = False
    import jax

    jax.effects_barrier()  # its queued collectives are its calls too
    extension.announce_end(1, 0, _ended_at())


def _watch_process_exit():
    """os._exit skips atexit: wrap it so that the process tells the others first
    (a forked child, which must not touch MPI, calls the original)."""
    original = os._exit
    if getattr(original, "_mpicoll_original", None) is not None:
        return

    def _exit(code):
        if os.getpid() == _PROCESS:
            try:
                caller = sys._getframe(1)
                where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                extension.announce_end(2, int(code), f"{where} (os._exit)")
            except Exception:  # the process is exiting: nothing may stop it
                pass
        original(code)

    _exit._mpicoll_original = original
    _exit.__doc__ = original.__doc__
    os._exit = _exit

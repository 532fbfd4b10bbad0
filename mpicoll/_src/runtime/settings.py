"""Every MPICOLL_* environment variable, read once at import into one `Settings` object.

The other modules never read the environment: they read `current()`.  A setting
that can change while a program runs (the check mode, the timeout, autodiff,
dispatch, the timeline) has its own setter in the public API, which starts from
the value read here; the allreduce thresholds change only within `override(...)`,
for measurements and tests.  `sources()` says where each value came from.

Every value is validated at import, on every rank alike: one spelling rule for
each kind (on/off, durations, byte sizes, counts; see _flag and _quantity), and
a value outside it stops the import with the variable and its valid values.  An
MPICOLL_* variable nothing reads warns once, with the closest known name.

  variable                     values (default first)               what it sets
  MPICOLL_ABORT_ON_ERROR       on with more than one rank, else off  failures.py
  MPICOLL_CHECK                first-run | every-call (all, on) | off
  MPICOLL_TIMEOUT              600 s (10, 10s, 10min, ...); 0 = never  failures.py
  MPICOLL_STALL_REPORT         60 s; 0 = off                         failures.py
  MPICOLL_FLIGHT_RECORDS       1000 per local device; 0 = off        failures.py
  MPICOLL_FLIGHT_DIR           a folder per job in <tmp>/mpicoll-<uid> | a directory
  MPICOLL_TRACE                a directory: record the timeline there; unset = off
  MPICOLL_TRACE_SKIP           0 | N: the timeline leaves out each call site's first N calls
  MPICOLL_AUTODIFF             checked | convention
  MPICOLL_DISPATCH             default | device-order | tokens
  MPICOLL_GPU_TRANSPORT        auto | staged | cuda-aware
  MPICOLL_GPU_CHUNK_BYTES      4 MiB (0 = no pipelining)
  MPICOLL_LOCAL_COMBINE_BYTES  1 MiB: ranks x devices allreduce, combine in the handler
  MPICOLL_SPLIT_ALLREDUCE_BYTES 256 KiB: ranks x devices allreduce, split the MPI work
  MPICOLL_GATHER_PIECES        0 (automatic) | N: the local meeting's allgather in N pieces
  MPICOLL_AS_MPI4JAX           off | on: `import mpi4jax` gives mpicoll.mpi4jax (read at start-up
                               by _mpicoll_as_mpi4jax.py, beside the package; here for info)
  MPICOLL_JAX_COLLECTIVES      auto | gloo: after mpicoll.distributed.initialize() JAX's own CPU
                               collectives run on mpicoll's MPI (auto, any devices per process)
                               or on JAX's gloo (read at start-up by _mpicoll_jax_mpi.py too)
  MPICOLL_FT                   off | on: the job was launched fault-tolerant (launch/mpirun.sh
                               adds ULFM's flags): a lost rank raises mpicoll.RankLost
(the two thresholds are per device at 2 local devices; they scale as 1 / (L - 1)).
"""

import contextlib
import dataclasses
import difflib
import os
import re
import sys
import warnings

from .. import PACKAGE_DIR

DEFAULT_GPU_CHUNK_BYTES = 4 << 20
# A job stuck in a collective ends after 10 minutes (PyTorch's default too),
# with the stall report, first written after a minute, as the reason.
DEFAULT_TIMEOUT = 600.0
DEFAULT_STALL_REPORT = 60.0
# Each local device's last 1,000 collectives (about 150 B each) are kept for
# the flight dumps (csrc/watch/flight.h).
DEFAULT_FLIGHT_RECORDS = 1000
# The measurements behind these two are in ops/ranks_devices.py.
DEFAULT_LOCAL_COMBINE_BYTES = 1024 * 1024
DEFAULT_SPLIT_ALLREDUCE_BYTES = 256 * 1024

CHECK_MODES = ("off", "first-run", "every-call")
AUTODIFF_MODES = ("checked", "convention")
DISPATCH_CHOICES = ("default", "device-order", "tokens")
GPU_TRANSPORTS = ("auto", "staged", "cuda-aware")
JAX_COLLECTIVES = ("auto", "gloo")


@dataclasses.dataclass(frozen=True)
class Settings:
    """mpicoll's settings as read from the environment (None: decided later, see field)."""
    abort_on_error: bool = None  # None: on when the job has more than one rank
    check: str = "first-run"
    timeout: float = DEFAULT_TIMEOUT
    stall_report: float = DEFAULT_STALL_REPORT
    flight_records: int = DEFAULT_FLIGHT_RECORDS
    # "": a folder of the job's own in this user's private folder of the
    # temporary directory (<tmp>/mpicoll-<uid>, runtime/own_files.py), which the
    # extension names once the ranks have met (one name for every rank; not in
    # the user's working directory); else the directory (absolute) the dumps go to.
    flight_dir: str = ""
    trace: str = ""  # "": no timeline; else the directory (absolute) it is written to
    trace_skip: int = 0  # the timeline leaves out each call site's first N calls (warm-up)
    autodiff: str = "checked"
    dispatch: str = "default"  # "default": device-order where JAX allows it, else tokens
    gpu_transport: str = "auto"
    gpu_chunk_bytes: int = DEFAULT_GPU_CHUNK_BYTES
    local_combine_bytes: float = DEFAULT_LOCAL_COMBINE_BYTES
    split_allreduce_bytes: float = DEFAULT_SPLIT_ALLREDUCE_BYTES
    # The pieces a global-mesh all_gather over processes and devices is gathered
    # in (csrc/meeting/meeting.cc): 0 lets the extension choose (pieces where this
    # process has two cores per local device), 1 gathers whole.
    gather_pieces: int = 0
    # Acted on before mpicoll is imported, by the .pth file the install puts in
    # site-packages (_mpicoll_as_mpi4jax.py); read here so that info shows it.
    as_mpi4jax: bool = False
    # JAX's own CPU collectives (the ones XLA's partitioner inserts): "auto" runs
    # them on mpicoll's MPI after mpicoll.distributed.initialize() where they can
    # (over_ranks/jax_transport.py), "gloo" leaves them on JAX's gloo.  Acted on at
    # start-up too, by _mpicoll_jax_mpi.py (MPITRAMPOLINE_LIB).
    jax_collectives: str = "auto"
    # Set by launch/mpirun.sh (MPICOLL_FT=1) for a fault-tolerant launch; read by
    # survive.py (a job that survives a lost rank, docs/surviving.md).
    ft: bool = False
    # At the job's end rank 0 prints how much of the run went to communication,
    # per rank and per kind of collective (observe/summary.py).
    summary: bool = False


# The spellings every setting shares (docs/settings.md): case is ignored, and
#   on/off:    1, true, yes, on  /  0, false, no, off
#   durations: seconds (10, 2.5), or with a unit: 500ms, 10s, 10min, 2h
#   byte sizes: bytes (4194304), or with a unit: 4096KiB, 4MiB, 1GiB
#   counts:    a whole number (0, 1000)
# Anything else stops the import with one message naming the variable and its
# valid values: a misread setting is worse than none.
ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")
_SECONDS = {"": 1.0, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_BYTES = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_QUANTITY = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


def _flag(name, raw):
    value = raw.lower()
    if value in ON or value in OFF:
        return value in ON
    raise ValueError(f"{name}={raw!r} must be on ({', '.join(ON)}) or off ({', '.join(OFF)})")


def _choice(choices, aliases=None):
    """One of `choices`; aliases: {choice: (other spellings, ...)}."""
    spellings = {choice: choice for choice in choices}
    for choice, others in (aliases or {}).items():
        spellings.update({other: choice for other in others})
    listed = []
    for choice in choices:
        others = [other for other in (aliases or {}).get(choice, ()) if other != choice]
        listed.append(choice + (f" ({', '.join(others)})" if others else ""))
    listed = ", ".join(listed)

    def parse(name, raw):
        value = raw.lower()
        if value not in spellings:
            raise ValueError(f"{name}={raw!r} must be one of: {listed}")
        return spellings[value]
    return parse


_check = _choice(CHECK_MODES, {"off": OFF, "first-run": ("first",),
                               "every-call": ("all",) + ON})


def _quantity(units, what, whole):
    def parse(name, raw):
        match = _QUANTITY.fullmatch(raw.lower())
        if match is None or match[2] not in units or (whole and "." in match[1]):
            raise ValueError(f"{name}={raw!r} must be {what}")
        value = float(match[1]) * units[match[2]]
        return round(value) if whole else value
    return parse


_seconds = _quantity(_SECONDS, "a duration >= 0: seconds (10, 2.5) or with a unit "
                               "(500ms, 10s, 10min, 2h)", whole=False)
_bytes = _quantity(_BYTES, "a size >= 0: bytes (4194304) or with a unit "
                           "(4096KiB, 4MiB, 1GiB)", whole=True)
_count = _quantity({"": 1}, "a whole number >= 0", whole=True)


def writable_directory(name, raw, create):
    """raw as an absolute path of a directory mpicoll can write files to; checked
    before any file is due, so that a bad one fails early (on every rank alike).
    create: make it now (the timeline); else only its parent must be writable
    (the flight recorder makes it when it first dumps).  A folder made is 0700; one
    that exists (or a link at its name) must be this user's or root's
    (runtime/own_files.py).  ValueError naming `name`."""
    from . import own_files

    path = os.path.abspath(os.path.expanduser(raw))
    try:
        if create and not os.path.lexists(path):
            os.makedirs(path, mode=0o700, exist_ok=True)
        if create or os.path.lexists(path):
            problem = own_files.folder_problem(path)
            if problem:
                raise OSError(problem)
            target = path
        else:
            target = os.path.dirname(path)
            if not os.path.isdir(target):
                raise OSError(f"{target} is not a directory")
        if not os.access(target, os.W_OK | os.X_OK):
            raise OSError(f"{target} is not writable")
    except OSError as error:
        raise ValueError(f"{name}={raw!r}: mpicoll cannot write there ({error})") from None
    return path


def _writable_directory(create):
    return lambda name, raw: writable_directory(name, raw, create)


# field -> (variable, parser of its stripped, non-empty value)
_VARIABLES = {
    "abort_on_error": ("MPICOLL_ABORT_ON_ERROR", _flag),
    "check": ("MPICOLL_CHECK", _check),
    "timeout": ("MPICOLL_TIMEOUT", _seconds),
    "stall_report": ("MPICOLL_STALL_REPORT", _seconds),
    "flight_records": ("MPICOLL_FLIGHT_RECORDS", _count),
    "flight_dir": ("MPICOLL_FLIGHT_DIR", _writable_directory(create=False)),
    "trace": ("MPICOLL_TRACE", _writable_directory(create=True)),
    "trace_skip": ("MPICOLL_TRACE_SKIP", _count),
    "autodiff": ("MPICOLL_AUTODIFF", _choice(AUTODIFF_MODES)),
    "dispatch": ("MPICOLL_DISPATCH", _choice(DISPATCH_CHOICES)),
    "gpu_transport": ("MPICOLL_GPU_TRANSPORT", _choice(GPU_TRANSPORTS)),
    "gpu_chunk_bytes": ("MPICOLL_GPU_CHUNK_BYTES", _bytes),
    "local_combine_bytes": ("MPICOLL_LOCAL_COMBINE_BYTES", _bytes),
    "split_allreduce_bytes": ("MPICOLL_SPLIT_ALLREDUCE_BYTES", _bytes),
    "gather_pieces": ("MPICOLL_GATHER_PIECES", _count),
    "as_mpi4jax": ("MPICOLL_AS_MPI4JAX", _flag),
    "jax_collectives": ("MPICOLL_JAX_COLLECTIVES", _choice(JAX_COLLECTIVES)),
    "ft": ("MPICOLL_FT", _flag),
    "summary": ("MPICOLL_SUMMARY", _flag),
}


# MPICOLL_* variables read by others than this module (the build, the launch
# scripts, the tests, an example): known, so that setting one never warns.
OTHER_VARIABLES = {
    "MPICOLL_CUDA": "setup.py: build the CUDA handlers (1) or leave them out (0)",
    "MPICOLL_MPIEXEC": "launch/, tests/, make: the mpiexec to start ranks with",
    "MPICOLL_VENV": "launch/: the virtual environment the ranks run in",
    "MPICOLL_TEST_FT_VENV": "tests/test_survive.py: an Open MPI venv to survive lost ranks in",
    "MPICOLL_TEST_RUN": "make test: marks a test run's processes (tools/end-test-run.sh)",
    "MPICOLL_LAUNCH_TIMEOUT": "launch/mpirun.sh: end the job after so many seconds",
    "MPICOLL_LAUNCH_VERBOSE": "launch/mpirun.sh: print the command line it runs",
    "MPICOLL_LAUNCH_TAG_OUTPUT": "launch/mpirun.sh: each line of output names its rank",
    "MPICOLL_SLURM_LAUNCHER": "launch/slurm.sbatch: srun or mpiexec",
    "MPICOLL_TEST_KILL": "runtime/faults.py, csrc/engine/test_kill.h: tests' kill points "
                         "(moment@rank/recoveries,...)",
    "MPICOLL_TEST_KILL_LOG": "tests/programs/survive_moments.py: where each test kill is logged",
    "MPICOLL_TEST_OTHER_LIBMPI": "tests/test_build.py: another MPI library to load",
    "MPICOLL_TEST_MEETING_HERE": "csrc/meeting/meeting.cc: meeting turns start on XLA's "
                                 "thread whatever the cores (1)",
    "MPICOLL_MATMUL_N": "examples/batched_matmul.py: the matrices' size",
    "MPICOLL_MATMUL_BATCH": "examples/batched_matmul.py: the batch",
    "MPICOLL_MATMUL_REPEATS": "examples/batched_matmul.py: the timed repeats",
}


class UnknownVariableWarning(UserWarning):
    """An MPICOLL_* variable that no part of mpicoll reads (a misspelt setting?)."""


def known_variables():
    """Every MPICOLL_* variable some part of mpicoll reads."""
    return [variable for variable, _ in _VARIABLES.values()] + list(OTHER_VARIABLES)


def _misspelt_prefix(name):
    """The rest of a name whose prefix is MPICOLL_ misspelt (MPICOL_TIMEOUT,
    MPI_COLL_CHECK, MPICOLLTIMEOUT), else None."""
    if name.startswith("MPICOLL_"):
        return None
    head, _, rest = name.partition("_")
    if rest and difflib.SequenceMatcher(None, head, "MPICOLL").ratio() >= 0.8:
        return rest
    squashed = name.replace("_", "")
    if squashed.startswith("MPICOLL") and len(squashed) > len("MPICOLL"):
        return squashed[len("MPICOLL"):]
    return None


def unknown_variables(environ=os.environ):
    """[(variable, the closest known name or None)] for each MPICOLL_* variable set
    that mpicoll does not read, and each whose MPICOLL_ is misspelt, in name order."""
    known = known_variables()
    prefix = len("MPICOLL_")
    # Compared without the common prefix (which would make every name "close"),
    # and without underscores (STALLREPORT is STALL_REPORT).
    rests = {k[prefix:].replace("_", ""): k for k in known}
    unknown = []
    for name in sorted(environ):
        if name.startswith("MPICOLL_") and name not in known:
            rest = name[prefix:]
        elif _misspelt_prefix(name) is not None:
            rest = _misspelt_prefix(name)
        else:
            continue
        close = difflib.get_close_matches(rest.replace("_", ""), list(rests), n=1, cutoff=0.6)
        unknown.append((name, rests[close[0]] if close else None))
    return unknown


def unknown_variable_message(name, closest):
    guess = f"; did you mean {closest}?" if closest else ""
    return (f"mpicoll: {name} is not a variable mpicoll reads{guess} "
            "(the settings: docs/settings.md)")


class SettingError(ValueError):
    """A setting's value mpicoll cannot read (its message names the variable)."""


def from_environment(environ=os.environ):
    """(Settings, {field: where its value came from}); SettingError (a ValueError)
    naming a bad variable."""
    values, where = {}, {}
    for field, (variable, parse) in _VARIABLES.items():
        raw = environ.get(variable, "").strip()
        if raw:
            try:
                values[field] = parse(variable, raw)
            except SettingError:
                raise
            except ValueError as error:
                raise SettingError(str(error)) from None
            where[field] = f"{variable}={raw}"
        else:
            where[field] = "default"
    return Settings(**values), where


def _warn_at_import(message):
    """A warning that points at the program's `import mpicoll` line (not at mpicoll's
    own or importlib's frames)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(PACKAGE_DIR)
                                 or "importlib" in frame.f_code.co_filename
                                 or frame.f_code.co_filename.startswith("<frozen")):
        frame = frame.f_back
    if frame is None:  # imported by mpicoll's own command line (python -m mpicoll)
        warnings.warn_explicit(message, UnknownVariableWarning, "<environment>", 0)
        return
    warnings.warn_explicit(message, UnknownVariableWarning, frame.f_code.co_filename,
                           frame.f_lineno,
                           registry=frame.f_globals.setdefault("__warningregistry__", {}))


_current, _sources = from_environment()
# Once, at import, on every rank alike (each reads the same job environment).
for _name, _closest in unknown_variables():
    _warn_at_import(unknown_variable_message(_name, _closest))


def current():
    """The settings in force."""
    return _current


def sources():
    """{field: "MPICOLL_...=value", "default" or "override"}."""
    return dict(_sources)


@contextlib.contextmanager
def override(**changes):
    """Within the block, the settings with `changes`; as before after it.

    Settings are read when a call is traced, so programs traced inside keep
    what they saw: around a jitted function's first call,
    `local_combine_bytes=0` forces the ranks x devices allreduce off its
    in-handler combine (0 or float("inf") force a path either way).  Every
    rank must use the same.

    Args:
        changes: settings by their field names (docs/settings.md), e.g.
            local_combine_bytes=0; a field given None is left as it is.

    Returns:
        A context manager; within it, `python -m mpicoll info` and the traced
        programs see the changed settings (their source reads "override").

    Example::

        with mpicoll.override_settings(local_combine_bytes=0):
            step(x)     # traced and compiled here: the per-device path
    """
    global _current, _sources
    changes = {field: value for field, value in changes.items() if value is not None}
    saved = _current, _sources
    _current = dataclasses.replace(_current, **changes)
    _sources = {**_sources, **{field: "override" for field in changes}}
    try:
        yield _current
    finally:
        _current, _sources = saved

"""Every MPICOLL_* environment variable, read once at import into one `Settings` object.

The other modules never read the environment: they read `current()`.  A setting
that can change while a program runs (the check mode, the timeout, autodiff,
dispatch) has its own setter in the public API, which starts from the value read
here; the allreduce thresholds change only within `override(...)`, for
measurements and tests.  `sources()` says where each value came from.

  variable                     values (default first)               what it sets
  MPICOLL_ABORT_ON_ERROR       1 with more than one rank, else 0     failures.py
  MPICOLL_CHECK                first-run | every-call (all, 1) | off (0)
  MPICOLL_TIMEOUT              600 seconds; 0 = never                failures.py
  MPICOLL_STALL_REPORT         60 seconds; 0 = off                   failures.py
  MPICOLL_FLIGHT_RECORDS       1000 per local device; 0 = off        failures.py
  MPICOLL_FLIGHT_DIR           a folder per job in tempfile.gettempdir() | a directory
  MPICOLL_TRACE                a directory: record the timeline there; unset = off
  MPICOLL_AUTODIFF             checked | convention
  MPICOLL_DISPATCH             default | device-order | tokens
  MPICOLL_GPU_TRANSPORT        auto | staged | cuda-aware
  MPICOLL_GPU_CHUNK_BYTES      4194304 (0 = no pipelining)
  MPICOLL_LOCAL_COMBINE_BYTES  1048576: ranks x devices allreduce, combine in the handler
  MPICOLL_SPLIT_ALLREDUCE_BYTES 262144: ranks x devices allreduce, split the MPI work
  MPICOLL_GATHER_PIECES        0 (automatic) | N: the local meeting's allgather in N pieces
  MPICOLL_AS_MPI4JAX           0 | 1: `import mpi4jax` gives mpicoll.mpi4jax (read at start-up
                               by _mpicoll_as_mpi4jax.py, beside the package; here for info)
(the two thresholds are per device at 2 local devices; they scale as 1 / (L - 1)).
"""

import contextlib
import dataclasses
import os

DEFAULT_GPU_CHUNK_BYTES = 4 << 20
# A job stuck in a collective ends after 10 minutes (PyTorch's default too),
# with the stall report, first written after a minute, as the reason.
DEFAULT_TIMEOUT = 600.0
DEFAULT_STALL_REPORT = 60.0
# Each local device's last 1,000 collectives (about 150 B each) are kept for
# the flight dumps (csrc/core/flight.h).
DEFAULT_FLIGHT_RECORDS = 1000
# The measurements behind these two are in ops/ranks_devices.py.
DEFAULT_LOCAL_COMBINE_BYTES = 1024 * 1024
DEFAULT_SPLIT_ALLREDUCE_BYTES = 256 * 1024

CHECK_MODES = ("off", "first-run", "every-call")
AUTODIFF_MODES = ("checked", "convention")
DISPATCH_CHOICES = ("default", "device-order", "tokens")
GPU_TRANSPORTS = ("auto", "staged", "cuda-aware")


@dataclasses.dataclass(frozen=True)
class Settings:
    """mpicoll's settings as read from the environment (None: decided later, see field)."""
    abort_on_error: bool = None  # None: on when the job has more than one rank
    check: str = "first-run"
    timeout: float = DEFAULT_TIMEOUT
    stall_report: float = DEFAULT_STALL_REPORT
    flight_records: int = DEFAULT_FLIGHT_RECORDS
    # "": a folder of the job's own in tempfile.gettempdir(), which the extension
    # names once the ranks have met (one name for every rank; not in the user's
    # working directory); else the directory (absolute) the dumps are written to.
    flight_dir: str = ""
    trace: str = ""  # "": no timeline; else the directory (absolute) it is written to
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


def _flag(name, raw):
    return raw.lower() not in ("0", "false", "no", "off")


def _check(name, raw):
    raw = raw.lower()
    if raw in ("first", "first-run"):
        return "first-run"
    if raw in ("every-call", "all"):
        return "every-call"
    return "every-call" if _flag(name, raw) else "off"


def _choice(choices):
    def parse(name, raw):
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value
    return parse


def _seconds(name, raw):
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0 seconds, got {raw!r}")
    return value


def _non_negative_integer(unit=""):
    def parse(name, raw):
        try:
            value = int(raw)
            if value < 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{name}={raw!r} must be a non-negative integer{unit}") from None
        return value
    return parse


_bytes = _non_negative_integer(" (bytes)")
_count = _non_negative_integer()


def _writable_directory(create):
    """A directory mpicoll writes files to, as an absolute path; checked at import so
    that a bad one fails there (on every rank alike) rather than when a dump is due.
    create: make it now (the timeline); else only its parent must be writable (the
    flight recorder makes it when it first dumps)."""
    def parse(name, raw):
        path = os.path.abspath(os.path.expanduser(raw))
        try:
            if create:
                os.makedirs(path, exist_ok=True)
            target = path if create or os.path.isdir(path) else os.path.dirname(path)
            if not os.path.isdir(target):
                raise OSError(f"{target} is not a directory")
            if not os.access(target, os.W_OK | os.X_OK):
                raise OSError(f"{target} is not writable")
        except OSError as error:
            raise ValueError(f"{name}={raw!r}: mpicoll cannot write there ({error})") from None
        return path
    return parse


# field -> (variable, parser of its stripped, non-empty value)
_VARIABLES = {
    "abort_on_error": ("MPICOLL_ABORT_ON_ERROR", _flag),
    "check": ("MPICOLL_CHECK", _check),
    "timeout": ("MPICOLL_TIMEOUT", _seconds),
    "stall_report": ("MPICOLL_STALL_REPORT", _seconds),
    "flight_records": ("MPICOLL_FLIGHT_RECORDS", _count),
    "flight_dir": ("MPICOLL_FLIGHT_DIR", _writable_directory(create=False)),
    "trace": ("MPICOLL_TRACE", _writable_directory(create=True)),
    "autodiff": ("MPICOLL_AUTODIFF", _choice(AUTODIFF_MODES)),
    "dispatch": ("MPICOLL_DISPATCH", _choice(DISPATCH_CHOICES)),
    "gpu_transport": ("MPICOLL_GPU_TRANSPORT", _choice(GPU_TRANSPORTS)),
    "gpu_chunk_bytes": ("MPICOLL_GPU_CHUNK_BYTES", _bytes),
    "local_combine_bytes": ("MPICOLL_LOCAL_COMBINE_BYTES", _bytes),
    "split_allreduce_bytes": ("MPICOLL_SPLIT_ALLREDUCE_BYTES", _bytes),
    "gather_pieces": ("MPICOLL_GATHER_PIECES", _count),
    "as_mpi4jax": ("MPICOLL_AS_MPI4JAX", _flag),
}


def from_environment(environ=os.environ):
    """(Settings, {field: where its value came from}); ValueError naming a bad variable."""
    values, where = {}, {}
    for field, (variable, parse) in _VARIABLES.items():
        raw = environ.get(variable, "").strip()
        if raw:
            values[field] = parse(variable, raw)
            where[field] = f"{variable}={raw}"
        else:
            where[field] = "default"
    return Settings(**values), where


_current, _sources = from_environment()


def current():
    """The settings in force."""
    return _current


def sources():
    """{field: "MPICOLL_...=value", "default" or "override"}."""
    return dict(_sources)


@contextlib.contextmanager
def override(**changes):
    """Within: the settings with `changes` (None leaves a field as it is).

    Read when a call is traced, so programs traced inside keep what they saw;
    e.g. override(local_combine_bytes=0) forces the ranks x devices allreduce off
    its in-handler combine (0 or float("inf") force a path either way).
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

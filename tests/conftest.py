"""Shared helpers for the mpicoll test suite.

Every test runs unchanged under plain `pytest` (one rank) and under
`mpiexec -n N python -m pytest --with-mpi` for any N: each rank runs the same
tests in the same order, so their collectives match.

The numpy reference is independent of MPI: `rank_data` is deterministic in
(shape, dtype, rank, seed, kind), so every rank regenerates every other rank's
input and computes the expected result of a collective locally.

Two rules keep a multi-rank run from hanging when a test fails: a test issues
all its collectives before it asserts anything, and whether a test runs or is
skipped never depends on the rank.

Tests that start MPI jobs of their own use `run_mpiexec`; they run only in the
serial suite (`serial_only`).
"""

import atexit
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import tempfile
import zlib
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)  # the 64-bit dtypes need it

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402


def _suite_flight_dir():
    """Where the suite's ranks, and the jobs its tests launch (run_mpiexec passes the
    environment on), write their flight records: one temporary directory for the whole
    run, removed when this process exits, unless MPICOLL_FLIGHT_DIR names one already.

    Set before mpicoll is imported (it reads its settings then).  Under `mpiexec ...
    pytest --with-mpi` rank 0 makes it and tells the others (one bcast, on every rank
    alike), so a stall report's `python -m mpicoll flight DIR` finds every rank's file
    there.  A run that aborts (MPI_Abort, a kill) does not reach the removal, and leaves
    the records that the report names.
    """
    world = MPI.COMM_WORLD
    made = None
    if world.Get_rank() == 0 and not os.environ.get("MPICOLL_FLIGHT_DIR"):
        made = tempfile.mkdtemp(prefix="mpicoll-flight-")
    made = world.bcast(made, root=0)
    if made is not None:
        os.environ["MPICOLL_FLIGHT_DIR"] = made
        # Every rank: on another host the directory is that host's own.
        atexit.register(shutil.rmtree, made, ignore_errors=True)


_suite_flight_dir()

import mpicoll  # noqa: E402

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
RANK = WORLD.Get_rank()

# ---------------------------------------------------------------------------
# The semantics table, written out independently of mpicoll's own tables.

BOOL_DTYPES = [np.dtype(np.bool_)]
SIGNED_DTYPES = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)]
UNSIGNED_DTYPES = [np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64)]
INTEGER_DTYPES = SIGNED_DTYPES + UNSIGNED_DTYPES
FLOAT_DTYPES = [np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)]
COMPLEX_DTYPES = [np.dtype(t) for t in (np.complex64, np.complex128)]
ALL_DTYPES = BOOL_DTYPES + INTEGER_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES

# One representative per family (for the tests that do not need every dtype).
REPRESENTATIVE_DTYPES = [np.dtype(np.bool_), np.dtype(np.int32), np.dtype(np.uint8),
                         np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64),
                         np.dtype(np.complex64)]

OPS = ("sum", "prod", "min", "max", "land", "lor", "lxor", "band", "bor", "bxor")
MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX,
           "land": MPI.LAND, "lor": MPI.LOR, "lxor": MPI.LXOR, "band": MPI.BAND,
           "bor": MPI.BOR, "bxor": MPI.BXOR}

_VALID_DTYPES = {
    "sum": INTEGER_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES,
    "prod": INTEGER_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES,
    "min": BOOL_DTYPES + INTEGER_DTYPES + FLOAT_DTYPES,
    "max": BOOL_DTYPES + INTEGER_DTYPES + FLOAT_DTYPES,
    **{op: BOOL_DTYPES + INTEGER_DTYPES for op in ("land", "lor", "lxor", "band", "bor", "bxor")},
}
VALID_PAIRS = [(op, dt) for op in OPS for dt in ALL_DTYPES if dt in _VALID_DTYPES[op]]
INVALID_PAIRS = [(op, dt) for op in OPS for dt in ALL_DTYPES if dt not in _VALID_DTYPES[op]]

COLLECTIVES = ("bcast", "scatter", "reduce", "allreduce", "gather", "allgather", "alltoall")
ROOTED = ("bcast", "scatter", "reduce", "gather")
REDUCING = ("reduce", "allreduce")
MOVEMENT = ("bcast", "scatter", "gather", "allgather", "alltoall")
STACKED_INPUT = ("scatter", "alltoall")  # x must have shape (size, *s)


def pair_id(pair):
    op, dtype = pair
    return f"{op}-{dtype}"


def input_shape(name, shape, size=SIZE):
    """The input shape a collective needs to work on blocks of `shape`."""
    return (size, *shape) if name in STACKED_INPUT else tuple(shape)


def call(name, x, root=0, op="sum", comm=None):
    """One collective with MPI's argument order; root/op only where the API takes them."""
    fn = getattr(mpicoll, name)
    if name == "reduce":
        return fn(x, op, root, comm=comm)
    if name == "allreduce":
        return fn(x, op, comm=comm)
    if name in ROOTED:
        return fn(x, root, comm=comm)
    return fn(x, comm=comm)


# ---------------------------------------------------------------------------
# Deterministic per-rank data.

def _rng(shape, dtype, rank, seed, kind):
    key = zlib.crc32(repr((tuple(shape), np.dtype(dtype).name, kind)).encode())
    return np.random.default_rng([seed, rank, key])


def rank_data(shape, dtype, rank, seed=0, kind=None):
    """Rank `rank`'s input: deterministic, exact under every reduction at small rank counts.

    kind: None for data movement (values encode the rank, so a block from the
    wrong rank is caught), or the reduction op the data is meant for: small
    integers (halves for floats) so float16/bfloat16 sums are exact, {-1, 1, 2}
    (units for complex) so products cannot overflow, and 0/1 for the logical
    ops.  Bool data is random bits.
    """
    dtype = np.dtype(dtype)
    shape = tuple(shape)
    rng = _rng(shape, dtype, rank, seed, kind)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    signed = dtype.kind in "ifc"
    if kind == "prod":
        if dtype.kind == "c":
            units = np.array([1, -1, 1j, -1j])
            return units[rng.integers(0, 4, shape)].astype(dtype)
        choices = np.array([-1, 1, 2] if signed else [1, 2])
        return choices[rng.integers(0, len(choices), shape)].astype(dtype)
    if kind in ("land", "lor", "lxor"):  # 0/1 (see test_logical_ops_give_truth_values)
        return rng.integers(0, 2, shape).astype(dtype)
    if kind is None:  # movement: the tens digit carries the rank
        base = (rank % 6) * 20
        values = base + rng.integers(0, 20, shape)
    else:  # sum/min/max/bitwise
        values = rng.integers(-4, 5, shape) if signed else rng.integers(0, 9, shape)
    if dtype.kind == "f":
        values = values + rng.integers(0, 2, shape) / 2  # halves: still exact
    if dtype.kind == "c":
        imag = rng.integers(-8, 9, shape) / 2
        return (values + 1j * imag).astype(dtype)
    return values.astype(dtype)


def all_ranks_data(shape, dtype, seed=0, kind=None, size=SIZE):
    """Every rank's input stacked by rank: what the numpy reference starts from."""
    return np.stack([rank_data(shape, dtype, r, seed, kind) for r in range(size)])


# ---------------------------------------------------------------------------
# The numpy reference.

def _wide(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
        return np.complex128
    if dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16):
        return np.float64
    if dtype.kind == "u":
        return np.uint64
    if dtype.kind == "i":
        return np.int64
    return np.bool_


def reduce_reference(stack, op):
    """Reduce a (size, *shape) stack over ranks with op, in the stack's dtype."""
    dtype = stack.dtype
    if op in ("land", "lor", "lxor"):
        ufunc = {"land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor}[op]
        return ufunc.reduce(stack != 0, axis=0).astype(dtype)
    if op in ("band", "bor", "bxor"):
        ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
        return ufunc.reduce(stack, axis=0).astype(dtype)
    wide = stack.astype(_wide(dtype))
    result = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](wide, axis=0)
    return np.asarray(result).astype(dtype)


def expected(name, stack, rank=RANK, root=0, op="sum"):
    """What collective `name` returns on `rank`, given every rank's input stacked by rank."""
    if name == "bcast":
        return stack[root]
    if name == "scatter":
        return stack[root][rank]
    if name == "allreduce":
        return reduce_reference(stack, op)
    if name == "reduce":
        result = reduce_reference(stack, op)
        return result if rank == root else np.zeros_like(result)
    if name == "gather":
        return stack if rank == root else np.zeros_like(stack)
    if name == "allgather":
        return stack
    if name == "alltoall":
        return np.stack([stack[j][rank] for j in range(stack.shape[0])])
    raise ValueError(name)


def assert_same(actual, expect):
    """Same dtype, same shape, same values (16-bit floats compared as float32)."""
    expect = np.asarray(expect)
    assert isinstance(actual, jax.Array), type(actual)
    actual = np.asarray(actual)
    assert actual.dtype == expect.dtype, (actual.dtype, expect.dtype)
    assert actual.shape == expect.shape, (actual.shape, expect.shape)
    if actual.dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        actual, expect = actual.astype(np.float32), expect.astype(np.float32)
    np.testing.assert_array_equal(actual, expect)


def assert_in_step(seed=0):
    """A collective after whatever came before gives the right answer: ranks are in step."""
    x = rank_data((3,), np.int32, RANK, seed, kind="sum")
    out = mpicoll.allreduce(x)
    assert_same(out, reduce_reference(all_ranks_data((3,), np.int32, seed, kind="sum"), "sum"))


def same_on_every_rank(value):
    """True if value (picklable) is equal on every rank of COMM_WORLD."""
    values = WORLD.allgather(value)
    return all(v == values[0] for v in values)


MODES = ("eager", "jit")


def maybe_jit(fn, mode):
    return jax.jit(fn) if mode == "jit" else fn



# ---------------------------------------------------------------------------
# MPI jobs launched from a test (serial suite only).

REPO = Path(__file__).resolve().parent.parent


def _find_mpiexec():
    """The launcher of the MPI mpi4py uses, or None.

    $MPICOLL_MPIEXEC (`make test` sets it: a system MPI's launcher is not in the
    venv), else the venv's own (a PyPI MPI wheel's).
    """
    named = os.environ.get("MPICOLL_MPIEXEC")
    if named:
        found = shutil.which(named)
        return Path(found) if found else None
    own = Path(sys.executable).parent / "mpiexec"
    return own if own.exists() else None


MPIEXEC = _find_mpiexec()
OPEN_MPI = "Open MPI" in MPI.Get_library_version()

serial_only = pytest.mark.skipif(
    SIZE > 1, reason="launches MPI jobs of its own: only in the serial (1-rank) suite")

# What a launcher around this process (or this process's own singleton MPI)
# put in the environment; none of it may reach the job's launcher.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPI4PY_", "OMPI_COMM_WORLD_")
# And what makes a process a member of a launcher's job where it must start on its
# own: Open MPI's mpirun gives its ranks OMPI_MCA_ess=^singleton among others (one
# that inherits them cannot start: "OPAL ERROR: Unreachable").
_JOB_MEMBERSHIP_PREFIXES = ("OMPI_", "MPIR_CVAR_", "SLURM_")


def environment_outside_the_job(*, standalone=False):
    """This environment without what a launcher around this process put in it: for a
    job started from here (run_mpiexec, the simulated cluster), or with standalone=True
    for a process that runs on its own, outside any job, as a user's shell would start
    it (Open MPI's run-as-root permission kept)."""
    drop = _LAUNCHER_PREFIXES + (_JOB_MEMBERSHIP_PREFIXES if standalone else ())
    return {key: value for key, value in os.environ.items()
            if not key.startswith(drop) or key.startswith("OMPI_ALLOW_RUN_AS_ROOT")}


def mpicoll_command(*args, timeout=120):
    """`python -m mpicoll ARGS` as a user runs it (flight DIR, stacks PID...): (exit
    status, output), from a process of its own outside any launcher's job (under
    `mpiexec ... pytest --with-mpi` each rank runs its own)."""
    done = subprocess.run([sys.executable, "-m", "mpicoll", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          env=environment_outside_the_job(standalone=True))
    return done.returncode, done.stdout + done.stderr


@dataclasses.dataclass
class MPIRun:
    """A finished `run_mpiexec` job: the CompletedProcess, its wall time, when it ended."""
    process: subprocess.CompletedProcess
    seconds: float
    ended: float  # time.time() when mpiexec had exited and its output was read

    @property
    def returncode(self):
        return self.process.returncode

    @property
    def stdout(self):
        return self.process.stdout

    @property
    def stderr(self):
        return self.process.stderr

    @property
    def output(self):
        return self.process.stdout + self.process.stderr

    def summary(self, tail=4000):
        """Exit status, time and the end of both streams, for assertion messages."""
        return (f"{' '.join(map(str, self.process.args))}\n"
                f"exit {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout:\n{self.stdout[-tail:]}\n--- stderr:\n{self.stderr[-tail:]}")


def _session_members(session):
    """Pids of the processes in session `session` (Linux /proc; [] elsewhere)."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[3]) == session:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    return pids


def _kill_job(process, grace=5):
    """End an MPI job started in a session of its own, whatever its launcher does.

    SIGTERM to mpiexec first (it takes its ranks down), then SIGKILL to its
    process group and to every process left in its session: Open MPI puts each
    rank in a process group of its own, and a rank whose launcher is gone is
    orphaned but keeps the session.
    """
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in _session_members(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_mpiexec(ranks, argv, env=None, timeout=300, cwd=REPO, prefix=()):
    """Run `argv` (e.g. [sys.executable, script, ...]) under the venv's mpiexec -n ranks
    (the launcher itself under `prefix`, e.g. a command that makes namespaces first).

    The launcher environment is this one minus any launcher's variables and
    minus a fake device count in XLA_FLAGS (programs set their own), plus
    `env`.  Open MPI (told apart by MPI.Get_library_version()) gets the
    run-as-root variables and --oversubscribe; MPICH with more ranks than cores
    gets MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (as launch/mpirun.sh does).  The job
    runs in its own session: on timeout mpiexec and every rank are killed
    (_kill_job) and the test fails with the output so far.
    Returns an MPIRun (returncode, stdout, stderr, output, seconds, ended).
    """
    if SIZE > 1:  # the same on every rank
        pytest.skip("launches MPI jobs of its own: only in the serial (1-rank) suite")
    if MPIEXEC is None:
        pytest.skip(f"no mpiexec next to {sys.executable} and MPICOLL_MPIEXEC "
                    f"({os.environ.get('MPICOLL_MPIEXEC')!r}) names none")
    job_env = environment_outside_the_job()
    flags = [flag for flag in job_env.get("XLA_FLAGS", "").split()
             if not flag.startswith("--xla_force_host_platform_device_count")]
    if flags:
        job_env["XLA_FLAGS"] = " ".join(flags)
    else:
        job_env.pop("XLA_FLAGS", None)
    launcher_flags = []
    if OPEN_MPI:
        job_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        launcher_flags.append("--oversubscribe")
    elif ranks > (os.cpu_count() or 1):
        job_env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    job_env.update(env or {})
    command = [*map(str, prefix), str(MPIEXEC), *launcher_flags, "-n", str(ranks),
               *map(str, argv)]
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=job_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(process)
        try:
            stdout, stderr = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process outside the group holds the pipes
            process.kill()
            stdout, stderr = "", "(output lost: processes outside the job's group hold its pipes)"
        pytest.fail(f"{' '.join(command)} did not finish in {timeout} s (killed)\n"
                    f"--- stdout:\n{stdout[-4000:]}\n--- stderr:\n{stderr[-4000:]}")
    seconds = time.monotonic() - start
    return MPIRun(subprocess.CompletedProcess(command, process.returncode, stdout, stderr),
                  seconds, time.time())


def pytest_collection_modifyitems(items):
    """Marks `odd_ranks` the tests that launch their job at 3 ranks (a `ranks`
    parameter of 3): CI runs them under one MPI, since what they add over the 2-rank
    case is the odd count, not the MPI."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("ranks") == 3:
            item.add_marker(pytest.mark.odd_ranks)


_SESSION_CHECK_MODE = mpicoll.check_mode()  # first-run unless MPICOLL_CHECK says otherwise


@pytest.fixture(autouse=True)
def _check_mode_restored():
    """A test that changes the check mode must restore it (later tests rely on it)."""
    yield
    left = mpicoll.check_mode()
    if left != _SESSION_CHECK_MODE:
        mpicoll.set_check_mode(_SESSION_CHECK_MODE)
        pytest.fail(f"the test left the check mode at {left!r} (restore the previous mode)")


@pytest.fixture
def convention_autodiff():
    """For tests of mpicoll's unchecked autodiff convention (outside mpicoll.mesh())."""
    previous = mpicoll.set_autodiff("convention")
    yield
    mpicoll.set_autodiff(previous)

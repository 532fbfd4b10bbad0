"""Timing an implementation: warm-up, k calls per run, barrier-started repeats, agreement across ranks.

An implementation is measured through three callables (benchmarks/registry.py):
once() -> this rank's output of one call on fresh input; run(k) -> k calls, done
(blocked on) when it returns; timed(repeats, timer) -> (k, times), or None to time
run() from Python.

Every benchmark times the same way, through a Timer (mpi_timer over a communicator):
a barrier, the clock, the call (which blocks until its work is done:
block_until_ready), the slowest rank's seconds.  time_call() times one call,
repeated() a warm-up call and then several, measure() k calls of run(k).
"""

import time
import traceback

MIB = 1024 * 1024
K_MAX = 20000
ONE_CALL_BYTES = 16 * MIB  # above: one call per timed run

# The CSV's status column: measured, no such collective, cannot run here, raised.
STATUS_OK, STATUS_NA, STATUS_UNAVAILABLE, STATUS_FAILED = "ok", "n/a", "not available", "failed"


class Unavailable(Exception):
    """The implementation cannot run here (the message says why)."""


class Timer:
    """Barrier-started runs timed as the slowest rank's, k chosen for a target duration.

    `run(k)` performs k calls and returns when they are done.  All ranks agree on
    every measurement (MAX over ranks), so they take the same decisions.
    barrier() starts the ranks together, slowest(seconds) -> the time that counts
    (the MAX over ranks; `lambda t: t` keeps each rank's own); target_s is needed
    by choose_k and times only.
    """

    def __init__(self, barrier, slowest, target_s=None, one_call_bytes=ONE_CALL_BYTES):
        self.barrier, self.slowest, self.target_s = barrier, slowest, target_s
        self.one_call_bytes = one_call_bytes

    def time_call(self, call):
        """(call()'s result, its seconds): started after the barrier; call() returns
        when its work is done (block_until_ready inside it)."""
        self.barrier()
        start = time.perf_counter()
        result = call()
        return result, self.slowest(time.perf_counter() - start)

    def repeated(self, call, repeats, per_call=1):
        """A warm-up call, then `repeats` timed ones: seconds per call of each (call()
        makes per_call calls)."""
        call()
        return [self.time_call(call)[1] / per_call for _ in range(repeats)]

    def measure(self, run, k):
        self.barrier()
        start = time.perf_counter()
        run(k)
        return self.slowest(time.perf_counter() - start)

    def choose_k(self, run, amortize=True, nbytes=0):
        """After a warm-up call: the number k of calls in one timed run.

        Above one_call_bytes, k = 1 for every implementation (a call is long enough,
        and each implementation is then timed the same way, fresh output buffers
        included).  Otherwise k grows from below (2x to 16x a step; each step the
        best of two runs, so one run preempted by another process does not stop the
        growth) until a run lasts the goal: the target, or with amortize (a jitted
        loop: one dispatch per run) at least 10 x a one-call run (capped at 5 x the
        target), so that the fixed cost of a run -- the dispatch of a jitted program,
        which JAX does on its Python path when the program has effects -- adds at
        most ~10% to the time per call.
        """
        run(1)
        if nbytes > self.one_call_bytes:
            return 1
        t = self.measure(run, 1)
        if t < 2 * self.target_s:  # else one call is clearly long enough
            t = min(t, self.measure(run, 1), self.measure(run, 1))
        goal = max(self.target_s, min(10 * t, 5 * self.target_s)) if amortize else self.target_s
        k = 1
        while t < goal and k < K_MAX:
            k = int(min(K_MAX, k * min(16.0, max(2.0, goal / max(t, 1e-9)))))
            t = min(self.measure(run, k) for _ in range(2))
        return k

    def times(self, run, repeats, amortize=True, nbytes=0):
        k = self.choose_k(run, amortize, nbytes)
        return k, [self.measure(run, k) for _ in range(repeats)]


def mpi_timer(comm, target_s=None, one_call_bytes=ONE_CALL_BYTES):
    """A Timer over an mpi4py communicator: its barrier, and MAX over its ranks."""
    from mpi4py import MPI
    return Timer(comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX), target_s,
                 one_call_bytes)


def repeats_for(args, nbytes):
    """Timed runs at this size: --repeats, else 5 with --quick, else 15 / 9 / 5 as it grows."""
    if args.repeats:
        return args.repeats
    if args.quick:
        return 5
    return 15 if nbytes <= MIB else 9 if nbytes <= 16 * MIB else 5


def measure(implementation, correct, comm, timer, repeats, amortize, nbytes=0):
    """(correct on every rank, k, times) of one implementation (once, run, timed).

    correct(output of once()) -> this rank's verdict; the ranks' verdicts are
    combined (AND), so every rank reports the same.
    """
    from mpi4py import MPI
    once, run, timed = implementation
    ok = comm.allreduce(bool(correct(once())), op=MPI.LAND)
    k, times = (timed(repeats, timer) if timed else
                timer.times(run, repeats, amortize=amortize, nbytes=nbytes))
    return ok, k, times


def record(row, measure_row, rank, progress):
    """Fill row from measure_row() -> (correct, k, times); a failure is recorded, the run goes on."""
    started = time.perf_counter()
    try:
        ok, k, times = measure_row()
        row.update(status=STATUS_OK, correct=ok, k=k, times=times)
    except Unavailable as error:
        row.update(status=STATUS_UNAVAILABLE, note=str(error))
    except Exception as error:
        if rank == 0:
            traceback.print_exc()
        row.update(status=STATUS_FAILED, note=f"{type(error).__name__}: {error}")
    row["seconds"] = time.perf_counter() - started
    progress(row)
    return row

"""Dispatch of jitted programs with collectives: device order and runtime tokens.

In "device-order" mode (the default on CPU) a program on one device carries
no runtime token, so that JAX dispatches it on its C++ fast path; XLA's
per-device queue keeps the programs' order.  These tests check that the fast
path is really taken (structurally: the compiled program has no token
parameter, and JAX's Python dispatch path is not entered), that the switch
restores the tokens, that the order holds across programs, eager calls and
communicators, and that multi-device programs keep it too (a separate job
with two local devices per rank).
"""

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import pxla

import mpicoll
from mpicoll._src import _compat
from mpicoll._src.primitive import device_order, define
from conftest import (RANK, SIZE, WORLD, all_ranks_data, assert_in_step, assert_same,
                      run_mpiexec, serial_only)

PROGRAM = Path(__file__).parent / "programs" / "dispatch_order.py"


@pytest.fixture
def dispatch(request):
    """Run a test in the given dispatch mode, then restore the previous one."""
    previous = mpicoll.set_dispatch(request.param)
    yield request.param
    mpicoll.set_dispatch(previous)


@pytest.fixture
def python_path_calls(monkeypatch):
    """How many times JAX's Python dispatch path (ExecuteReplicated) ran a program."""
    calls = []
    original = pxla.ExecuteReplicated.__call__

    def counted(self, *args):
        calls.append(self.name)
        return original(self, *args)

    monkeypatch.setattr(pxla.ExecuteReplicated, "__call__", counted)
    return calls


def test_device_order_is_the_default_on_this_jax():
    assert device_order.DEVICE_ORDER_AVAILABLE, "JAX's internals changed: device order is off"
    assert mpicoll.dispatch_mode() == "device-order"


def test_the_source_text_of_jax_lowering_is_read_as_expected_on_this_jax():
    """The one place mpicoll reads JAX's source (pxla._cached_lowering_to_hlo, a C++ cache
    without a signature): the three arguments the hook rewrites are found by position,
    on each JAX line CI runs (0.10 on Python 3.11, the newest on 3.12)."""
    hooks = _compat.dispatch_hooks
    assert hooks.jax_line() in hooks.LOWERING_POSITIONS, \
        f"jax {jax.__version__}: a line the dispatch hook was not checked against"
    assert hooks._positions_in_source() == hooks.LOWERING_POSITIONS[hooks.jax_line()], \
        f"jax {jax.__version__}: pxla's lowering function is not as the table says"
    assert hooks._lowering_argument_positions() is not None


def test_a_jax_line_the_table_lacks_is_a_missing_hook(monkeypatch):
    hooks = _compat.dispatch_hooks
    monkeypatch.setattr(hooks, "jax_line", lambda: (0, 99))
    assert hooks._lowering_argument_positions() is None
    assert any("at the positions mpicoll checked for jax 0.10, 0.11, 0.12" in line
               for line in hooks.missing_hooks())


@pytest.mark.parametrize("dispatch", ["device-order", "tokens"], indirect=True)
def test_program_takes_a_runtime_token_only_in_tokens_mode(dispatch):
    program = jax.jit(lambda x: mpicoll.allreduce(x) * 2)
    x = jnp.arange(3.0)
    compiled = program.lower(x).compile()
    entry = next(line for line in compiled.as_text().splitlines() if line.startswith("ENTRY"))
    assert ("token[]" in entry) == (dispatch == "tokens"), entry
    assert_same(compiled(x), np.arange(3.0) * SIZE * 2)


@pytest.mark.parametrize("dispatch", ["device-order", "tokens"], indirect=True)
def test_repeated_calls_skip_jax_python_dispatch_only_in_device_order(dispatch,
                                                                      python_path_calls):
    def fused_step(xs):
        return [x + 1 for x in mpicoll.allreduce(xs)]

    program = jax.jit(fused_step)
    xs = [jnp.full(2, float(i + RANK)) for i in range(5)]
    outs = [program(xs) for _ in range(4)]
    # The first call compiles and runs on the Python path; the C++ fast path
    # serves the rest only without runtime tokens.
    calls = python_path_calls.count("jit(fused_step)")
    assert calls == (1 if dispatch == "device-order" else 4), python_path_calls
    total = sum(range(SIZE))
    for out in outs:
        for i, leaf in enumerate(out):
            assert_same(leaf, np.full(2, SIZE * i + total + 1.0))


def test_set_dispatch_rejects_unknown_modes_and_returns_the_previous_one():
    with pytest.raises(ValueError, match="mode must be one of"):
        mpicoll.set_dispatch("fifo")
    previous = mpicoll.set_dispatch("tokens")
    try:
        assert mpicoll.dispatch_mode() == "tokens"
    finally:
        assert mpicoll.set_dispatch(previous) == "tokens"


def test_hooks_are_not_installed_where_jax_internals_differ(monkeypatch):
    """Feature detection: without the expected lowering function the hooks stay out
    (and programs keep JAX's runtime tokens)."""
    hooks = _compat.dispatch_hooks
    monkeypatch.setattr(hooks, "_lowering_argument_positions", lambda: None)
    assert not device_order.DeviceOrderDispatch(define.MPIEffect).install()
    monkeypatch.undo()
    monkeypatch.setattr(hooks._pxla, "_cached_lowering_to_hlo", None)
    assert not device_order.DeviceOrderDispatch(define.MPIEffect).install()


@pytest.mark.parametrize("dispatch", ["device-order", "tokens"], indirect=True)
def test_independent_collectives_on_several_comms_in_a_loop_with_eager_calls(dispatch):
    """Programs whose collectives on three communicators do not depend on each other,
    dispatched back to back without waiting, some ranks slower, eager calls between
    them: every rank must issue them in the same order."""
    comms = [WORLD.Dup() for _ in range(3)]
    data = all_ranks_data((3,), np.float64, seed=61)

    def slow_on_some_ranks(x, step):
        if (step + RANK) % 2:
            return x
        big = jnp.sin(jnp.arange(300_000.0) * (step + 1))
        return x + (jnp.sum(big * big) > 1e30).astype(x.dtype)  # always 0

    programs = [jax.jit(lambda x, s=s: (
        mpicoll.allreduce(slow_on_some_ranks(x, s), comm=comms[0]),
        mpicoll.bcast(x * 2, s % SIZE, comm=comms[1]),
        mpicoll.allgather(x + 1, comm=comms[2]),
        mpicoll.reduce(x, "max", (s + 1) % SIZE, comm=comms[0]))) for s in range(2)]
    results = []
    for step in range(20):
        x = data[RANK] + step
        results.append(programs[step % 2](x))
        if step % 4 == 3:
            results.append(mpicoll.allreduce(x * 5, comm=comms[0 if step % 8 == 3 else 1]))
    index = 0
    for step in range(20):
        stack = data + step
        a, b, c, d = results[index]
        assert_same(a, stack.sum(0))
        assert_same(b, stack[step % 2 % SIZE] * 2)  # root s % SIZE, s = step % 2
        assert_same(c, stack + 1)
        if RANK == (step % 2 + 1) % SIZE:
            assert_same(d, stack.max(0))
        index += 1
        if step % 4 == 3:
            assert_same(results[index], stack.sum(0) * 5)
            index += 1
    for comm in comms:
        comm.Free()
    assert_in_step(seed=62)


@pytest.mark.parametrize("dispatch", ["device-order"], indirect=True)
def test_effects_barrier_waits_for_device_order_programs(dispatch):
    """jax.effects_barrier() returns once a pending program without runtime token ran."""
    program = jax.jit(lambda x: mpicoll.allreduce(
        x + (jnp.sum(jnp.sin(jnp.arange(3_000_000.0))) > 1e30).astype(x.dtype)))
    out = program(jnp.ones(2))
    jax.effects_barrier()
    assert out.is_ready()
    assert_same(out, np.full(2, float(SIZE)))


@serial_only
@pytest.mark.parametrize("mode,pool,first", [
    ("device-order", "4", ""), ("device-order", "4", "--single-first"),
    ("device-order", "2", ""), ("tokens", "", "")])
def test_single_and_multi_device_programs_and_eager_calls_keep_one_order(mode, pool, first):
    """pool: XLA's CPU thread pool (PJRT_NPROC).  With two threads per device,
    multi-device programs carry their token in the module (XLA's chain of
    multi-device executions orders them) and the single-device ones are fenced on
    that chain, unless a single-device program came first; with fewer threads,
    the reverse."""
    result = run_mpiexec(2, [sys.executable, PROGRAM, mode, first], timeout=240,
                         env={"MPICOLL_TIMEOUT": "60", "PJRT_NPROC": pool})
    assert result.returncode == 0, result.summary()
    kind = ("" if mode == "tokens" or pool == "2" else
            ", single-device first" if first else ", multi-device in module")
    assert f"ALL OK (2 ranks, {mode}{kind})" in result.stdout, result.summary()


def test_xla_cpu_pool_size_is_read_as_xla_reads_it(monkeypatch):
    """PJRT_NPROC, else NPROC (a value that is not a number: the next), else the cores
    this process may run on; at least the device count.  Multi-device programs carry
    their token in the module only with two pool threads per CPU device."""
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("PJRT_NPROC", "7")
    assert device_order.xla_cpu_pool_threads() == 7
    monkeypatch.setenv("PJRT_NPROC", "seven")
    monkeypatch.setenv("NPROC", "5")
    assert device_order.xla_cpu_pool_threads() == 5
    monkeypatch.delenv("PJRT_NPROC")
    monkeypatch.delenv("NPROC")
    assert device_order.xla_cpu_pool_threads() == max(len(os.sched_getaffinity(0)),
                                                      len(jax.local_devices(backend="cpu")))
    devices = len(jax.local_devices(backend="cpu"))
    monkeypatch.setenv("PJRT_NPROC", str(2 * devices - 1))
    assert not device_order.chain_safe()
    monkeypatch.setenv("PJRT_NPROC", str(2 * devices))
    assert device_order.chain_safe()


def test_xla_cpu_pool_is_sized_for_the_devices_asked_for(monkeypatch):
    """Before JAX starts: two pool threads per CPU device asked for, where the cores
    are fewer; a PJRT_NPROC or NPROC of the user's is kept."""
    monkeypatch.setattr(_compat, "backends_initialized", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(device_order, "_pool_we_set", "")
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
    device_order.size_xla_cpu_pool()
    assert os.environ["PJRT_NPROC"] == "6"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=5")
    device_order.size_xla_cpu_pool()  # asked for again (mpicoll.distributed.initialize)
    assert os.environ["PJRT_NPROC"] == "10"
    monkeypatch.setenv("PJRT_NPROC", "3")  # the user's
    device_order.size_xla_cpu_pool()
    assert os.environ["PJRT_NPROC"] == "3"
    monkeypatch.delenv("PJRT_NPROC")
    monkeypatch.setattr(device_order, "_pool_we_set", "")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    device_order.size_xla_cpu_pool()  # one device: the pool is XLA's
    assert "PJRT_NPROC" not in os.environ

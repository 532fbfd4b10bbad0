"""Eager calls with the same shape, dtype and parameters compile once.

Compilations are counted with JAX's monitoring hook for the backend-compile
event (jax._src.dispatch.BACKEND_COMPILE_EVENT); each test first checks that
the counter sees the first call's compilation, so a silent counter cannot
make the test pass.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import dispatch

import mpicoll
from conftest import COLLECTIVES, RANK, SIZE, WORLD, call, input_shape

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_event_name_matches_jax():
    assert dispatch.BACKEND_COMPILE_EVENT == BACKEND_COMPILE_EVENT


@contextlib.contextmanager
def count_compilations():
    events = []

    def listener(event, duration, **kwargs):
        if event == BACKEND_COMPILE_EVENT:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# A shape used nowhere else in the suite, so the first call must compile.
FRESH_SHAPE = (7, 13)


@pytest.mark.parametrize("name", COLLECTIVES)
def test_repeated_eager_calls_compile_once(name):
    shape = input_shape(name, FRESH_SHAPE)
    root = SIZE - 1
    with count_compilations() as compiled:
        call(name, np.full(shape, RANK, np.int16), root).block_until_ready()
        first = len(compiled)
        for i in range(4):  # new values; numpy and JAX inputs alike
            x = np.full(shape, RANK + i, np.int16)
            call(name, x if i % 2 else jnp.asarray(x), root).block_until_ready()
        again = len(compiled) - first
    assert first >= 1, "the compile counter saw nothing: it does not count"
    assert again == 0, f"{again} recompilations for identical shape/dtype/parameters"


def test_repeated_eager_barriers_compile_once():
    comm = WORLD.Dup()
    try:
        with count_compilations() as compiled:
            jax.jit(lambda: mpicoll.barrier(comm=comm))()  # a new program: must compile
            counter_works = len(compiled) >= 1
            mpicoll.barrier(comm=comm)  # may reuse a program cached for an earlier comm
            first = len(compiled)
            for _ in range(4):
                mpicoll.barrier(comm=comm)
            again = len(compiled) - first
    finally:
        comm.Free()
    assert counter_works, "the compile counter saw nothing: it does not count"
    assert again == 0


def test_different_parameters_do_compile():
    """The counter distinguishes: a new root or op is a new program."""
    x = np.ones((11, 3), np.float32)
    mpicoll.reduce(x, "sum", 0).block_until_ready()
    with count_compilations() as compiled:
        mpicoll.reduce(x, "sum", 0).block_until_ready()
        same = len(compiled)
        mpicoll.reduce(x, "max", 0).block_until_ready()
    assert same == 0
    assert len(compiled) >= 1


def test_repeated_eager_pytree_calls_compile_once():
    tree = {"a": np.ones((5, 9), np.float32), "b": [np.ones(9, np.int16), np.float32(2)]}
    with count_compilations() as compiled:
        jax.block_until_ready(mpicoll.allreduce(tree))
        first = len(compiled)
        for i in range(4):
            jax.block_until_ready(mpicoll.allreduce(jax.tree.map(lambda v: v * i, tree)))
        again = len(compiled) - first
    assert first >= 1, "the compile counter saw nothing: it does not count"
    assert again == 0

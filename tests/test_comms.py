"""Collectives on every kind of communicator: COMM_WORLD, a Dup, a Split into groups of
different sizes, Cartesian communicators and their sub-communicators, COMM_SELF;
and communicators that are not usable: freed, null, inter-communicators.
"""

import jax
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from conftest import (COLLECTIVES, RANK, SIZE, WORLD, all_ranks_data, assert_in_step,
                      assert_same, call, expected, input_shape, rank_data)


def _check_every_collective(comm, world_ranks, seed, mode="eager"):
    """Run every collective on comm (roots: first and last) and compare with numpy.

    world_ranks[i] is the COMM_WORLD rank of comm's rank i: each member regenerates
    the other members' data from their world ranks.
    """
    size, rank = (WORLD if comm is None else comm).Get_size(), \
        (WORLD if comm is None else comm).Get_rank()
    assert len(world_ranks) == size and world_ranks[rank] == RANK
    cases = [(name, root) for name in COLLECTIVES
             for root in (sorted({0, size - 1}) if name in ("bcast", "scatter", "reduce",
                                                            "gather") else [0])]
    stacks = [np.stack([rank_data(input_shape(name, (3,), size), np.int32, w, seed + i,
                                  kind="sum" if name in ("reduce", "allreduce") else None)
                        for w in world_ranks])
              for i, (name, _) in enumerate(cases)]

    def run_all(xs):
        return [call(name, x, root, comm=comm) for (name, root), x in zip(cases, xs)]

    fn = jax.jit(run_all) if mode == "jit" else run_all
    outs = fn([stack[rank] for stack in stacks])
    for (name, root), stack, out in zip(cases, stacks, outs):
        assert_same(out, expected(name, stack, rank=rank, root=root))


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_comm_world(mode):
    _check_every_collective(WORLD, list(range(SIZE)), seed=30, mode=mode)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_default_comm(mode):
    """comm=None means mpicoll.default_comm(), which spans COMM_WORLD's ranks in order."""
    comm = mpicoll.default_comm()
    assert comm.Compare(WORLD) in (MPI.IDENT, MPI.CONGRUENT)
    _check_every_collective(comm, list(range(SIZE)), seed=31, mode=mode)
    _check_every_collective(None, list(range(SIZE)), seed=31, mode=mode)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_dup(mode):
    comm = WORLD.Dup()
    try:
        _check_every_collective(comm, list(range(SIZE)), seed=32, mode=mode)
    finally:
        comm.Free()


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_split_even_and_odd_ranks(mode):
    """Groups of different sizes when SIZE is odd; reversed order within each group."""
    comm = WORLD.Split(color=RANK % 2, key=-RANK)
    try:
        members = sorted(range(RANK % 2, SIZE, 2), reverse=True)
        assert comm.Get_size() == len(members)
        _check_every_collective(comm, members, seed=33, mode=mode)
    finally:
        comm.Free()
    assert_in_step()


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_comm_self(mode):
    _check_every_collective(MPI.COMM_SELF, [RANK], seed=34, mode=mode)


def test_cartesian_and_its_sub_communicators():
    dims = MPI.Compute_dims(SIZE, 2)
    cart = WORLD.Create_cart(dims, periods=[True, False], reorder=False)
    rows = cart.Sub([False, True])  # ranks with the same first coordinate
    try:
        assert isinstance(cart, MPI.Cartcomm)
        _check_every_collective(cart, [cart.group.Translate_ranks([r], WORLD.group)[0]
                                       for r in range(cart.size)], seed=35)
        row_world = [rows.group.Translate_ranks([r], WORLD.group)[0] for r in range(rows.size)]
        _check_every_collective(rows, row_world, seed=36, mode="jit")
    finally:
        rows.Free()
        cart.Free()


def test_two_communicators_in_one_program():
    """A program mixing the default communicator and a Split keeps both in order."""
    sub = WORLD.Split(color=RANK % 2, key=RANK)
    try:
        members = list(range(RANK % 2, SIZE, 2))
        data = all_ranks_data((3,), np.int64, seed=37, kind="sum")

        @jax.jit
        def program(x):
            return [mpicoll.allreduce(x), mpicoll.allreduce(x, comm=sub),
                    mpicoll.allgather(x, comm=sub), mpicoll.bcast(x, SIZE - 1)]

        total, sub_total, sub_stack, root_x = program(data[RANK])
    finally:
        sub.Free()
    assert_same(total, data.sum(0))
    assert_same(sub_total, data[members].sum(0))
    assert_same(sub_stack, data[members])
    assert_same(root_x, data[SIZE - 1])


# ---------------------------------------------------------------------------
# Communicators mpicoll must refuse.

def test_freed_comm_is_refused():
    comm = WORLD.Dup()
    mpicoll.allreduce(np.ones(2), comm=comm)  # registered with mpicoll while alive
    comm.Free()
    for name in COLLECTIVES:
        with pytest.raises(ValueError, match="comm"):
            call(name, np.ones(input_shape(name, (2,))), comm=comm)
    with pytest.raises(ValueError, match="comm"):
        mpicoll.barrier(comm=comm)
    assert_in_step()


def test_comm_null_is_refused():
    for name in COLLECTIVES:
        with pytest.raises(ValueError, match="comm"):
            call(name, np.ones(input_shape(name, (2,))), comm=MPI.COMM_NULL)
    with pytest.raises(ValueError, match="comm"):
        mpicoll.barrier(comm=MPI.COMM_NULL)
    assert_in_step()


def _make_intercomm():
    """Even ranks and odd ranks as the two groups of an inter-communicator."""
    local = WORLD.Split(color=RANK % 2, key=RANK)
    remote_leader = 1 - RANK % 2  # lowest world rank of the other group
    inter = local.Create_intercomm(0, WORLD, remote_leader, tag=77)
    return local, inter


def test_intercomm_is_refused():
    if SIZE < 2:
        pytest.skip("an inter-communicator needs two disjoint groups, so at least 2 processes "
                    "(the other bad-comm cases run at every size)")
    local, inter = _make_intercomm()
    try:
        assert inter.Is_inter()
        for name in COLLECTIVES:
            with pytest.raises(TypeError, match="inter-communicator"):
                call(name, np.ones(input_shape(name, (2,), local.size)), comm=inter)
        with pytest.raises(TypeError, match="inter-communicator"):
            mpicoll.barrier(comm=inter)
        # The same handle seen through the base class is still an inter-communicator.
        with pytest.raises(TypeError, match="inter-communicator"):
            mpicoll.allreduce(np.ones(2), comm=MPI.Comm(inter))
    finally:
        inter.Free()
        local.Free()
    assert_in_step()


# ---------------------------------------------------------------------------
# mpicoll keeps a fixed table of communicator slots; freeing a communicator must
# release its slot, and a freed communicator must never be reached again.

def test_freeing_communicators_releases_their_slots():
    """Register and free more communicators than the table holds (COMM_SELF dups: local)."""
    from mpicoll._src.runtime.native import extension
    capacity = extension.build_info()["max_comms"]
    for i in range(capacity + 10):
        comm = MPI.COMM_SELF.Dup()
        # A refused call still resolves (registers) the communicator, with no MPI traffic.
        with pytest.raises(ValueError, match="root"):
            mpicoll.bcast(np.ones(1), root=-1, comm=comm)
        comm.Free()
    comm = WORLD.Dup()
    try:
        out = mpicoll.allreduce(np.ones(2, np.int32), comm=comm)
    finally:
        comm.Free()
    assert_same(out, np.full(2, SIZE, np.int32))


def test_program_compiled_for_a_freed_comm_does_not_run_on_another():
    """A jitted function traced with comm A, called after A was freed, must fail.

    mpicoll bakes A's table slot into the compiled program; once A is freed, the
    next communicator registered gets the same slot, and the cached program must
    not silently run its collectives on that unrelated communicator.
    (allreduce only: with a size-changing collective the stale program would also
    write past its output buffer.)
    """
    a = MPI.COMM_SELF.Dup()
    x = np.full(2, RANK + 1, np.int64)
    program = jax.jit(lambda v: mpicoll.allreduce(v, comm=a))
    before = program(x)
    a.Free()
    b = WORLD.Dup()  # takes over the freed slot
    try:
        mpicoll.allreduce(x, comm=b)
        try:
            # Cached: no retrace, so no Python-side check.  On a GPU the handler's
            # error surfaces when the result is ready, so wait for it here.
            after = program(x).block_until_ready()
            raised = None
        except Exception as error:  # noqa: BLE001 - any error is acceptable, silence is not
            after, raised = None, error
            mpicoll.clear_error()  # on a GPU the ordering token carries the error on
    finally:
        b.Free()
    assert_same(before, x)
    assert raised is not None, (
        f"a program compiled for a freed communicator ran on another one and returned "
        f"{np.asarray(after)} (the reduction over the new communicator)")
    assert_in_step()

"""jax.lax collectives over mpicoll.RANKS inside shard_map over mpicoll.mesh().

In-process (serially and at 2-4 ranks): each collective over the ranks against
numpy on every rank's data, and the refusals, raised the same on every rank.
From the serial run: tests/programs/lax_over_ranks.py at ranks x local devices,
where every body also runs over (RANKS, dev) and (dev, RANKS), under vmap and
vjp, against the same body over a one-process mesh of ranks x devices.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import mpicoll
from conftest import MPIEXEC, run_mpiexec, serial_only

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
R = mpicoll.RANKS
MESH = mpicoll.mesh()
PROGRAM = Path(__file__).parent / "programs" / "lax_over_ranks.py"


def over_ranks(fn, out_specs=P(R)):
    return jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=P(R), out_specs=out_specs))


def everyone(shape, seed=0):
    """Every rank's data, rows by rank (the same on every rank)."""
    return np.random.default_rng(seed).normal(size=(SIZE, *shape)).astype(np.float32)


ring = [(r, (r + 1) % SIZE) for r in range(SIZE)]

# name -> (body, per-rank shape, numpy reference of (every rank's x, rank))
CASES = {
    "psum": (lambda x: lax.psum(x, R), (3,), lambda a, r: a.sum(0)),
    "pmean": (lambda x: lax.pmean(x, R), (3,), lambda a, r: a.mean(0)),
    "pmax": (lambda x: lax.pmax(x, R), (3,), lambda a, r: a.max(0)),
    "pmin": (lambda x: lax.pmin(x, R), (3,), lambda a, r: a.min(0)),
    "axis_index and axis_size": (
        lambda x: x * 0 + lax.axis_index(R) + 10 * lax.axis_size(R), (2,),
        lambda a, r: np.full(2, r + 10 * SIZE)),
    "psum of a constant": (lambda x: x * 0 + lax.psum(1, R), (2,), lambda a, r: np.full(2, SIZE)),
    "all_gather": (lambda x: lax.all_gather(x, R).ravel(), (2,), lambda a, r: a.ravel()),
    "all_gather tiled axis=1": (lambda x: lax.all_gather(x, R, axis=1, tiled=True).ravel(),
                                (2, 2), lambda a, r: np.concatenate(list(a), axis=1).ravel()),
    "psum_scatter": (lambda x: lax.psum_scatter(x, R).ravel(), (SIZE, 2),
                     lambda a, r: a.sum(0)[r]),
    "psum_scatter tiled": (lambda x: lax.psum_scatter(x, R, tiled=True), (2 * SIZE,),
                           lambda a, r: a.sum(0)[2 * r:2 * r + 2]),
    "all_to_all": (lambda x: lax.all_to_all(x, R, 0, 0).ravel(), (SIZE, 2),
                   lambda a, r: a[:, r].ravel()),
    "ppermute ring": (lambda x: lax.ppermute(x, R, ring), (3,), lambda a, r: a[(r - 1) % SIZE]),
    "ppermute partial": (lambda x: lax.ppermute(x, R, [(0, SIZE - 1)]), (3,),
                         lambda a, r: a[0] if r == SIZE - 1 else np.zeros(3)),
    "pbroadcast": (lambda x: lax.pbroadcast(x, R, SIZE - 1), (3,), lambda a, r: a[SIZE - 1]),
    "pshuffle": (lambda x: lax.pshuffle(x, R, [(r + 1) % SIZE for r in range(SIZE)]), (3,),
                 lambda a, r: a[(r + 1) % SIZE]),
}


@pytest.mark.parametrize("name", CASES)
def test_a_lax_collective_over_the_ranks_acts_across_every_rank(name):
    body, shape, reference = CASES[name]
    data = everyone(shape, seed=len(name))
    got = over_ranks(body)(jnp.asarray(data[RANK]))
    np.testing.assert_allclose(got, reference(data, RANK), rtol=1e-5, atol=1e-6)


def test_an_invariant_result_is_typed_invariant_and_its_gradient_collects_every_rank():
    # check_vma: psum over the ranks is the same everywhere (out_specs P()); the
    # gradient of a replicated parameter sums every rank's contribution.
    data = everyone((3,), seed=3)
    w = jnp.asarray(np.linspace(0.5, 1.5, 3, dtype=np.float32))

    def loss(w, x):
        return lax.psum(jnp.sum(jnp.tanh(w * x)), R)

    typed = jax.jit(jax.shard_map(loss, mesh=MESH, in_specs=(P(), P(R)), out_specs=P()))
    grad = jax.grad(typed)(w, jnp.asarray(data[RANK]))
    expected = jax.grad(lambda w: jnp.sum(jnp.tanh(w * jnp.asarray(data))))(w)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)


def test_eager_shard_map_routes_too():
    data = everyone((2,), seed=4)
    fn = jax.shard_map(lambda x: lax.psum(x, R), mesh=MESH, in_specs=P(R), out_specs=P())
    np.testing.assert_allclose(fn(jnp.asarray(data[RANK])), data.sum(0), rtol=1e-5)


def _refusal(fn, x, check_vma=True):
    """The error fn raises inside shard_map over mesh(), checked the same on every rank."""
    with pytest.raises((ValueError, NotImplementedError)) as raised:
        jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=P(R), out_specs=P(R),
                              check_vma=check_vma))(x)
    message = f"{raised.type.__name__}: {raised.value}"
    # (JAX's own messages may list a set in an order that differs between processes.)
    first_sentence = message.split(" Got ")[0]
    assert COMM.allgather(first_sentence) == [first_sentence] * SIZE
    return message


def test_a_permutation_that_is_not_one_is_refused():
    assert "is not a permutation" in _refusal(
        lambda x: lax.ppermute(x, R, [(0, SIZE)]), jnp.ones(2))
    if SIZE > 1:
        assert "is not a permutation" in _refusal(
            lambda x: lax.ppermute(x, R, [(0, 1), (1, 1)]), jnp.ones(2))


def test_a_tiled_scatter_the_ranks_cannot_share_is_refused():
    x = jnp.ones(2 * SIZE + 1)
    if SIZE > 1:
        assert "cannot share equally" in _refusal(
            lambda x: lax.psum_scatter(x, R, tiled=True), x)


def test_an_axis_that_is_not_a_mesh_axis_is_refused():
    # A vmap axis beside the ranks: JAX refuses it before binding, where it can.
    message = _refusal(lambda x: jax.vmap(lambda v: lax.psum(v, (R, "batch")),
                                          axis_name="batch")(x), jnp.ones((2, 2)))
    assert "psum can only accept axis_name" in message


def test_groups_that_do_not_split_the_ranks_and_unmapped_collectives_are_refused():
    # (Groups that do: tests/programs/lax_over_ranks.py, against JAX's own.)  JAX's
    # own check, the same on every rank.
    assert "cover all indices exactly once" in _refusal(
        lambda x: lax.psum(x, R, axis_index_groups=[list(range(SIZE)) + [0]]), jnp.ones(2),
        check_vma=False)
    assert "psum, pmean, pmax, pmin and all_gather in groups" in _refusal(
        lambda x: lax.psum_scatter(x, R, axis_index_groups=[list(range(SIZE))], tiled=True),
        jnp.ones(SIZE), check_vma=False)
    ragged = lambda x: lax.ragged_all_to_all(  # noqa: E731
        x, x, *[jnp.zeros(SIZE, jnp.int32)] * 4, axis_name=R)
    assert "has no MPI form in mpicoll" in _refusal(ragged, jnp.ones(2), check_vma=False)


def test_ppermute_over_the_axes_out_of_the_mesh_order_is_refused():
    two = mpicoll.mesh("dev", devices=jax.local_devices()[:1])
    with pytest.raises(ValueError, match="name the axes in the mesh's order"):
        jax.jit(jax.shard_map(lambda x: lax.ppermute(x, ("dev", R), [(0, 0)]), mesh=two,
                              in_specs=P((R, "dev")), out_specs=P((R, "dev"))))(jnp.ones(2))


@serial_only
@pytest.mark.slow  # 30 s: CI's first variant, and the jax 0.12 run
@pytest.mark.parametrize("ranks,devices", [(2, 2)])  # 1-4 x 1: in-process, above
def test_every_layout_transform_and_type_matches_one_process_over_every_device(ranks, devices):
    result = run_mpiexec(ranks, [sys.executable, PROGRAM, devices], cwd=PROGRAM.parent)
    assert result.returncode == 0, result.summary()
    assert f"ALL OK ({ranks} ranks x {devices} devices)" in result.stdout, result.summary()


@serial_only
def test_one_program_in_jax_vocabulary_runs_three_ways_alike():  # "jax_vocabulary.py"
    # Each way checks itself against numpy; the three must also print the same.
    example = Path(__file__).parent.parent / "examples" / "jax_vocabulary.py"
    local = subprocess.run([sys.executable, example, "local"], capture_output=True, text=True,
                           timeout=300)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    outputs = {"local": local.stdout}
    ranks = run_mpiexec(2, [sys.executable, example, "ranks"], timeout=300)
    assert ranks.returncode == 0, ranks.summary()
    outputs["ranks"] = ranks.stdout
    # The global mesh through launch/mpirun.sh (the launcher users run their scripts with).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "MPIR_CVAR_", "SLURM_", "MPICOLL_", "PMI", "XLA_"))}
    env.update(MPICOLL_VENV=sys.prefix, MPICOLL_LAUNCH_TIMEOUT="280",
               **({"MPICOLL_MPIEXEC": str(MPIEXEC)} if MPIEXEC else {}))
    launched = subprocess.run([str(example.parent.parent / "launch" / "mpirun.sh"), "-n", "2",
                               sys.executable, example, "global"], capture_output=True,
                              text=True, timeout=300, env=env)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    outputs["global"] = launched.stdout
    lines = {}
    for way, out in outputs.items():
        assert f"{way}: matches numpy: True" in out, out
        lines[way] = re.search(rf"^{way}: (w = .*)$", out, re.M).group(1)
    numbers = {way: [float(v) for v in re.findall(r"-?\d+\.\d+", line)]
               for way, line in lines.items()}
    for way in ("ranks", "global"):
        np.testing.assert_allclose(numbers[way], numbers["local"], rtol=1e-4, atol=2e-4,
                                   err_msg=str(lines))


def test_the_readme_snippet_runs_as_written():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"<!-- lax-over-ranks -->\n```python\n(.*?)```", text, re.S).group(1)
    names = {}
    exec(compile(code, "README.md (lax-over-ranks)", "exec"), names)
    np.testing.assert_array_equal(names["total"], [SIZE * jax.local_device_count()])

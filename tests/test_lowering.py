"""Every primitive lowers for cuda on any machine, to the same custom call as on cpu.

Lowering needs no GPU (`lowering_platforms=("cuda",)`), so this runs everywhere:
a CPU-only build emits the same calls (a GPU-enabled build then runs them).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpicoll
from mpicoll._src.runtime import native
from mpicoll._src.primitive import define
from conftest import COLLECTIVES, SIZE, call, input_shape


def lowered_text(fn, *args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def custom_calls(text):
    return re.findall(r'stablehlo\.custom_call @(\w+)', text)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_every_collective_lowers(name, platform):
    x = jnp.zeros(input_shape(name, (4,)), jnp.float32)
    text = lowered_text(lambda a: call(name, a), x, platform=platform)
    assert custom_calls(text) == [f"mpicoll_{name}"]
    tree = [x, x + 1, jnp.zeros(input_shape(name, (2,)), jnp.float32)]
    fused = lowered_text(lambda t: call(name, t), tree, platform=platform)
    assert custom_calls(fused) == [f"mpicoll_{name}_fused"]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_barrier_global_ops_and_ordering_lower(platform):
    def program(a):
        mpicoll.barrier()
        b = mpicoll.allreduce(a)
        return mpicoll.bcast(b, SIZE - 1), mpicoll.allgather(b)

    text = lowered_text(program, jnp.ones((3,), jnp.float32), platform=platform)
    # Program order is kept: one token threads the calls.
    assert custom_calls(text) == ["mpicoll_barrier", "mpicoll_allreduce", "mpicoll_bcast",
                                  "mpicoll_allgather"]
    global_sum = lowered_text(
        jax.vmap(lambda a: mpicoll.allreduce(a, axis_name="i"), axis_name="i"),
        np.ones((1, 3), np.float32), platform=platform)
    assert custom_calls(global_sum) == ["mpicoll_allreduce"]


@pytest.mark.skipif("cuda" in native.PLATFORMS,
                    reason="this build has cuda handlers (the message is for builds without)")
def test_cpu_only_build_on_a_gpu_says_how_to_rebuild(monkeypatch):
    # Stand in for a process that has a CUDA backend, with a CPU-only build.
    monkeypatch.setattr(define, "_backend_present", lambda platform: True)
    with pytest.raises(NotImplementedError, match=r"mpicoll\.allreduce: .*MPICOLL_CUDA=1"):
        lowered_text(mpicoll.allreduce, jnp.ones(3, jnp.float32), platform="cuda")


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_new_collectives_and_point_to_point_lower(platform):
    """reduce_scatter/scan/exscan (and their fused forms), the vector collectives,
    point-to-point and the status call: one custom call each, in program order."""
    x = jnp.zeros((SIZE, 4), jnp.float32)
    counts = (1,) * SIZE

    def program(a):
        outs = [mpicoll.reduce_scatter(a), mpicoll.scan(a), mpicoll.exscan(a),
                mpicoll.gatherv(a[:1], counts), mpicoll.allgatherv(a[:1], counts),
                mpicoll.scatterv(a, counts), mpicoll.alltoallv(a, counts, counts)]
        mpicoll.send(a, 0)
        outs.append(mpicoll.recv(a, 0, return_status=True))
        outs.append(mpicoll.sendrecv(a, 0, 0))
        return outs

    assert custom_calls(lowered_text(program, x, platform=platform)) == [
        "mpicoll_reduce_scatter", "mpicoll_scan", "mpicoll_exscan", "mpicoll_gatherv",
        "mpicoll_allgatherv", "mpicoll_scatterv", "mpicoll_alltoallv", "mpicoll_send",
        "mpicoll_recv", "mpicoll_status", "mpicoll_sendrecv"]
    fused = lowered_text(lambda t: (mpicoll.reduce_scatter(t), mpicoll.scan(t)), [x, x + 1],
                         platform=platform)
    assert custom_calls(fused) == ["mpicoll_reduce_scatter_fused", "mpicoll_scan_fused"]

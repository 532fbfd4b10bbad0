"""Soak of a plain `jax.jit` over P processes x L CPU devices on mpicoll's MPI:
hundreds of training steps of a model laid out on a 2-D mesh (batch over "data",
hidden units over "model"), so one step holds XLA's all-reduces over each axis and
over both, all-gathers, a collective-permute and an all-to-all, in groups that span
processes and groups that mix a process's own devices with another's
(csrc/mpiabi/xla_groups.h).  Each step's loss and the final parameters are checked
against numpy's run of the same steps.

    mpiexec -n P python plain_jit_soak.py L STEPS

Prints "PLAIN JIT SOAK OK (P ranks x L devices, STEPS steps, ...)".
"""

import sys
import time

from _common import fake_cpu_devices, report_and_exit

LOCAL = fake_cpu_devices(int(sys.argv[1]))
STEPS = int(sys.argv[2])

import mpicoll.distributed  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpicoll._src.over_ranks import jax_transport  # noqa: E402

mpicoll.distributed.initialize(initialization_timeout=60)
SIZE = MPI.COMM_WORLD.Get_size()
N = SIZE * LOCAL
failures = []
if jax_transport.transport()[0] != "mpi":
    failures.append(f"transport: {jax_transport.transport()}")

# "data" x "model" over the devices in order (2 x N/2, or N x 1 for odd N).
rows = 2 if N % 2 == 0 else N
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(rows, N // rows), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
BATCH, IN, HIDDEN = 4 * N, 8, 4 * N
rng = np.random.default_rng(3)
X = rng.standard_normal((BATCH, IN)).astype(np.float32)
Y = rng.standard_normal((BATCH, 1)).astype(np.float32)
W1 = (rng.standard_normal((IN, HIDDEN)) * 0.3).astype(np.float32)
W2 = (rng.standard_normal((HIDDEN, 1)) * 0.3).astype(np.float32)


def placed(full, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


def loss(w1, w2, x, y):
    h = jnp.tanh(x @ w1)
    h = h + 0.01 * jnp.roll(h, 1, axis=1)  # a shift of the hidden units along "model"
    return jnp.mean((h @ w2 - y) ** 2)


LAYOUTS = (NamedSharding(mesh, P(("data", "model"), None)),
           NamedSharding(mesh, P(None, ("data", "model"))))


def step(w1, w2, x, y, square, layout):
    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x, y)
    # The batch rotates by one row each step (collective-permute along "data"), and
    # a square matrix goes from rows to columns and back (all-to-all).
    rolled = jnp.roll(x, 1, axis=0), jnp.roll(y, 1, axis=0)
    moved = jax.lax.with_sharding_constraint(square, LAYOUTS[1 - layout])
    w2 = w2 - 0.05 * g2
    # The output layer, also whole on every device (all-gather along "model").
    whole_w2 = jax.lax.with_sharding_constraint(w2, NamedSharding(mesh, P()))
    return w1 - 0.05 * g1, w2, *rolled, moved, value, whole_w2


step = jax.jit(step, static_argnums=5)


def numpy_loss_and_grads(w1, w2, x, y):
    a = x @ w1
    t = np.tanh(a)
    h = t + 0.01 * np.roll(t, 1, axis=1)
    r = h @ w2 - y
    value = np.mean(r ** 2)
    dh = (2.0 / r.size) * r @ w2.T
    dt = dh + 0.01 * np.roll(dh, -1, axis=1)
    da = dt * (1 - t ** 2)
    return value, x.T @ da, h.T @ ((2.0 / r.size) * r)


w1, w2 = placed(W1, P(None, "model")), placed(W2, P("model", None))
x, y = placed(X, P("data", None)), placed(Y, P("data", None))
SQUARE = rng.standard_normal((N, N)).astype(np.float32)
square = jax.make_array_from_callback(SQUARE.shape, LAYOUTS[0], lambda index: SQUARE[index])
hlo = step.lower(w1, w2, x, y, square, 0).compile().as_text()
kinds = [k for k in ("all-reduce", "all-gather", "collective-permute", "all-to-all")
         if k in hlo]
XS, YS = X.copy(), Y.copy()
want1, want2 = W1.astype(np.float64), W2.astype(np.float64)
replicated = NamedSharding(mesh, P())
start = time.perf_counter()
for i in range(STEPS):
    w1, w2, x, y, square, value, whole_w2 = step(w1, w2, x, y, square, i % 2)
    expected, g1, g2 = numpy_loss_and_grads(want1, want2, XS, YS)
    want1, want2 = want1 - 0.05 * g1, want2 - 0.05 * g2
    XS, YS = np.roll(XS, 1, axis=0), np.roll(YS, 1, axis=0)
    got = float(np.asarray(jax.jit(lambda v: v, out_shardings=replicated)(value)
                           .addressable_data(0)))
    if not np.isclose(got, expected, rtol=2e-3, atol=1e-5):
        failures.append(f"step {i}: loss {got} against numpy's {expected}")
        break
elapsed = time.perf_counter() - start
final = np.asarray(jax.jit(lambda v: v, out_shardings=replicated)(w1).addressable_data(0))
if not np.allclose(final, want1, rtol=1e-2, atol=1e-4):
    failures.append(f"final w1 {final.ravel()[:4]} against numpy's {want1.ravel()[:4]}")
if not np.allclose(np.asarray(whole_w2.addressable_data(0)), want2, rtol=1e-2, atol=1e-4):
    failures.append("the gathered output layer is not numpy's")
whole = np.asarray(jax.jit(lambda v: v, out_shardings=replicated)(square).addressable_data(0))
if not np.array_equal(whole, SQUARE):
    failures.append("the square moved between layouts is not what it was")
if len(kinds) != 4:
    failures.append(f"the step holds only XLA's {kinds}")
report_and_exit(failures, f"({SIZE} ranks x {LOCAL} devices, {STEPS} steps, "
                f"{1e3 * elapsed / STEPS:.2f} ms per step, XLA's {'/'.join(kinds)})",
                verdict="PLAIN JIT SOAK OK")

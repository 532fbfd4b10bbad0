"""What mpicoll changes in JAX, XLA and the process at import: one step each, in
one declared order (mpicoll/_src/install.py), listed by `python -m mpicoll info`;
jax.lax is JAX's own until the first use of mpicoll.RANKS or mpicoll.mesh(); no
module makes such a change itself; mpicoll's own jax.lax calls never enter its
router of jax.lax over RANKS."""

import ast
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mpicoll
from conftest import environment_outside_the_job, serial_only
from mpicoll import _info_report
from mpicoll._src import install
from mpicoll._src.ops import ranks_devices
from mpicoll._src.over_ranks import lax as lax_over_ranks

PACKAGE = Path(mpicoll.__file__).parent

STEPS = ["xla-cpu-pool", "ffi-targets", "ordered-effect", "runtime-token-fast-path",
         "serialized-dispatch", "dispatch-order", "traceback-filter",
         "pending-collectives-at-exit", "failure-handling"]
# Applied at the first use of mpicoll.RANKS, mpicoll.mesh() or distributed.initialize().
ON_FIRST_USE = ["lax-refused-over-ranks", "ranks-axis-size", "lax-routed"]

# The calls that change JAX, XLA or the process (what install.py's steps make).
CHANGING_CALLS = {"register_ordered_effect", "refuse_lax_collectives_over",
                  "route_lax_collectives", "size_axis", "hide_frames_under",
                  "install_runtime_token_fast_path", "complete_dispatches_with",
                  "register_ffi_target", "size_xla_cpu_pool", "configure", "install", "_install",
                  "use_mode", "use_autodiff", "register"}


def test_every_change_at_import_is_one_step_applied_once_in_the_declared_order():
    applied = install.installed()
    assert [name for name, _, _ in applied] == STEPS
    assert all(changes and outcome for _, changes, outcome in applied), applied
    install.install()  # a second call changes nothing
    assert install.installed() == applied
    lines = _info_report.install_lines()
    listed = [line.split()[0] for line in lines[1:1 + 2 * len(STEPS)]
              if not line.lstrip().startswith("here:")]
    assert listed == STEPS, lines
    assert "ffi-targets" in lines[3] and "handlers for cpu" in lines[4], lines


# In a fresh process: JAX's own objects before and after `import mpicoll`, and after
# the first use of the mesh vocabulary (argv[1]: how it is first used).
_UNCHANGED_UNTIL_ASKED = r"""
import sys
import jax
from jax._src import core, lax as _lax
from jax._src.interpreters import mlir
from jax._src.lax import parallel

def jaxs():
    primitives = [v for v in vars(parallel).values() if isinstance(v, core.Primitive)]
    return ([vars(p).get("bind") for p in primitives],
            [mlir._lowerings.get(p) and mlir._lowerings[p].rule for p in primitives],
            core.AxisEnv.axis_size)

before = jaxs()
import mpicoll
from mpicoll import _info_report
from mpicoll._src import install
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(jax.devices()[:1], ("i",))
psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh,
                             in_specs=P("i"), out_specs=P()))
assert float(psum(jax.numpy.ones(1))[0]) == 1.0
print("unchanged after import:", jaxs() == before, [s[0] for s in install.installed_later()])
print("info:", "not made in this process" in "\n".join(_info_report.install_lines()))
first_use = {"RANKS": lambda: mpicoll.RANKS, "mesh": mpicoll.mesh,
             "from-import": lambda: exec("from mpicoll import RANKS")}[sys.argv[1]]
first_use()
after = jaxs()
print("changed:", [after[i] != before[i] for i in range(3)],
      [(s[0], s[3]) for s in install.installed_later()])
first_use()
print("once:", len(install.installed_later()))
"""


@serial_only  # (a process of its own, which the serial run checks once)
@pytest.mark.parametrize("first_use", ["RANKS", "mesh", "from-import"])
def test_jax_is_unchanged_until_the_mesh_vocabulary_is_first_used(first_use):
    """`import mpicoll` leaves every jax.lax collective's bind and lowering and JAX's
    axis sizes as JAX's own (a psum costs what it costs without mpicoll); the first
    use of mpicoll.RANKS or mpicoll.mesh() applies the three steps, once, and
    `python -m mpicoll info` lists them as made by it."""
    env = {**environment_outside_the_job(standalone=True), "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run([sys.executable, "-c", _UNCHANGED_UNTIL_ASKED, first_use],
                          capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
    assert "unchanged after import: True []" in out and "info: True" in out, out
    by = install.FIRST_USE_OF_RANKS
    assert f"changed: [True, True, True] {[(name, by) for name in ON_FIRST_USE]!r}" in out, out
    assert "once: 3" in out, out


def _module_level_calls(tree):
    """The names called by statements that run at import (not inside a def or class)."""
    called = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call):
            function = node.func
            called.append((getattr(function, "attr", None) or getattr(function, "id", None),
                           node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    for statement in tree.body:
        visit(statement)
    return called


def test_no_module_changes_jax_at_import_outside_the_install_step():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, line in _module_level_calls(ast.parse(path.read_text())):
            if name in CHANGING_CALLS:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}()")
    # the one call at import: mpicoll/__init__.py's
    assert [f for f in found if "_install" not in f] == [], found
    assert len(found) == 1 and found[0].startswith("mpicoll/__init__.py"), found


@pytest.fixture
def router_entries(monkeypatch):
    """Every entry into the router of jax.lax over RANKS, counted."""
    entries = []
    axes = lax_over_ranks._axes

    def counted(name, params):
        entries.append(name)
        return axes(name, params)

    monkeypatch.setattr(lax_over_ranks, "_axes", counted)
    return entries


def _traced_over_a_device_axis(body):
    mesh = mpicoll.mesh("d")
    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(mpicoll.RANKS, "d"),
                           out_specs=P(mpicoll.RANKS, "d"))
    return jax.make_jaxpr(mapped)(np.ones((1, 8), np.float32))


@pytest.mark.parametrize("collective", ["allreduce", "allreduce-max", "allgather", "bcast"])
def test_mpicolls_own_lax_calls_over_a_device_axis_never_enter_the_router(router_entries,
                                                                           collective):
    calls = {
        "allreduce": lambda x: mpicoll.allreduce(x, axis_name="d"),
        "allreduce-max": lambda x: mpicoll.allreduce(x, op="max", axis_name="d"),
        "allgather": lambda x: mpicoll.allgather(x, axis_name="d")[:1].reshape(x.shape),
        "bcast": lambda x: mpicoll.bcast(x, root=0, axis_name="d"),
    }
    with ranks_devices.composed_on_cpu():  # the composition of lax over devices and MPI
        jaxpr = _traced_over_a_device_axis(calls[collective])
    assert router_entries == [], router_entries
    assert "mpi" in str(jaxpr).lower(), jaxpr
    # the user's own jax.lax over the same axis does enter it (the count is live)
    _traced_over_a_device_axis(lambda x: jax.lax.psum(x, "d") + jnp.float32(0))
    assert len(router_entries) == 1 and router_entries[0].startswith("psum"), router_entries


def test_public_functions_are_defined_outside_the_primitive_machinery():
    """primitive/ makes primitives; what a user calls is defined where the API
    page's section would lead (ops/, observe/, runtime/, survive.py)."""
    defined_in = {name: getattr(getattr(mpicoll, name), "__module__", None)
                  for name in mpicoll.__all__ if callable(getattr(mpicoll, name))}
    machinery = {name: module for name, module in defined_in.items()
                 if module and module.startswith("mpicoll._src.primitive")}
    assert not machinery, machinery
    assert defined_in["mesh"] == defined_in["set_autodiff"] == "mpicoll._src.ops.typed_ranks"
    assert defined_in["overlap"] == defined_in["set_dispatch"] == "mpicoll._src.ops.scheduling"


def test_jaxs_own_runtime_token_method_is_kept_for_the_dispatch_benchmark():
    """Two install steps replace RuntimeTokenSet.get_token_input, the second wrapping
    the first: JAX's own method stays known (benchmarks/dispatch.py's JAX arm runs
    it), and what is in place is mpicoll's."""
    from jax._src import dispatch as jax_dispatch
    from mpicoll._src import _compat
    jaxs, current = _compat.runtime_token_methods()
    assert jaxs.__module__ == jax_dispatch.__name__, jaxs
    assert jaxs.__qualname__ == "RuntimeTokenSet.get_token_input", jaxs
    assert current is jax_dispatch.RuntimeTokenSet.get_token_input
    assert current is not jaxs and current.__module__.startswith("mpicoll."), current


def test_the_jax_installed_has_everything_the_dispatch_hooks_need():
    """On a jax that changed what the device-order dispatch hooks into, this fails
    (and import warns, naming it) instead of mpicoll silently dispatching slower."""
    from mpicoll._src._compat import dispatch_hooks
    from mpicoll._src.primitive import device_order
    from mpicoll._src.runtime import native
    assert dispatch_hooks.missing_hooks() == []
    assert device_order.DEVICE_ORDER_AVAILABLE or native.SERIALIZED


def test_a_jax_without_the_hooks_is_said_once_naming_what_is_missing():
    from mpicoll._src.primitive import device_order
    with pytest.warns(RuntimeWarning, match=r"changed what mpicoll's device-order dispatch "
                      r"hooks into \(dispatch\.RuntimeTokenSet\.get_token_input.*10x slower"):
        device_order.warn_hooks_missing(["dispatch.RuntimeTokenSet.get_token_input(eff, devices)"])

"""How a jitted program's MPI calls are ordered after the previous program's (docs/design.md).

"device-order": a CPU program (single-device, or over several devices: see
DeviceOrderDispatch) is lowered with its MPI ordering token created inside it,
so that JAX dispatches it on its C++ fast path and XLA's queues keep program
order.  "tokens": JAX's runtime tokens
thread the order from program to program (JAX's Python dispatch path), as every
program on GPU and the serialized mode use.  The serialized mode needs each
dispatch to wait for its program, which only the runtime tokens let mpicoll do,
so it keeps "tokens".  Where JAX's internals are not as expected the hooks
(_compat.dispatch_hooks) are not installed and "tokens" is the only mode
(mpicoll.dispatch_mode() says so; the choice is ops/scheduling.py's).
"""

import functools
import os
import re

import jax
import numpy as np

from .. import _compat
from ..runtime import native, settings
from .._compat import dispatch_hooks
from .define import MPIEffect, lowering_eagerly


def xla_cpu_pool_threads():
    """The threads of XLA's CPU client pool, as XLA sizes it: PJRT_NPROC (or NPROC)
    where set, else the cores this process may run on; at least one per device."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "").strip()
        if value.lstrip("-").isdigit():
            threads = max(0, int(value))
            break
    else:
        threads = _cores()
    return max(threads, cpu_device_count())


def _cores():
    """The cores this process may run on (XLA's count: its affinity mask)."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1))


def chain_safe():
    """Whether multi-device programs may be dispatched with no bound on those in
    flight: XLA admits 32 executions per device and makes a pool thread WAIT for a
    free slot (one per device of the program being dispatched, while the
    dispatching thread waits for them), and the program at the head of the chain
    needs a pool thread per device at once; with fewer than two threads per
    device, the waiting threads starve it (a deadlock, plain JAX's too: its
    in-process collectives time out there).  PJRT_NPROC=2*devices makes it so on
    a machine with fewer cores."""
    return xla_cpu_pool_threads() >= 2 * cpu_device_count()


def size_xla_cpu_pool(warn_if_late=False):
    """At import and in mpicoll.distributed.initialize(), before JAX starts its backends: where the
    CPU devices asked for (the jax_num_cpu_devices option, else XLA_FLAGS' host
    device count) outnumber half the cores, set PJRT_NPROC to two threads per
    device, so that multi-device programs with a collective take the fast path
    (chain_safe; 2 x 2 psum on 2 cores: 525-542 us per call -> 167-191).  A
    PJRT_NPROC or NPROC of the user's stays.  Measured cost there: a multi-device
    program without collective dispatches in 94-100 us instead of 38-54 (XLA's
    idle pool threads spin on the cores the dispatching thread needs); a 2048^2
    matmul is unchanged (98-102 ms with 2, 4 or 8 threads).  Returns what it did."""
    global _pool_we_set
    if os.environ.get("PJRT_NPROC", "") != _pool_we_set or os.environ.get("NPROC", "").strip():
        return "left as set (PJRT_NPROC or NPROC of the user's)"
    if _compat.backends_initialized():  # XLA has sized its pool already
        if warn_if_late and cpu_device_count() > 1 and not chain_safe():
            import warnings
            warnings.warn(
                f"mpicoll: JAX started its CPU backend before mpicoll was imported, with "
                f"{xla_cpu_pool_threads()} pool threads for {cpu_device_count()} devices; "
                "multi-device programs with collectives can then hang in XLA's own dispatch. "
                f"Import mpicoll before any JAX computation, or set "
                f"PJRT_NPROC={2 * cpu_device_count()} (docs/devices.md)", stacklevel=3)
        return "too late: JAX's backends had started"
    devices = cpu_devices_asked()
    if devices > 1 and _cores() < 2 * devices:
        _pool_we_set = os.environ["PJRT_NPROC"] = str(2 * devices)
        return f"PJRT_NPROC={_pool_we_set} ({devices} CPU devices, {_cores()} cores)"
    return f"not needed ({devices} CPU device(s), {_cores()} cores)"


_pool_we_set = ""  # the PJRT_NPROC size_xla_cpu_pool set, which it may change again


def cpu_devices_asked():
    """The CPU devices this process's CPU backend will make (before it starts): the
    jax_num_cpu_devices option, else XLA_FLAGS' host device count, else 1."""
    devices = getattr(jax.config, "jax_num_cpu_devices", -1)
    if not isinstance(devices, int) or devices < 0:
        found = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                           os.environ.get("XLA_FLAGS", ""))
        devices = int(found[-1]) if found else 1
    return devices


def cpu_device_count():
    """This process's CPU devices (1 where there is no CPU backend)."""
    try:
        return len(jax.local_devices(backend="cpu"))
    except RuntimeError:  # no CPU backend
        return 1


class DeviceOrderDispatch:
    """Programs on CPU devices order their MPI calls by XLA's execution queues, not by
    JAX's runtime tokens, so that JAX dispatches them on its C++ fast path.

    Why it is safe: XLA's CPU client runs the single-device executions of one
    device in the order they were enqueued (each waits for the device's last
    enqueued execution), and it runs multi-device executions one after another
    (every part of one waits for every part of the one before: its "collective
    launch" chain); every program's custom calls run in program order (JAX
    still threads the effect's token through the program; the token starts
    inside the module instead of coming from the previous program).  The two
    queues are not ordered against each other, so in-module tokens go to one
    kind of program per process, whichever is lowered first:

    - single-device programs (jitted, with a collective): multi-device programs
      (pmap, shard_map) keep runtime tokens, which only wait for earlier
      multi-device programs, and a fence orders them against single-device ones
      in both directions (fence_multi_device_token,
      fence_after_multi_device_token);
    - multi-device programs, where XLA's thread pool has two threads per local
      device (chain_safe): single-device jitted programs keep runtime tokens,
      and each waits for the multi-device programs before it (a multi-device
      fence program on the chain) and is waited for before its dispatch
      returns.

    Eager calls, also single-device programs, wait for the pending multi-device
    programs (after_pending_programs) and complete before they return.  Until
    either kind is lowered, multi-device programs with runtime tokens run
    unfenced (the pool too small for the chain): eager calls wait for them,
    and the first jitted single-device program waits for them when it is
    lowered.

    `active` is read when a program is lowered (a compiled program keeps the way
    it was lowered) and when a multi-device program is dispatched.
    """

    def __init__(self, effect_type):
        self.effect_type = effect_type
        self.active = False
        self.installed = False
        self._in_module = dispatch_hooks.InModuleToken(effect_type)
        self._fence = None
        # Which kind of program has its token in the module (see the class doc):
        # a jitted (not eager) single-device program with a collective, or a
        # multi-device one.  At most one of them is set.
        self._single_device_programs = False
        self._multi_device_programs = False
        self._unfenced = None  # the last multi-device runtime token dispatched without fences
        self._chain_fence_input = None

    def _applies(self, closed_jaxpr, num_devices, platforms):
        return (self.active and tuple(platforms) == ("cpu",)
                and any(isinstance(e, self.effect_type) for e in closed_jaxpr.effects))

    def _rewrite(self, closed_jaxpr, num_devices, platforms):
        if not self._applies(closed_jaxpr, num_devices, platforms):
            return None
        # A program over several processes' devices (a global mesh after
        # jax.distributed) runs on this process's devices alone: with one local
        # device, its executions here queue on that device like any other.
        if num_devices == 1 or jax.local_device_count() == 1:
            if lowering_eagerly.active:
                return self._in_module.form(closed_jaxpr)  # it waits and completes (above)
            if self._multi_device_programs:
                return None  # runtime tokens: fenced on the chain, and waited for
            if not self._single_device_programs:
                # It may be queued on a device while a multi-device program runs
                # there: fence multi-device programs from now on, and let the
                # unfenced ones finish before it can run.
                self._single_device_programs = True
                self.wait_for_unfenced()
            return self._in_module.form(closed_jaxpr)
        if self._single_device_programs or not chain_safe():
            return None  # runtime tokens, fenced once single-device programs exist
        self._multi_device_programs = True
        return self._in_module.form(closed_jaxpr)

    def in_module_multi_device(self):
        """Whether multi-device programs carry their token in the module (see above)."""
        return self._multi_device_programs

    def install(self):
        """Hook JAX's lowering and runtime tokens; False (nothing changed) where JAX's
        internals are not as expected."""
        if self.installed:
            return True
        if not (dispatch_hooks.InModuleToken.available()
                and dispatch_hooks.runtime_token_hooks_available()
                and dispatch_hooks.outside_meshes_available()):
            return False
        if not dispatch_hooks.hook_program_lowering(self._rewrite):
            return False
        dispatch_hooks.hook_runtime_tokens(self._token_input, self._after_token_result,
                                           self._before_barrier)
        self.installed = True
        return True

    def _mine(self, eff):
        return self.active and isinstance(eff, self.effect_type)

    def _token_input(self, eff, devices, token):
        if self._multi_device_programs and isinstance(eff, self.effect_type) \
                and len(devices) == 1 and devices[0].platform == "cpu":
            self.wait_for_multi_device_programs()
        elif self._mine(eff) and len(devices) > 1 and self._single_device_programs:
            return self.fence_multi_device_token(token)
        return token

    def _after_token_result(self, eff, token):
        if self._multi_device_programs and isinstance(eff, self.effect_type):
            array = dispatch_hooks.token_array(token)
            if array is not None and self._cpu_devices_of(array) == 1:
                # Later multi-device programs would not wait for it: done first.
                token.block_until_ready()
            return
        if not self._mine(eff):
            return
        if self._single_device_programs:
            self.fence_after_multi_device_token(token)
            return
        array = dispatch_hooks.token_array(token)
        if array is not None and self._cpu_devices_of(array) > 1:
            self._unfenced = token

    def wait_for_multi_device_programs(self):
        """Wait until every multi-device program dispatched so far has run: a fence
        program over this process's CPU devices joins XLA's chain of multi-device
        executions behind them."""
        if self._chain_fence_input is None:
            devices = jax.local_devices(backend="cpu")  # several: a multi-device program ran
            with dispatch_hooks.outside_meshes():
                self._chain_fence_input = jax.device_put(
                    np.zeros(len(devices), bool),
                    jax.sharding.NamedSharding(jax.sharding.Mesh(devices, "x"),
                                               jax.sharding.PartitionSpec("x")))
        self._fences([self._chain_fence_input])[0].block_until_ready()

    def wait_for_unfenced(self):
        """Wait for the last multi-device program dispatched without fences (and so for
        every earlier one: each waited for its token)."""
        token, self._unfenced = self._unfenced, None
        if token is not None:
            token.block_until_ready()

    def _before_barrier(self):
        # jax.effects_barrier(): programs without runtime tokens are done too.
        if self.active or self._multi_device_programs:
            self.wait_for_cpu_devices()

    def _fences(self, shards):
        """For each shard, a single-device execution on its device that reads it: it
        runs after the device's earlier executions and after the shard is ready,
        and later single-device executions there wait for it."""
        if self._fence is None:
            self._fence = jax.jit(lambda t: t | t)
        # A multi-device program may be dispatched inside shard_map's mesh, which
        # jit would check the fence's one device against; and effects_barrier()
        # may be called while a function is traced (a rejected call compares
        # notes first), where the fence must still run, not be traced.
        with dispatch_hooks.outside_meshes():
            return [self._fence(shard) for shard in shards]

    @staticmethod
    def _cpu_devices_of(array):
        """How many CPU devices a token's array spans; 0 where any is not a CPU (GPU
        programs keep JAX's tokens alone)."""
        devices = array.sharding.device_set
        return len(devices) if all(d.platform == "cpu" for d in devices) else 0

    def fence_multi_device_token(self, token):
        """The token input of a multi-device program, ready only once every single-device
        program enqueued before it on its devices has run."""
        array = dispatch_hooks.token_array(token)
        if array is None or self._cpu_devices_of(array) < 2:
            return token
        return dispatch_hooks.token_from_shards(
            token, self._fences([s.data for s in array.addressable_shards]))

    def fence_after_multi_device_token(self, token):
        """After a multi-device program: on each of its devices, an execution that waits
        for its token, so that later single-device programs wait for it too."""
        array = dispatch_hooks.token_array(token)
        if array is None or self._cpu_devices_of(array) < 2:
            return
        self._fences([s.data for s in array.addressable_shards])

    def wait_for_cpu_devices(self):
        """Wait until every program enqueued so far on this process's CPU devices has run."""
        try:
            devices = jax.local_devices(backend="cpu")
        except RuntimeError:  # no CPU backend
            return
        if self._multi_device_programs:
            self.wait_for_multi_device_programs()
        with jax.ensure_compile_time_eval():  # also when called while tracing
            fences = self._fences([jax.device_put(np.zeros(0, bool), device)
                                   for device in devices])
        for fence in fences:
            fence.block_until_ready()

    def lowers_in_module(self, closed_jaxpr, num_devices=1, platforms=("cpu",)):
        """For tests: whether a program would be lowered with its token inside."""
        return self._applies(closed_jaxpr, num_devices, platforms)


# A program with runtime tokens (every one in "tokens" mode, every one over
# several devices) dispatches on JAX's Python path, which threads the effect's
# runtime token from program to program; this skips JAX's copy of that token,
# which waits for the last program, where the token is already on the
# program's devices.  Programs over several devices: at most this many in
# flight (XLA's CPU client holds 32 executions per device; fences add two per
# device and program in "device-order" mode).
MAX_MULTI_DEVICE_AHEAD = 8
RUNTIME_TOKEN_FAST_PATH = False  # whether install_runtime_token_fast_path could


def install_runtime_token_fast_path():
    """An install step (install.py)."""
    global RUNTIME_TOKEN_FAST_PATH
    RUNTIME_TOKEN_FAST_PATH = _compat.install_runtime_token_fast_path(MAX_MULTI_DEVICE_AHEAD)
    return "on" if RUNTIME_TOKEN_FAST_PATH else "off (this JAX's runtime tokens differ)"


def complete_serialized_dispatches():
    """An install step (install.py).  Serialized mode (native.SERIALIZED): a
    program's MPI calls are all done when its dispatch returns, so none is in
    flight while Python (and mpi4py) runs.  Eager calls complete before
    returning anyway (dispatch.bind)."""
    if not native.SERIALIZED:
        return "not needed (MPI_THREAD_MULTIPLE)"
    if not _compat.complete_dispatches_with(MPIEffect):
        raise ImportError("mpicoll at MPI_THREAD_SERIALIZED needs to wait for each dispatched "
                          f"program, which this JAX ({jax.__version__}) does not let it do; use "
                          "MPI_THREAD_MULTIPLE (MPI4PY_RC_THREAD_LEVEL=multiple)")
    return "on"


DISPATCH_MODES = ("device-order", "tokens")
_policy = DeviceOrderDispatch(MPIEffect)
DEVICE_ORDER_AVAILABLE = False  # whether install_device_order could install its hooks


def warn_hooks_missing(missing):
    """Say, once at import, what a JAX that changed its internals costs: the
    device-order dispatch is off, and every program with a collective pays JAX's
    runtime tokens (benchmarks/dispatch.py: ~100 us against ~10 us per jitted step
    with one 4 B allreduce, 2 ranks on 2 cores)."""
    import warnings
    warnings.warn(
        f"mpicoll: this jax ({jax.__version__}) changed what mpicoll's device-order "
        f"dispatch hooks into ({'; '.join(missing) or 'its lowering hook'}): programs "
        "with collectives dispatch with JAX's runtime tokens instead (correct, but about "
        "10x slower per jitted step); python -m mpicoll info says the dispatch mode. "
        "docs/versions.md lists the jax releases mpicoll is tested with",
        RuntimeWarning, stacklevel=2)


def install_device_order():
    """An install step (install.py): the device-order hooks where JAX allows them,
    then the dispatch mode of the settings: MPICOLL_DISPATCH, or (default)
    device-order where it is available, else tokens."""
    global DEVICE_ORDER_AVAILABLE
    DEVICE_ORDER_AVAILABLE = not native.SERIALIZED and _policy.install()
    if not native.SERIALIZED and not DEVICE_ORDER_AVAILABLE:
        warn_hooks_missing(dispatch_hooks.missing_hooks())
    wanted = settings.current().dispatch
    if wanted == "default":
        wanted = "device-order" if DEVICE_ORDER_AVAILABLE else "tokens"
    refuse_unavailable(wanted, "MPICOLL_DISPATCH")
    use_mode(wanted)
    return (f"hooks {'installed' if DEVICE_ORDER_AVAILABLE else 'not installed'}; "
            f"mode {current_mode()}")


def refuse_unavailable(mode, who):
    """ValueError where mode is not one of DISPATCH_MODES this process can use."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"{who}: mode must be one of {DISPATCH_MODES}, got {mode!r}")
    if mode == "device-order" and not DEVICE_ORDER_AVAILABLE:
        raise ValueError(
            f"{who}: 'device-order' is not available "
            + ("at MPI_THREAD_SERIALIZED, where each dispatch waits for its program"
               if native.SERIALIZED else
               f"with this JAX ({jax.__version__}), whose internals mpicoll does not "
               "recognize; programs keep JAX's runtime tokens"))


def use_mode(mode):
    """Order the programs traced from now on by mode (mpicoll.set_dispatch)."""
    _policy.active = mode == "device-order"


def current_mode():
    """"device-order" or "tokens", for the programs traced from now on."""
    return "device-order" if _policy.active else "tokens"


def after_pending_programs():
    """Before an eager call: the jitted collectives still pending come earlier in order.

    In device-order mode on a CPU-only process the eager program joins the same
    device queue behind them (and behind the fence of any multi-device
    program), so only a multi-device program dispatched without fences
    (DeviceOrderDispatch) is waited for; GPU programs and the tokens mode order
    by runtime tokens, so wait for them (effects_barrier).
    """
    if not (_policy.active and _cpu_only_process()):
        jax.effects_barrier()
    elif _policy.in_module_multi_device():
        _policy.wait_for_multi_device_programs()
    else:
        _policy.wait_for_unfenced()


@functools.lru_cache(maxsize=None)
def _cpu_only_process():
    return jax.default_backend() == "cpu"  # no accelerator: every array is on a CPU device


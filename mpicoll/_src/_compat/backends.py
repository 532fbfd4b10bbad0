"""JAX's CPU backend factory: gloo's TCP collectives listening on one address.

With jax.distributed up and jax_cpu_collectives_implementation "gloo" (JAX's
default), JAX's CPU backend makes gloo's collectives with no address, and gloo
listens on the address the host's name resolves to: on a cluster node, its
network address, open to every user of the network, for a job whose ranks are
all on that node.  mpicoll.distributed.initialize has it listen on loopback
there (docs/security.md) by giving the backend factory gloo's collectives made
with that address, once, before the backends start.

Needs: xla_bridge._backend_factories["cpu"], a BackendRegistration (a dataclass)
whose factory is xla_bridge.make_cpu_client, taking `collectives`; and
_jax.make_gloo_tcp_collectives(distributed_client, hostname=...).  A JAX without
them, or a factory another library replaced, raises RuntimeError naming what is
missing: the caller warns, and gloo listens where JAX puts it.
"""

import dataclasses
import inspect

_original = None  # JAX's own registration of the CPU backend, while ours replaces it


def bind_gloo_listeners(hostname):
    """Have JAX's CPU backend, when it starts, make gloo's TCP collectives listen on
    `hostname` alone; returns what was done.  RuntimeError where this JAX lacks a piece."""
    global _original
    from jax._src import config, distributed, xla_bridge
    from jax._src.lib import _jax

    registration = getattr(xla_bridge, "_backend_factories", {}).get("cpu")
    if registration is None or not dataclasses.is_dataclass(registration):
        raise RuntimeError("JAX has no CPU backend registration (xla_bridge._backend_factories)")
    if _original is not None:
        return "already bound"
    if registration.factory is not getattr(xla_bridge, "make_cpu_client", None):
        raise RuntimeError("JAX's CPU backend factory is not xla_bridge.make_cpu_client "
                           "(another library replaced it)")
    if "collectives" not in inspect.signature(xla_bridge.make_cpu_client).parameters:
        raise RuntimeError("xla_bridge.make_cpu_client takes no collectives")
    make_gloo = getattr(_jax, "make_gloo_tcp_collectives", None)
    if make_gloo is None or "hostname" not in (make_gloo.__doc__ or ""):
        raise RuntimeError("_jax.make_gloo_tcp_collectives(hostname=) is missing")
    make_cpu_client = registration.factory

    def cpu_client_with_bound_gloo():
        client = distributed.global_state.client
        if config.cpu_collectives_implementation.value != "gloo" or client is None:
            return make_cpu_client()
        return make_cpu_client(collectives=make_gloo(distributed_client=client,
                                                     hostname=hostname))

    _original = registration
    xla_bridge._backend_factories["cpu"] = dataclasses.replace(
        registration, factory=cpu_client_with_bound_gloo)
    return f"gloo's listeners on {hostname}"


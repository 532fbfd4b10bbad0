"""What the multi-rank test programs share: their start, their checks and their end.

The programs run as scripts (`mpiexec -n R python tests/programs/X.py ...`), so this
directory is first on sys.path and they import this module as `_common`.

* fake_cpu_devices(n), before jax is imported: the process gets n CPU devices.
* say(text, rank=): one line on stdout at once, unbuffered (it is there even if the
  process is killed or aborts right after); "rank R: " before it where rank= is given.
* Checker: check(name, got, expected) records a failure where got is not close to
  expected, at the tolerance the program sets once.
* training_model(largest): the soaks' model, linear leaves of 4 B up to `largest`
  bytes beside a small MLP.
* listeners(): the TCP sockets this process listens on, [(address, port)], from
  /proc (no ss needed); listener_problems(before): those opened since `before` (MPI's
  own, taken after MPI_Init) that are beyond loopback in a one-node job, or on every
  interface in any job.
* report_and_exit(failures, what), last: rank 0 prints each rank's failures and a
  verdict line (what the pytest side looks for); the job exits non-zero on any.

Importing it imports neither jax nor mpi4py.MPI (a program may still choose MPI's
thread level, as serialized.py does).
"""

import os
import sys

import numpy as np

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def fake_cpu_devices(count):
    """XLA's CPU client makes `count` devices in this process: call it before jax is
    imported.  The other XLA_FLAGS the process inherited are kept."""
    flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
             if not flag.startswith(DEVICE_COUNT_FLAG + "=")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={count}"])
    return count


def say(text, *, rank=None):
    os.write(1, (f"rank {rank}: {text}\n" if rank is not None else f"{text}\n").encode())


def _as_wide(value):
    """float64 (complex128 for complex values): bool, integer and bfloat16 arrays compare."""
    value = np.asarray(value)
    return value.astype(np.complex128 if np.iscomplexobj(value) else np.float64)


class Checker:
    """check = Checker(failures, rtol=..., atol=...); check(name, got, expected) appends
    "name: numpy's message" to failures where got is not close to expected (compared
    in float64); check(name, got, expected, rtol) loosens one check."""

    def __init__(self, failures, *, rtol, atol):
        self.failures, self.rtol, self.atol = failures, rtol, atol

    def __call__(self, name, got, expected, rtol=None):
        try:
            np.testing.assert_allclose(_as_wide(got), _as_wide(expected),
                                       rtol=self.rtol if rtol is None else rtol, atol=self.atol)
        except AssertionError as error:
            self.failures.append(f"{name}: {str(error)[:600]}")


def training_model(largest):
    """A training step's model for the soaks: (shapes, base, params).  Linear leaves
    (shapes: name -> shape) from 4 B up to `largest` bytes, whose gradient is exactly
    their data (base: integer-valued floats, so sums are exact), and a small MLP
    (w1, b1, w2); params: every leaf's initial value (zeros, the MLP's random)."""
    shapes = {"scalar": (), "vector": (256,), "matrix": (64, 64), "square": (512, 512)}
    side = 1024
    while side * side * 4 <= largest:
        shapes[f"big{side}"] = (side, side)
        side *= 2
    rng = np.random.default_rng(7)
    base = {name: rng.integers(0, 4, shape).astype(np.float32) for name, shape in shapes.items()}
    mlp = {"w1": rng.normal(size=(16, 32)).astype(np.float32) * 0.3,
           "b1": np.zeros(32, np.float32), "w2": rng.normal(size=(32, 1)).astype(np.float32) * 0.3}
    params = {**{name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, **mlp}
    return shapes, base, params


def _socket_inodes(pid="self"):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_address):
    """/proc/net/tcp{,6}'s local address (little-endian words) as text."""
    import ipaddress
    import struct

    if len(hex_address) == 8:
        return str(ipaddress.IPv4Address(struct.pack("<I", int(hex_address, 16))))
    words = [struct.pack("<I", int(hex_address[i:i + 8], 16)) for i in range(0, 32, 8)]
    return str(ipaddress.IPv6Address(b"".join(words)))


def listeners(pid="self"):
    """[(address, port)] of the TCP sockets process `pid` listens on (sorted)."""
    mine, found = _socket_inodes(pid), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in mine:  # LISTEN
                address, port = fields[1].split(":")
                found.append((_address(address), int(port, 16)))
    return sorted(found)


def is_loopback(address):
    """Whether a listener's address reaches this machine only (127/8, ::1, ::ffff:127/104)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def listener_problems(before):
    """What is wrong with the listeners this process opened since `before`: in a job
    whose ranks are all on one node, any beyond loopback; in any job, one on every
    interface (docs/security.md).  [] where nothing is."""
    import mpicoll.topology

    one_node = mpicoll.topology.world().node_count == 1
    problems = []
    for address, port in sorted(set(listeners()) - set(before)):
        if one_node and not is_loopback(address):
            problems.append(f"listener {address}:{port}: beyond loopback in a one-node job")
        elif address in ("0.0.0.0", "::"):
            problems.append(f"listener {address}:{port}: on every interface")
    return problems


def report_and_exit(failures, what, verdict="ALL OK"):
    """failures: this rank's list of messages; what: the job's shape, e.g. '(2 ranks x 2 devices)';
    verdict: the line's first words where every rank passed."""
    from mpi4py import MPI

    all_failures = MPI.COMM_WORLD.allgather(failures)
    if MPI.COMM_WORLD.Get_rank() == 0:
        for rank, rank_failures in enumerate(all_failures):
            for failure in rank_failures:
                print(f"rank {rank}: FAIL {failure}", flush=True)
        total = sum(map(len, all_failures))
        print(verdict if total == 0 else f"{total} FAILURES", what, flush=True)
    sys.exit(1 if any(all_failures) else 0)

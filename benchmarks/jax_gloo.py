"""JAX's own multi-process runtime (jax.distributed + gloo) as a benchmark baseline.

Shared by benchmarks/global_allreduce.py and benchmarks/bench.py.

jax.distributed.initialize changes a process for good, so this baseline runs in
fresh child processes: each rank of the mpiexec run starts one worker (the same
script with --gloo-worker), rank 0 picking a free coordinator port and
broadcasting it over MPI.  The workers form a JAX job of their own on
127.0.0.1 with jax_cpu_collectives_implementation='gloo'.  Each prints one line
"GLOO_RESULT <json>"; rank 0 collects them all.  While its worker runs, the MPI
rank sleeps in subprocess.run (poll()), so it takes no CPU from the worker.

    parent, under mpiexec:     reports, error = run_workers(comm, __file__, args, ...)
    worker (--gloo-worker):    jax = initialize(args); ...; emit(payload); shutdown()
"""

import argparse
import json
import os
import socket
import subprocess
import sys

RESULT_TAG = "GLOO_RESULT "
# What mpiexec put in a rank's environment: none of it may reach a worker, which
# is not an MPI process (a stray PMI_* would make an MPI library think it is one).
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPI4PY_", "OMPI_COMM_WORLD_")


def add_worker_arguments(parser):
    """The hidden command-line arguments a worker is started with."""
    parser.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--local-devices", type=int, help=argparse.SUPPRESS)


def initialize(args):
    """In a worker: join the JAX job with gloo collectives; returns the jax module.

    Must come before any JAX computation (no backend yet).  On CPU the device
    count comes from XLA_FLAGS (inherited); local_device_ids names the same devices.
    """
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.num_processes, process_id=args.process_id,
                               local_device_ids=list(range(args.local_devices)))
    assert jax.local_device_count() == args.local_devices, (jax.local_device_count(),
                                                            args.local_devices)
    return jax


def emit(payload):
    """In a worker: hand `payload` (JSON-serializable) to the parent rank."""
    print(RESULT_TAG + json.dumps(payload), flush=True)


def shutdown():
    import jax
    jax.distributed.shutdown()


def slowest_times(entries):
    """Per repeat, the slowest worker's time: entries are the workers' lists of times."""
    return [max(ts) for ts in zip(*entries)]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_environment(local_devices=None):
    """This rank's environment minus the launcher's variables; optionally the device count."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}
    if local_devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        if local_devices != 1:
            flags.append(f"--xla_force_host_platform_device_count={local_devices}")
        if flags:
            env["XLA_FLAGS"] = " ".join(flags)
        else:
            env.pop("XLA_FLAGS", None)
    return env


def run_workers(comm, script, worker_args, local_devices, timeout=1800, set_device_count=False,
                quiet=False):
    """Every rank starts `python script --gloo-worker ... worker_args` and waits for it.

    Returns (reports, error) on rank 0: the workers' payloads in process order and
    None, or None and the first failure's description (exit status and the end of
    its output).  Other ranks get (None, None).  With set_device_count, the
    workers' XLA_FLAGS ask for exactly `local_devices` CPU devices.  Unless
    quiet, a failing worker's whole output also goes to its rank's stderr.
    """
    rank = comm.Get_rank()
    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    env = worker_environment(local_devices if set_device_count else None)
    command = [sys.executable, os.path.abspath(script), "--gloo-worker", "--port", str(port),
               "--process-id", str(rank), "--num-processes", str(comm.Get_size()),
               "--local-devices", str(local_devices), *map(str, worker_args)]
    comm.Barrier()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as error:  # run() has killed the worker
        returncode = f"timeout after {timeout} s"
        stdout = error.stdout.decode() if isinstance(error.stdout, bytes) else error.stdout or ""
        stderr = error.stderr.decode() if isinstance(error.stderr, bytes) else error.stderr or ""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_TAG)]
    report = json.loads(lines[-1][len(RESULT_TAG):]) if returncode == 0 and lines else None
    error = None
    if report is None:
        tail = "\n".join((stdout + "\n" + stderr).strip().splitlines()[-15:])
        error = f"gloo worker of rank {rank} failed (exit {returncode}):\n{tail}"
        if not quiet:
            sys.stderr.write(f"[rank {rank}] gloo worker failed (exit {returncode}):"
                             f"\n{stdout}\n{stderr}\n")
    gathered = comm.gather((report, error), root=0)
    if rank != 0:
        return None, None
    errors = [e for _, e in gathered if e]
    if errors:
        return None, errors[0]
    return [r for r, _ in gathered], None

"""One rank whose files another user of the node tries to plant, swap and read
(tests/test_shared_node.py drives it between its steps):

    python shared_node.py            (a singleton; TMPDIR is the shared folder)

Prints "ready PID FLIGHT_DIR PRIVATE_ROOT", then for each line on stdin:
  dump         the flight recorder's dump now (the SIGUSR1 path): "dumped True|False"
  trace DIR    a trace of three allreduces to DIR: "traced PATH" or "refused WHY"
  quit
"""

import sys
import time

import jax
import jax.numpy as jnp

import mpicoll
from mpicoll._src.runtime.native import extension

step = jax.jit(mpicoll.allreduce)
step(jnp.ones(4)).block_until_ready()
print("ready", __import__("os").getpid(), extension.flight_dir(), extension.private_root(),
      flush=True)
last_dump = 0.0
for line in sys.stdin:
    command, _, argument = line.strip().partition(" ")
    if command == "dump":
        # One dump a second at most (flight.h): the test's are spaced to be written.
        time.sleep(max(0.0, last_dump + 1.1 - time.monotonic()))
        last_dump = time.monotonic()
        print("dumped", extension.dump_flight("a test"), flush=True)
    elif command == "trace":
        try:
            with mpicoll.trace(argument):
                for _ in range(3):
                    step(jnp.ones(4)).block_until_ready()
            print("traced", f"{argument}/rank0.json", flush=True)
        except (ValueError, RuntimeError) as error:  # refused early, or at the write
            print("refused", str(error).replace("\n", " "), flush=True)
    elif command == "quit":
        break

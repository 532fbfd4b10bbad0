"""Reads this process's Python stacks as a stall report does, without the GIL
(extension.python_stacks), from two threads over and over for SECONDS (argv[1]),
while the main thread's frames churn: a deep recursion makes and frees
data-stack chunks, and short threads come and go (each frees its thread state).
Before the reads were guarded (watch/python_stacks.h, ReadGuarded) this crashed
the process within 2 s.  Prints how the reads went:
  reads R main M unreadable U rounds N
"""

import sys
import threading
import time

import mpicoll  # noqa: F401  (sets up what the reads need)
from mpicoll._src.runtime.native import extension

SECONDS = float(sys.argv[1])
sys.setrecursionlimit(5000)
stop = threading.Event()
said = {"reads": 0, "main": 0, "unreadable": 0}
counting = threading.Lock()


def reader():
    while not stop.is_set():
        text = extension.python_stacks()
        with counting:
            said["reads"] += 1
            said["main"] += text.startswith("    Python, main thread")
            said["unreadable"] += "cannot be read" in text


def deep(n):
    return 0 if n == 0 else 1 + deep(n - 1)


readers = [threading.Thread(target=reader) for _ in range(2)]
for thread in readers:
    thread.start()
rounds = 0
end = time.monotonic() + SECONDS
while time.monotonic() < end:
    deep(900)
    short = threading.Thread(target=deep, args=(300,))
    short.start()
    short.join()
    rounds += 1
stop.set()
for thread in readers:
    thread.join()
print(f"reads {said['reads']} main {said['main']} unreadable {said['unreadable']} rounds {rounds}",
      flush=True)

"""The start-up heap is frozen out of the collector; garbage made afterwards is still
collected; at exit it is unfrozen. In a child process: a test process must not freeze."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, weakref
from loraserve.server.startup_heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]
frozen = freeze_startup_heap()
assert frozen >= 1000 and gc.get_freeze_count() == frozen, frozen
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made while serving
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None, "a cycle made after the freeze was not collected"
import atexit
atexit._run_exitfuncs()  # what exit runs: the heap unfrozen, for the last collection
assert gc.get_freeze_count() == 0
print("ok")
"""


def test_freeze_keeps_startup_objects_and_still_collects_new_garbage():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr

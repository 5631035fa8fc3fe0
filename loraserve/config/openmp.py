"""OpenMP's wait policy for a process whose engine steps run on a thread of their own.

Every thread that starts a parallel region gets its own team of OpenMP workers: in a server
the main thread has one (the model is built there) and the engine thread another. With more
OpenMP threads than CPUs, GNU OpenMP (the runtime torch and our C kernels use) cuts how long
an idle worker spins before it sleeps to 100 spins, so each of a step's few hundred parallel
regions starts by waking sleeping workers, and a batch-1 decode step on the engine thread is
far slower than the same step on the main thread (benchmarks/vs_llamacpp.py measures the
server; docs/benchmarks.md has the figures). OMP_WAIT_POLICY=ACTIVE raises the cut spin
count to 1,000 (enough to bridge the gaps between a step's regions), and GOMP_SPINCOUNT
bounds the spin of an idle worker that is not cut to its default (300,000 spins), so an idle
server does not keep its cores busy.

Both are read once, when the runtime loads with torch: set them before torch is imported.
Where the user set either, neither is set.

Better still is one team: the model is built on a thread that then ends
(`in_passing_thread`), so its team goes with it, and the engine thread's team is the only
one; its workers then spin as long as on a main thread."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

SERVING_OPENMP_ENV = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000"}


def prefer_spinning_workers() -> bool:
    """Set the serving defaults where unset; False if torch is already loaded (too late)."""
    if "torch" in sys.modules:
        return False
    # either one set by the user: theirs alone (GOMP_SPINCOUNT outranks the wait policy in
    # GNU OpenMP, so ours would undo their OMP_WAIT_POLICY=PASSIVE)
    if not any(name in os.environ for name in SERVING_OPENMP_ENV):
        os.environ.update(SERVING_OPENMP_ENV)
    return True


def in_passing_thread(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on a thread that ends when it returns: the OpenMP team its torch work made
    ends with it. Its exception, if any, is raised here."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the caller, whatever it is
            out["error"] = e

    t = threading.Thread(target=run, name="model-load", daemon=True)  # Ctrl-C still exits
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]

"""The engine thread's OpenMP workers yield to the threads that answer clients.

A serving process has two CPUs' worth of work on a small host: the engine thread with its
OpenMP team (which spins between a step's parallel regions: config/openmp.py), and the event
loop and tokenizer threads that read requests and write answers. With the team's workers at
the same priority as everyone else, a spinning worker holds a core that a new request's
handler needs, and the new client waits for its first token behind it. At a higher nice
value the kernel scheduler runs the handler first when both want a core; when nothing else
wants one, a worker runs as fast as before.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("openmp_team.c")
WORKER_NICE = 10


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.openmp_workers_nice.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.openmp_worker_nice.argtypes = [ctypes.c_int, ctypes.c_int]
    return lib


def _lib() -> ctypes.CDLL | None:
    return load_library_once(_SOURCE, [], "the OpenMP team priority", _configure)


def lower_worker_priority(nice: int = WORKER_NICE) -> bool:
    """Give the calling thread's OpenMP workers (torch's team; ours is the same) `nice`.
    Call it on the thread that runs the steps; False where it could not be done."""
    lib, n = _lib(), torch.get_num_threads()
    if lib is None or n < 2:
        return False
    failed = lib.openmp_workers_nice(n, nice)
    if failed:
        log.warning("%d OpenMP workers kept their priority", failed)
    return failed == 0


def worker_nice(index: int = 1) -> int | None:
    """The nice value of the calling thread's OpenMP worker `index` (tests)."""
    lib = _lib()
    return None if lib is None else lib.openmp_worker_nice(torch.get_num_threads(), index)

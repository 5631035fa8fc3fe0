"""Which placement the host's cores are in while a measurement runs, for memory_floor.py.

The 2-core Zen 4 host these benchmarks run on moves its two cores between two placements,
each lasting seconds to minutes: both on one die of the package (an OpenMP barrier's round
trip ~0.25 µs, one way to memory shared: a 1 GiB copy ~30-34 GB/s), or on two dies (~0.5 µs,
a way to memory each: ~43-50 GB/s). A decode measured in one placement against a copy rate
measured in the other says nothing, and a measurement of a few seconds can span both. So a
measurement is taken in a short slice with the barrier's round trip timed just before and just
after it (`tagged`): the slice counts for a placement only where both say the same one.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from loraserve.ops.cbuild import load_library_once

PROBE = Path(__file__).parent / "kernels" / "barrier_probe.c"
ONE_DIE_NS, TWO_DIES_NS = 350.0, 420.0  # at most / at least, for the two placements


def _configure(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.barrier_ns.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.barrier_ns.restype = ctypes.c_double
    return lib


def barrier_ns() -> float:
    """The round trip of a barrier of torch's thread count now (the best of three short
    loops: a busy moment on the host only slows a loop down)."""
    lib = load_library_once(PROBE, [], "the barrier probe", _configure)
    if lib is None:
        raise RuntimeError("the barrier probe needs a C compiler with OpenMP")
    return min(lib.barrier_ns(2000, torch.get_num_threads()) for _ in range(3))


def placement(before_ns: float, after_ns: float) -> str | None:
    """"one_die", "two_dies", or None where the two probes disagree (it moved, or the host
    was too busy to tell)."""
    if max(before_ns, after_ns) <= ONE_DIE_NS:
        return "one_die"
    if min(before_ns, after_ns) >= TWO_DIES_NS:
        return "two_dies"
    return None


def tagged(measure: Callable[[], float]) -> tuple[str | None, float]:
    """measure() with the placement it ran in."""
    before = barrier_ns()
    value = measure()
    return placement(before, barrier_ns()), value

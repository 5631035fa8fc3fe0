"""Giving freed native memory back to the OS (glibc), so churn does not ratchet up RSS.

Adapter weights are read on worker threads (the disk loader, the server's executor) and freed
on the engine thread once packed or evicted. glibc serves each thread from its own arena and
returns a freed chunk to the arena it came from; pages freed in the middle of an arena's heap
stay resident until something trims them, and the small tensors of an adapter never reach
the mmap threshold. So resident memory climbed with every round of load and churn while
each kind of work alone levelled off (benchmarks/soak.py tracks it;
tests/kernels/test_native_memory.py checks the trim).
`malloc_trim(0)` walks every arena and releases whole free pages anywhere in it; the engine
calls `MemoryTrimmer.maybe_trim()` once per step, and it trims at most every `interval_s`.
Elsewhere than glibc (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger("loraserve.memory")

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _malloc_trim = _libc.malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):
    _malloc_trim = None


def release_free_memory() -> bool:
    """Return free heap pages of every malloc arena to the OS. True if anything was."""
    return bool(_malloc_trim(0)) if _malloc_trim is not None else False


class MemoryTrimmer:
    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self._last = time.monotonic()
        self.trims = 0
        self.seconds = 0.0  # spent trimming, in all

    def maybe_trim(self) -> None:
        now = time.monotonic()
        if _malloc_trim is None or now - self._last < self.interval_s:
            return
        release_free_memory()
        self._last = time.monotonic()
        self.trims += 1
        self.seconds += self._last - now
        log.debug("malloc_trim took %.1f ms", 1e3 * (self._last - now))

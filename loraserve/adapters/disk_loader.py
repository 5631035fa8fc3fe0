"""Disk -> host loads on worker threads, handed back to the engine thread when done.

Reading and validating an adapter (file I/O, safetensors parsing, NaN checks) never runs on
the engine thread, so a slow disk cannot stall decoding. Results are collected by the store
between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import NamedTuple

from loraserve.adapters.daemon_pool import DaemonPool
from loraserve.adapters.format import LoraAdapterWeights


class LoadResult(NamedTuple):
    uid: int
    weights: LoraAdapterWeights | None  # None when the read failed
    seconds: float
    error: str | None  # the reader's message, verbatim, for the waiting requests


class DiskLoader:
    def __init__(self, read: Callable[[str], LoraAdapterWeights], workers: int = 2):
        self._read = read
        self.workers = workers
        self._pool = DaemonPool(workers, "lora-load")  # never holds the process at exit
        self._pending: dict[int, Future] = {}  # uid -> future of (weights, seconds)
        self.delay_s = 0.0  # injected latency, for tests and benchmarks of slow storage

    def _timed_read(self, path: str) -> tuple[LoraAdapterWeights, float]:
        t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)
        w = self._read(path)
        return w, time.perf_counter() - t0

    def start(self, uid: int, path: str) -> None:
        if uid not in self._pending:
            self._pending[uid] = self._pool.submit(self._timed_read, path)

    def is_loading(self, uid: int) -> bool:
        return uid in self._pending

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def cancel(self, uid: int) -> None:
        fut = self._pending.pop(uid, None)
        if fut is not None:
            fut.cancel()

    def check(self, uids: set[int]) -> list[str]:
        """Every read in flight is for one of `uids` (a live adapter) and can still finish."""
        problems = [f"a disk read for adapter uid {u} nobody waits for"
                    for u in self._pending if u not in uids]
        problems += [f"the disk read for adapter uid {u} was cancelled but is still pending"
                     for u, fut in self._pending.items() if fut.cancelled()]
        return problems

    def collect(self) -> list[LoadResult]:
        """Loads that finished since the last call."""
        done = []
        for uid, fut in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[uid]
            try:
                weights, secs = fut.result()
                done.append(LoadResult(uid, weights, secs, None))
            except Exception as e:  # the message goes to the waiting requests, verbatim
                done.append(LoadResult(uid, None, 0.0, str(e) or type(e).__name__))
        return done

    def wait_any(self, timeout: float) -> None:
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when="FIRST_COMPLETED")

    def shutdown(self) -> None:
        self._pool.shutdown()

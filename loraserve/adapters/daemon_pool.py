"""A thread pool whose workers never keep the process alive.

`concurrent.futures.ThreadPoolExecutor` joins its workers at interpreter exit, so one
adapter read still running (a slow disk, a hostile file) would hold a shutting-down server
past SIGTERM. Adapter reads run here instead: daemon workers, and `shutdown` drops the queue
and returns at once; a read in progress ends with the process (reads change no shared state
until their result is collected).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class DaemonPool:
    def __init__(self, workers: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        if self._closed:
            fut.set_exception(RuntimeError("the adapter read pool is shut down"))
        else:
            self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (handed to whoever waits on it)
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel queued reads and let the workers go; never waits for a read in progress."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)

"""Adapter reads run on daemon workers: one stuck read cannot hold the process at exit."""

from __future__ import annotations

import subprocess
import sys
import time

from loraserve.adapters.daemon_pool import DaemonPool


def test_results_errors_and_cancel():
    pool = DaemonPool(1, "t")
    assert pool.submit(lambda x: x + 1, 1).result(5) == 2
    fut = pool.submit(lambda: 1 / 0)
    assert isinstance(fut.exception(5), ZeroDivisionError)
    blocker = pool.submit(time.sleep, 0.5)
    while not blocker.running():
        time.sleep(0.01)
    queued = pool.submit(lambda: "never")
    pool.shutdown()
    assert queued.cancelled() and blocker.result(5) is None
    assert isinstance(pool.submit(lambda: 1).exception(1), RuntimeError)


def test_a_stuck_read_does_not_keep_the_process_alive():
    code = ("import threading\n"
            "from loraserve.adapters.daemon_pool import DaemonPool\n"
            "p = DaemonPool(1, 'x')\n"
            "p.submit(threading.Event().wait)\n"  # blocks forever, like a hung disk
            "print('exiting')\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stderr
    assert time.monotonic() - t0 < 20

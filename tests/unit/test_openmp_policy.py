"""The serving process's OpenMP wait policy: set before torch loads, the user's values win,
and once torch is loaded nothing is changed (it would be read too late). In child processes:
the environment, and whether torch is loaded, are per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from loraserve.config.openmp import in_passing_thread

CHILD = """
import json, os, sys
if sys.argv[1] == "torch-first":
    import torch  # noqa: F401
from loraserve.config.openmp import prefer_spinning_workers
done = prefer_spinning_workers()
print(json.dumps([done, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")]))
"""


def child(mode: str, **env: str) -> list:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                       timeout=120, env={**base, **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_set_before_torch_loads_and_the_users_values_win():
    assert child("plain") == [True, "ACTIVE", "300000"]
    assert child("plain", OMP_WAIT_POLICY="PASSIVE") == [True, "PASSIVE", None]
    assert child("plain", GOMP_SPINCOUNT="1000") == [True, None, "1000"]


def test_nothing_changes_once_torch_is_loaded():
    assert child("torch-first") == [False, None, None]


def test_the_serve_command_sets_it_before_torch_loads():
    """`loraserve serve` imports nothing of torch before it sets the policy."""
    code = ("import sys; import loraserve.cli, loraserve.server.cli_args; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr


def test_in_passing_thread_returns_raises_and_ends():
    ran_on = []

    def work(a, b):
        ran_on.append(threading.current_thread())
        return a + b

    assert in_passing_thread(work, 2, 3) == 5
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()

    def fail():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        in_passing_thread(fail)


def test_a_threads_openmp_workers_get_a_lower_priority_and_it_keeps_its_own():
    from loraserve.ops.openmp_team import lower_worker_priority, worker_nice

    seen: dict = {}

    def engine_thread():
        torch.set_num_threads(2)  # the suite runs one thread; a team needs two
        seen["before"] = worker_nice()
        seen["done"] = lower_worker_priority(7)
        torch.randn(512, 512) @ torch.randn(512, 512)  # a torch region on the same team
        seen["after"] = worker_nice()
        seen["own"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = torch.get_num_threads()
    try:
        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        assert seen == {"before": 0, "done": True, "after": 7, "own": 0}
        torch.set_num_threads(2)
        assert worker_nice() == 0  # another thread's team is untouched
    finally:
        torch.set_num_threads(before)

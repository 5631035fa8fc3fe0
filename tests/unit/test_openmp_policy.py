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
    assert child("plain", OMP_WAIT_POLICY="PASSIVE") == [True, "PASSIVE", "300000"]


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

"""`loraserve serve --replicas 2` stopping, as a process: SIGTERM to the command alone (docker
stop) drains the app as a single server drains, so a stream in flight ends complete; SIGTERM
to the whole process group (systemd, `kill -- -PGID`) reaches Ray's own processes too, which
leaves nothing to drain, and the command and Ray's processes are still gone promptly.

Each test starts its own local Ray instance in a child process: the other cluster modules'
shared instance is stopped first, so that one instance runs at a time.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess

pytest.importorskip("ray.serve", reason="the cluster extra: pip install loraserve[cluster]")

# an idle app's whole shutdown takes a small part of this (Ray's start takes far longer)
IDLE_EXIT_BOUND_S = 5.0


@pytest.fixture(scope="module", autouse=True)
def no_shared_ray():
    from cluster_utils import stop_ray

    stop_ray()


def wait_serving(c: ServerProcess) -> None:
    """Until the command has logged that it serves (every replica up) and /health is 200."""
    c.wait_ready(timeout=300)
    deadline = time.monotonic() + 300
    while "serving 2 replicas" not in c.log():
        assert c.proc.poll() is None and time.monotonic() < deadline, c.log()
        time.sleep(0.5)


def alive_in_group(c: ServerProcess) -> list[int]:
    """Processes of the command's group that still run (zombies left to a non-reaping init do
    not count)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == c.proc.pid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


@pytest.fixture
def command(tmp_path):
    started: list[ServerProcess] = []

    def start(model_dir: Path, *args: str) -> ServerProcess:
        # `serve --replicas 2` leads its own process group: Ray's processes join it
        started.append(ServerProcess(model_dir, "--replicas", "2", *args, log_dir=tmp_path,
                                     new_session=True))
        wait_serving(started[-1])
        return started[-1]

    yield start
    for c in started:
        try:
            os.killpg(c.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        c.stop()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_group_sigterm_on_an_idle_app_exits_promptly(command, tiny_model_dir):
    c = command(tiny_model_dir)
    t0 = time.monotonic()
    os.killpg(c.proc.pid, signal.SIGTERM)
    assert c.proc.wait(60) == 0, c.log()
    took = time.monotonic() - t0
    assert took < IDLE_EXIT_BOUND_S, (took, c.log())
    deadline = time.monotonic() + IDLE_EXIT_BOUND_S
    while alive_in_group(c) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive_in_group(c), "Ray's processes outlived the command"
    assert "Traceback" not in c.log()


def test_sigterm_to_the_command_drains_a_stream_in_flight(command, bundled_model_dir):
    # the bundled model decodes slowly enough on a small host for the stream to be in flight
    # when the signal comes; the tiny model could end it first
    c = command(bundled_model_dir, "--shutdown-timeout", "60", "--kv-cache-tokens", "2048")
    model = httpx.get(c.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True,
            "stream": True}
    events: list[str] = []
    first = threading.Event()

    def stream():
        with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    c.proc.send_signal(signal.SIGTERM)
    t.join(90)
    ended = time.monotonic()
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events[-2]
    assert c.proc.wait(60) == 0, c.log()
    assert time.monotonic() - ended < IDLE_EXIT_BOUND_S, c.log()
    assert "Traceback" not in c.log()

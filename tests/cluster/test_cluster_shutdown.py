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
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import REPO, free_port

pytest.importorskip("ray.serve", reason="the cluster extra: pip install loraserve[cluster]")

# an idle app's whole shutdown takes a small part of this (Ray's start takes far longer)
IDLE_EXIT_BOUND_S = 5.0


@pytest.fixture(scope="module", autouse=True)
def no_shared_ray():
    from cluster_utils import stop_ray

    stop_ray()


class ClusterCommand:
    """`python -m loraserve.cli serve --replicas 2 ...` as the leader of its own process group
    (Ray's processes join it, as under a shell or a service manager), its log in a file."""

    def __init__(self, model_dir: Path, log_dir: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"cluster-{self.port}.log"
        cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--replicas", "2",
               "--model", str(model_dir), "--port", str(self.port), "--num-threads", "1",
               "--disable-pace-calibration", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=REPO, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = 300) -> None:
        """Until the command has logged that it serves (every replica up) and /health is 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            if "serving 2 replicas" in self.log():
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"not serving after {timeout}s:\n{self.log()}")

    def alive_in_group(self) -> list[int]:
        """Processes of the command's group that still run (zombies left to a non-reaping
        init do not count)."""
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                alive.append(int(stat.parent.name))
        return alive

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)


@pytest.fixture
def command(tmp_path):
    started = []

    def start(model_dir: Path, *args: str) -> ClusterCommand:
        started.append(ClusterCommand(model_dir, tmp_path, *args))
        started[-1].wait_serving()
        return started[-1]

    yield start
    for c in started:
        c.close()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_group_sigterm_on_an_idle_app_exits_promptly(command, tiny_model_dir):
    c = command(tiny_model_dir)
    t0 = time.monotonic()
    os.killpg(c.proc.pid, signal.SIGTERM)
    assert c.proc.wait(60) == 0, c.log()
    took = time.monotonic() - t0
    assert took < IDLE_EXIT_BOUND_S, (took, c.log())
    deadline = time.monotonic() + IDLE_EXIT_BOUND_S
    while c.alive_in_group() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not c.alive_in_group(), "Ray's processes outlived the command"
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

"""Test helper: run the real `loraserve serve` process and talk to it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m loraserve.cli serve --model MODEL --port P ARGS...`, its log in a file;
    with `new_session`, the leader of its own process group (as under a shell or a service
    manager: what it starts joins the group)."""

    def __init__(self, model_dir: str | Path, *args: str, log_dir: str | Path,
                 api_key: str | None = None, calibrate: bool = False,
                 new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(log_dir) / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", str(model_dir),
               "--port", str(self.port), "--num-threads", "1", *args]
        if not calibrate:  # a second per start on one thread; its own test starts one with it
            cmd.append("--disable-pace-calibration")
        env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO, start_new_session=new_session)

    def __enter__(self) -> ServerProcess:
        """`with ServerProcess(...) as server:` waits until it answers, and stops it after."""
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    # --- HTTP helpers -----------------------------------------------------------------------
    def headers(self, key: str | None = None) -> dict:
        key = key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def get(self, path: str, key: str | None = None, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(key), timeout=30, **kw)

    def post(self, path: str, json=None, key: str | None = None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers=self.headers(key), timeout=60,
                          **kw)

    def openai(self, key: str | None = None):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.api_key or "none",
                             max_retries=0, timeout=60)

    def state(self) -> dict:
        r = self.get("/debug/state")
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Poll /debug/state until no block is used and no adapter is held."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            held = [a for a in s["adapters"] if a["refcount"]]
            if s["kv_blocks_used"] == 0 and not held and not s["running"] and not s["waiting"]:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {s}")
            time.sleep(0.05)

    def wait_busy(self, timeout: float = 10.0, running: int = 1, unless=None) -> dict:
        """Poll /debug/state until at least `running` requests run, or `unless()` is true (the
        requests were done before a poll saw them: a fast host runs a tiny model's 48 tokens
        for 6 requests between two polls)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            if s["running"] >= running and s["kv_blocks_used"] or unless and unless():
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"no request running after {timeout}s: {s}")
            time.sleep(0.02)


def assert_error(r: httpx.Response, status: int | tuple[int, ...], *fragments: str) -> dict:
    """An OpenAI-shaped error with this status whose message contains every fragment."""
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}, err
    for f in fragments:
        assert f in err["message"], (f, err["message"])
    return err


def start_long_stream(url: str, key: str, model: str) -> threading.Thread:
    """A streamed completion of 300 tokens under `key`, read on a thread; returns once its
    first bytes arrived (it counts against the key's limits until it ends)."""
    started = threading.Event()

    def stream():
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as resp:
            for _ in resp.iter_lines():
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), "the stream sent nothing in 60 s"
    return t

"""Graceful shutdown: on SIGTERM / SIGINT the server stops admitting (it keeps listening and
answers new connections with 503 + Retry-After), lets requests in flight finish within
--shutdown-timeout, ends the rest with a well-formed 503 (streams: an error event, then
[DONE]), and exits 0 without a traceback."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from server_utils import ServerProcess


def start(model_dir, tmp_path, timeout_s: str) -> ServerProcess:
    return ServerProcess(model_dir, "--shutdown-timeout", timeout_s,
                         log_dir=tmp_path).wait_ready()


def model_of(server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def stream_lines(server, body) -> list[str]:
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_requests_that_outlive_the_drain_end_well_formed(bundled_model_dir, tmp_path, sig):
    # A 0.1 s drain against 500 tokens of the bundled model (seconds of decoding): the tiny
    # model's decode steps are so short that its requests could end before the signal did
    server = start(bundled_model_dir, tmp_path, "0.1")
    model = model_of(server)
    long = {"model": model, "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}
    got: dict = {}
    threads = [
        threading.Thread(target=lambda: got.update(stream=stream_lines(server, long))),
        threading.Thread(target=lambda: got.update(
            plain=server.post("/v1/completions", {**long, "n": 8}))),
    ]
    threads[0].start()
    server.wait_busy()  # the stream runs; then the plain request joins it
    threads[1].start()
    server.wait_busy(running=2)
    server.proc.send_signal(sig)
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0
    log = server.log()
    server.stop()
    plain = got["plain"]
    assert plain.status_code == 503 and "shut down" in plain.json()["error"]["message"]
    assert plain.headers["retry-after"]
    events = got["stream"]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_unavailable" and "shut down" in error["message"]
    assert "Traceback" not in log and "CancelledError" not in log


def test_short_requests_finish_and_new_ones_get_503_on_new_connections(bundled_model_dir,
                                                                     tmp_path):
    # the bundled model, so the request is still decoding when a poll looks (the tiny model's
    # base-only steps run 300 tokens between two polls) and ends well inside the 20 s drain
    server = start(bundled_model_dir, tmp_path, "20")
    model = model_of(server)
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
    # a request that stays in flight until we let it go: its body never ends
    holder = socket.create_connection(("127.0.0.1", server.port))
    holder.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: 1000\r\n\r\n{")
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=server.post("/v1/completions", body)))
    t.start()
    server.wait_busy()
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=10).status_code == 200:  # new connections
        assert time.monotonic() < deadline, "the drain did not begin"
        time.sleep(0.05)
    for path, method in (("/v1/completions", "POST"), ("/health", "GET"),
                         ("/v1/models", "GET")):
        late = httpx.request(method, server.url + path, timeout=10,  # a new connection each
                             json=body if method == "POST" else None)
        assert late.status_code == 503 and late.headers["retry-after"] == "5", path
        assert late.json()["error"]["code"] == "server_unavailable"
    t.join(60)
    assert got["r"].status_code == 200
    assert len(got["r"].json()["choices"][0]["text"]) > 0
    assert server.proc.poll() is None  # still draining: the held request is in flight
    holder.close()  # its client goes away: nothing is left in flight
    assert server.proc.wait(60) == 0
    server.stop()

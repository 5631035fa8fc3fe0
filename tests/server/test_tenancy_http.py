"""Tenancy over HTTP against the real server: a short request from one client beside another
client's long prompt finishes first, in bounded time (the bundled model); a stream whose
client does not read pauses its request (seat and KV given back), reading resumes it to the
end, and a stream never read is ended after --stalled-stream-timeout (the tiny model)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_utils import ServerProcess


def _wait(cond, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)


def test_short_request_beside_a_long_prompt_finishes_first(bundled_model_dir, tmp_path):
    server = ServerProcess(bundled_model_dir, log_dir=tmp_path).wait_ready()
    try:
        for n in (40, 3):  # steps of two sizes: the prefill budget knows what a step costs
            assert server.post("/v1/completions", {"prompt": "Hello " * n, "max_tokens": 4,
                                                   "ignore_eos": True}).status_code == 200
        long_done: dict = {}

        def long_request():
            r = httpx.post(server.url + "/v1/completions", timeout=900,
                           json={"prompt": list(range(1000, 4000)), "max_tokens": 1})
            long_done.update(status=r.status_code, at=time.monotonic())

        t = threading.Thread(target=long_request)
        t.start()
        _wait(lambda: server.get("/debug/state").json()["running"] >= 1, what="long admitted")
        # another client (its own loopback address): its request is not held behind
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"),
                             timeout=300)
        start = time.monotonic()
        r = other.post(server.url + "/v1/completions",
                       json={"prompt": "The capital of France is", "max_tokens": 8,
                             "ignore_eos": True})
        short_done = time.monotonic()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert short_done - start < 120  # a hang, not a timing: it needs about ten steps
        assert "at" not in long_done, "the short request waited for the long prompt"
        t.join(900)
        assert long_done["status"] == 200 and long_done["at"] > short_done
        assert server.get("/debug/invariants").json()["ok"]
    finally:
        server.stop()


@pytest.fixture
def small_buffers(tiny_model_dir, tmp_path):
    s = ServerProcess(tiny_model_dir, "--send-buffer-bytes", "4096", "--max-unread-outputs",
                      "4", "--stalled-stream-timeout", "3", log_dir=tmp_path)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _open_unread_stream(server: ServerProcess, max_tokens: int) -> socket.socket:
    """A streaming request whose client reads nothing (a tiny receive window)."""
    body = json.dumps({"prompt": "hi", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    sk = socket.socket()
    sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sk.connect(("127.0.0.1", server.port))
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sk


def _read_to_end(sk: socket.socket) -> bytes:
    sk.settimeout(60)
    data = b""
    while b"[DONE]" not in data:
        chunk = sk.recv(65536)
        assert chunk, "the server closed the stream early"
        data += chunk
    return data


def test_unread_stream_pauses_resumes_and_is_ended_after_the_limit(small_buffers):
    server = small_buffers

    def state():
        return server.get("/debug/state").json()

    slow = _open_unread_stream(server, 480)
    # one snapshot: the socket buffers may take one more event after the first pause, whose
    # read resumes the request until the buffers are full for good
    _wait(lambda: (s := state())["paused"] == 1 and s["running"] == s["kv_blocks_used"] == 0,
          what="the unread stream paused, its seat and KV given back")
    # the engine serves others meanwhile
    r = server.post("/v1/completions", {"prompt": "hello", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    data = _read_to_end(slow)  # reading resumes it, to the last token
    slow.close()
    events = [json.loads(line[6:]) for line in data.decode().split("\n")
              if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    never = _open_unread_stream(server, 480)
    _wait(lambda: state()["paused"] == 1, what="the second unread stream paused")
    _wait(lambda: (s := state())["paused"] == s["running"] == s["kv_blocks_used"] == 0,
          timeout=60, what="the stalled stream ended")
    never.close()
    assert server.get("/debug/invariants").json()["ok"]

"""Admin loads of hostile adapter files over HTTP: each is a 4xx naming the bound or the field,
within a bound this test asserts, while /health stays fast and the keep-alive connection stays
open."""

from __future__ import annotations

import json
import shutil
import struct
import threading
import time

import httpx
import pytest
from adapter_factory import edit_config, make_peft_adapter
from server_utils import ServerProcess

ADMIN = "admin-key"
BOUND_S = 5.0


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    good = make_peft_adapter(tiny_model_dir, root / "good", r=4, seed=3)
    s = ServerProcess(tiny_model_dir, "--admin-api-key", ADMIN, "--lora-root", str(root),
                      log_dir=root)
    try:
        yield s.wait_ready(), root, good
    finally:
        s.stop()


class HealthProbe:
    """Polls /health while a load runs; records the slowest answer."""

    def __init__(self, url: str):
        self.url, self.worst, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                assert c.get(self.url + "/health").status_code == 200
                self.worst = max(self.worst, time.monotonic() - t0)
                time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)


def _copy(root, good, name):
    return shutil.copytree(good, root / name)


def _header(path, edit):
    st = path / "adapter_model.safetensors"
    data = st.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(next(v for k, v in header.items() if k != "__metadata__"))
    raw = json.dumps(header).encode()
    st.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _cases(root, good):
    """(name, lora_path, expected status, words the message must contain)."""
    bt = _copy(root, good, "backtrack")
    edit_config(bt, target_modules=".*" * 9 + "Z")
    rank = _copy(root, good, "rank200k")
    edit_config(rank, rank_pattern={f"model.layers.0.self_attn.q_proj{i}": 4
                                    for i in range(200_000)})
    deep = _copy(root, good, "deep")
    text = (deep / "adapter_config.json").read_text()
    (deep / "adapter_config.json").write_text(text[:-1] + ', "x": ' + "[" * 50_000
                                              + "]" * 50_000 + "}")
    cases = [("backtrack", bt, 400, ["targets no module"]),
             ("rank200k", rank, 400, ["size bound"]),
             ("deep", deep, 400, ["nests"]),
             ("longname", root / ("x" * 300), 400, ["too long"]),
             ("longpath", "/".join(["y" * 200] * 25), 400, ["too long"])]
    for i, value in enumerate([7, "0,8", {"a": 1}, []]):
        bad = _copy(root, good, f"offsets{i}")
        _header(bad, lambda e, v=value: e.__setitem__("data_offsets", v))
        cases.append((f"offsets{i}", bad, 400, ["data_offsets"]))
    return cases


def test_hostile_loads_are_4xx_within_bounds_and_health_stays_fast(setup):
    server, root, good = setup
    with HealthProbe(server.url) as probe, httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as c:
        for name, path, status, words in _cases(root, good):
            t0 = time.monotonic()
            r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            took = time.monotonic() - t0
            assert r.status_code == status, (name, r.text)
            assert all(w in r.json()["error"]["message"] for w in words), (name, r.text)
            assert took < BOUND_S, (name, took)
            assert r.headers.get("connection") != "close", name  # keep-alive survives
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "good",
                                                     "lora_path": str(good)}).status_code == 200
    assert probe.worst < 1.0, probe.worst
    names = [m["id"] for m in server.get("/v1/models", key=ADMIN).json()["data"]]
    assert "good" in names and "backtrack" not in names

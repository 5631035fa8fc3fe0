"""Adapter failures over HTTP: a registered adapter whose files broke before its
implicit reload gives the client a 4xx naming the adapter (not the server's directories), in
both the plain and the streaming path, and nobody else notices; adapter names that only look
valid, or that equal the base model's, are refused."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil

import httpx
import pytest
from adapter_factory import make_peft_adapter, truncate_weights
from model_factory import make_tiny_llama
from server_utils import ServerProcess, assert_error

LONG_CONTEXT = 4096  # a request that runs for seconds, then is cut short by its client


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama with a context long enough that a request can outlast a load."""
    return make_tiny_llama(tmp_path_factory.mktemp("long_llama"),
                           max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def setup(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter_errors")
    good = make_peft_adapter(model_dir, root / "good", r=4, seed=3)
    fragile = shutil.copytree(good, root / "fragile")
    s = ServerProcess(model_dir, "--max-loaded-loras", "1", "--allow-runtime-lora-updates",
                      "--lora-paths", f"fragile={fragile}", log_dir=root)
    try:
        yield s.wait_ready(), root, good, fragile
    finally:
        s.stop()


def test_broken_adapter_is_a_4xx_naming_it_and_others_are_served(setup):
    server, root, good, fragile = setup
    model = server.get("/v1/models").json()["data"][0]["id"]
    r = server.post("/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(good)})
    assert r.status_code == 200  # host memory holds one: 'fragile' goes back to disk
    truncate_weights(fragile)
    body = {"model": "fragile", "prompt": [5, 6, 7], "max_tokens": 4}
    others = [{"model": m, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
               "ignore_eos": True} for m in ("good", model)] * 3
    with cf.ThreadPoolExecutor(8) as pool:
        fine = [pool.submit(server.post, "/v1/completions", b) for b in others]
        err = assert_error(server.post("/v1/completions", body), 400, "'fragile'",
                           "failed to load")
        assert str(root) not in err["message"] and err["code"] == "adapter_load_failed"
        for f in fine:
            assert f.result().status_code == 200
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[0])["error"]
    assert "'fragile'" in error["message"] and str(root) not in error["message"]
    assert error["code"] == "adapter_load_failed"
    assert server.state()["engine_errors"] == 0
    server.wait_idle()


def test_lookalike_and_base_model_names_are_refused(setup):
    server, _, good, _ = setup
    model = server.get("/v1/models").json()["data"][0]["id"]
    for name in ("good\n", "..", ".", model):
        r = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(good)})
        assert_error(r, 400, "adapter name")
    ids = [c["id"] for c in server.get("/v1/models").json()["data"]]
    assert len(ids) == len(set(ids))


def test_load_while_host_memory_is_busy_registers_on_disk(setup, model_dir):
    # Not a 503 (retry): under steady traffic an unload + reload would then lose the name for
    # good (benchmarks/soak.py). The validated adapter is registered on disk and read when used;
    # a load that must pin (be resident) is still a 503 with Retry-After
    # (tests/engine/test_faults.py).
    server, root, good, _ = setup
    other = make_peft_adapter(model_dir, root / "other", r=4, seed=9)
    long = {"model": "good", "prompt": [5, 6, 7], "max_tokens": LONG_CONTEXT - 96,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=60) as resp:
        assert resp.status_code == 200
        events = resp.iter_lines()
        assert next(e for e in events if e.startswith("data: "))  # 'good' is in use now
        r = server.post("/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(other)})
        assert r.status_code == 200, r.text
        assert {c["id"]: c["tier"] for c in r.json()["data"]}["other"] == "disk"
        # still running (or paused, its client not reading): it held 'good' all along
        state = server.state()
        assert state["running"] + state["paused"] >= 1
    server.wait_idle()  # the closed stream ended the request
    r = server.post("/v1/completions", {"model": "other", "prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200, r.text

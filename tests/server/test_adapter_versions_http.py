"""Adapter versions over HTTP: load and replace from a path, upload without a shared disk,
`name@N` models, a stream that started on version 1 finishing on it across a replace, a
failed replace keeping the old version, and the answers equal transformers + PEFT."""

from __future__ import annotations

import json

import httpx
import pytest
from adapter_factory import build_peft_model
from lora_reference import hf_greedy
from model_factory import make_tiny_llama
from server_utils import ServerProcess

from loraserve.config import ATTN_MODULES, LORA_MODULES

PROMPT = [5, 77, 301, 12, 9, 44]
N = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions_http")
    model = make_tiny_llama(root / "model", max_position_embeddings=4096)
    peft = []
    for i, spec in enumerate([dict(r=8, target_modules=ATTN_MODULES, seed=41),
                              dict(r=16, target_modules=LORA_MODULES, seed=42),
                              dict(r=4, target_modules=LORA_MODULES, seed=43)]):
        m = build_peft_model(model, lora_alpha=16, init_scale=1.0, **spec).eval()
        m.save_pretrained(root / f"v{i + 1}", safe_serialization=True)
        peft.append(m)
    server = ServerProcess(model, "--allow-runtime-lora-updates", "--max-adapter-versions", "2",
                           log_dir=root)
    try:
        yield server.wait_ready(), root, peft
    finally:
        server.stop()


def greedy_ids(server, model: str, n: int = N) -> tuple[list[int], str]:
    r = server.post("/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "logprobs": 0,
        "ignore_eos": True, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    tokens = body["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens], body["model"]


def upload(server, root, version_dir: str, name="policy", replace=True, weights=None):
    files = {"config": ("adapter_config.json", (root / version_dir / "adapter_config.json")
                        .read_bytes()),
             "weights": ("adapter_model.safetensors", weights or (
                 root / version_dir / "adapter_model.safetensors").read_bytes())}
    return httpx.post(server.url + "/v1/upload_lora_adapter", timeout=60, files=files,
                      data={"lora_name": name, "replace": json.dumps(replace)})


def test_versions_load_replace_upload_and_serve(setup):
    server, root, peft = setup
    r = server.post("/v1/load_lora_adapter", {"lora_name": "policy",
                                              "lora_path": str(root / "v1")})
    assert r.status_code == 200 and r.json()["version"] == 1
    ids, model = greedy_ids(server, "policy")
    assert ids == hf_greedy(peft[0], PROMPT, N) and model == "policy@1"

    # a stream admitted on version 1 finishes on it while version 2 arrives by upload
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "model": "policy", "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        up = upload(server, root, "v2")
        assert up.status_code == 200, up.text
        assert up.json()["version"] == 2
        chunks = [first] + [line for line in lines if line.startswith("data: {")]
    streamed = [int(t.removeprefix("token_id:")) for c in chunks
                for t in (json.loads(c[6:])["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert json.loads(first[6:])["model"] == "policy@1"
    assert streamed == hf_greedy(peft[0], PROMPT, 200)
    assert all(json.loads(c[6:])["model"] == "policy@1" for c in chunks)

    assert greedy_ids(server, "policy") == (hf_greedy(peft[1], PROMPT, N), "policy@2")
    assert greedy_ids(server, "policy@1") == (hf_greedy(peft[0], PROMPT, N), "policy@1")
    cards = {c["id"]: c for c in server.get("/v1/models").json()["data"]}
    assert cards["policy"]["version"] == 2 and cards["policy"]["versions"] == [1, 2]
    assert cards["policy@1"]["version"] == 1
    assert 'loraserve_adapter_version{adapter="policy"} 2.0' in server.get("/metrics").text

    # a failed replace answers 4xx and leaves version 2 serving
    bad = upload(server, root, "v3", weights=b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    assert 400 <= bad.status_code < 500, bad.text
    assert greedy_ids(server, "policy") == (hf_greedy(peft[1], PROMPT, N), "policy@2")
    # version 3 from a path: version 1 (idle) retires beyond --max-adapter-versions 2
    r = server.post("/v1/load_lora_adapter", {"lora_name": "policy", "replace": True,
                                              "lora_path": str(root / "v3")})
    assert r.json()["version"] == 3
    assert greedy_ids(server, "policy") == (hf_greedy(peft[2], PROMPT, N), "policy@3")
    assert server.post("/v1/completions", {"model": "policy@1", "prompt": PROMPT}
                       ).status_code == 404


def test_upload_errors_are_4xx(setup):
    server, root, _ = setup
    assert upload(server, root, "v1", name="bad name!").status_code == 400
    files = {"config": ("c.json", b"{}")}
    r = httpx.post(server.url + "/v1/upload_lora_adapter", files=files,
                   data={"lora_name": "x"}, timeout=30)
    assert r.status_code == 400 and "weights" in r.text
    r = httpx.post(server.url + "/v1/upload_lora_adapter", files={
        "config": ("c.json", b"{}"), "extra": ("e", b"1")}, data={"lora_name": "x"},
        timeout=30)
    assert r.status_code == 400 and "extra" in r.text
    big = upload(server, root, "v1", name="huge", weights=b"\0" * (64 << 20))
    assert big.status_code == 413, big.text
    r = httpx.post(server.url + "/v1/upload_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert r.status_code == 415
    assert server.get("/health").status_code == 200

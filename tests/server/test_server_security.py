"""API keys on the real server: /health is open, everything else needs the key; adapter
updates need the admin key; unsafe flag combinations refuse to start."""

from __future__ import annotations

import subprocess
import sys

import pytest
from adapter_factory import make_peft_adapter
from model_factory import make_tiny_llama
from server_utils import REPO, ServerProcess, assert_error

KEY, ADMIN = "user-key-123", "admin-key-456"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_security")
    model = make_tiny_llama(root / "model")
    return {"root": root, "model": model,
            "a1": make_peft_adapter(model, root / "loras" / "a1", r=4, seed=5)}


@pytest.fixture(scope="module")
def server(files):
    with ServerProcess(files["model"], "--api-key", KEY, "--admin-api-key", ADMIN,
                       "--lora-root", str(files["root"] / "loras"), log_dir=files["root"],
                       api_key=KEY) as s:
        yield s


def test_health_is_open_and_everything_else_needs_the_key(server):
    import httpx

    assert httpx.get(server.url + "/health").status_code == 200
    body = {"model": "model", "prompt": "hi", "max_tokens": 2}
    for path in ("/v1/models", "/metrics", "/debug/state", "/debug/invariants"):
        assert_error(httpx.get(server.url + path), 401, "API key")
        assert_error(server.get(path, key="wrong"), 401)
        assert server.get(path, key=ADMIN).status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert server.get(path).status_code == 200
    for path in ("/debug/state", "/debug/invariants"):  # not for ordinary clients
        assert_error(server.get(path), 403, "operator")
    report = server.get("/debug/invariants", key=ADMIN).json()
    assert report["ok"] and report["violations"] == [] and report["kv_blocks_total"] > 0
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_error(httpx.post(server.url + path, json=body), 401)
        r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Basic {KEY}"})
        assert_error(r, 401)
    assert server.post("/v1/completions", body).status_code == 200
    assert server.get("/v1/models", key=ADMIN).status_code == 200  # the admin key works too


def test_openai_client_with_and_without_key(server):
    import openai

    with pytest.raises(openai.AuthenticationError):
        server.openai(key="wrong").models.list()
    r = server.openai().chat.completions.create(
        model="model", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.usage.completion_tokens >= 1


def test_adapter_updates_need_the_admin_key(server, files):
    body = {"lora_name": "a1", "lora_path": str(files["a1"])}
    assert_error(server.post("/v1/load_lora_adapter", body), 401, "admin API key")
    assert_error(server.post("/v1/load_lora_adapter", body, key="nope"), 401)
    assert server.post("/v1/load_lora_adapter", body, key=ADMIN).status_code == 200
    assert server.post("/v1/completions", {"model": "a1", "prompt": "hi",
                                           "max_tokens": 2}).status_code == 200
    assert_error(server.post("/v1/unload_lora_adapter", {"lora_name": "a1"}), 401)
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "a1"},
                       key=ADMIN).status_code == 200
    outside = {"lora_name": "x", "lora_path": str(files["model"])}
    assert_error(server.post("/v1/load_lora_adapter", outside, key=ADMIN), 403, "--lora-root")


def test_runtime_updates_without_key_refused_on_public_host(files):
    cmd = [sys.executable, "-m", "loraserve.cli", "serve", "--model", str(files["model"]),
           "--host", "0.0.0.0", "--allow-runtime-lora-updates"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0
    assert "loopback" in r.stderr, r.stderr


def test_server_paths_are_the_operators(server, files):
    def roots(key):
        return {c["id"]: c["root"] for c in server.get("/v1/models", key=key).json()["data"]}

    r = server.post("/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(files["a1"])},
                    key=ADMIN)
    assert r.status_code == 200, r.text
    assert roots(KEY) == {"model": "model", "a1": "a1"}  # names, never server directories
    admin = roots(ADMIN)
    assert admin["a1"] == str(files["a1"].resolve())
    assert admin["model"] == str(files["model"].resolve())


def test_lora_root_confines_every_file_not_only_the_folder(server, files):
    # a real folder inside the root whose two files are symlinks to an adapter outside it
    outside = make_peft_adapter(files["model"], files["root"] / "elsewhere" / "b", r=4, seed=6)
    trick = files["root"] / "loras" / "trick"
    trick.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (trick / name).symlink_to(outside / name)
    r = server.post("/v1/load_lora_adapter", {"lora_name": "trick", "lora_path": str(trick)},
                    key=ADMIN)
    assert_error(r, 400, "outside the allowed directory")
    assert "trick" not in [c["id"] for c in server.get("/v1/models").json()["data"]]

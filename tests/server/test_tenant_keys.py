"""Tenant keys (--api-keys-file): each key sees and uses only its adapters, its limits answer
429 with Retry-After, /metrics reports limits and usage per tenant, and the file reloads
(admin route, SIGHUP) without a restart; a bad file changes nothing."""

from __future__ import annotations

import json
import signal
import time

import pytest
from adapter_factory import make_peft_adapter
from server_utils import ServerProcess, start_long_stream

ADMIN = "admin-key"
KEYS = {
    "key-a": {"name": "tenant-a", "adapters": ["a0"]},
    "key-b": {"name": "tenant-b", "adapters": "*", "base": False, "max_concurrent": 1},
    "key-rpm": {"name": "tenant-rpm", "adapters": "*", "requests_per_minute": 2},
    "key-tpm": {"name": "tenant-tpm", "adapters": ["a0"], "tokens_per_minute": 40},
}


def write_keys(path, keys) -> None:
    path.write_text(json.dumps({"keys": keys}))


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    a0 = make_peft_adapter(tiny_model_dir, root / "a0", r=4, seed=1)
    a1 = make_peft_adapter(tiny_model_dir, root / "a1", r=4, seed=2)
    keys = root / "keys.json"
    write_keys(keys, KEYS)
    s = ServerProcess(tiny_model_dir, "--admin-api-key", ADMIN, "--api-keys-file", str(keys),
                      "--lora-paths", f"a0={a0}", f"a1={a1}", log_dir=root)
    try:
        yield s.wait_ready(), keys
    finally:
        s.stop()


def complete(server, key, model, **kw):
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, **kw}
    return server.post("/v1/completions", body, key=key)


def models(server, key):
    return {m["id"] for m in server.get("/v1/models", key=key).json()["data"]}


def test_each_key_sees_and_uses_only_its_adapters(setup):
    server, _ = setup
    base = next(iter(models(server, ADMIN) - {"a0", "a1"}))
    assert models(server, ADMIN) == {base, "a0", "a1"}
    assert models(server, "key-a") == {base, "a0"}
    assert models(server, "key-b") == {"a0", "a1"}
    assert complete(server, "key-a", "a0").status_code == 200
    assert complete(server, "key-a", base).status_code == 200
    for key, model in (("key-a", "a1"), ("key-a", f"{base}:a1"), ("key-b", base)):
        r = complete(server, key, model)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert complete(server, "key-b", "a1").status_code == 200
    assert complete(server, "nope", "a0").status_code == 401
    # tenants neither load adapters nor read the operator's views
    r = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"},
                    key="key-a")
    assert r.status_code == 401
    for path in ("/metrics", "/debug/state"):
        assert server.get(path, key="key-a").status_code == 403


def test_requests_per_minute_answers_429_with_retry_after(setup):
    server, _ = setup
    assert [complete(server, "key-rpm", "a0").status_code for _ in range(2)] == [200, 200]
    r = complete(server, "key-rpm", "a0")
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limit_requests_per_minute"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert complete(server, "key-a", "a0").status_code == 200  # other tenants unaffected


def test_tokens_per_minute_charges_what_a_request_used(setup):
    server, _ = setup
    r = complete(server, "key-tpm", "a0", max_tokens=60, ignore_eos=True)  # 63 of 40 tokens
    assert r.status_code == 200
    r = complete(server, "key-tpm", "a0")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_tokens_per_minute"
    assert 1 <= int(r.headers["retry-after"]) <= 60


def test_max_concurrent_counts_a_stream_until_its_end(setup):
    server, _ = setup
    t = start_long_stream(server.url, "key-b", "a1")
    r = complete(server, "key-b", "a0")
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_max_concurrent"
    t.join(120)
    assert complete(server, "key-b", "a0").status_code == 200


def test_metrics_report_limits_and_usage_per_tenant(setup):
    server, _ = setup
    complete(server, "key-a", "a0")
    text = server.get("/metrics", key=ADMIN).text
    assert 'loraserve_tenant_limit{limit="requests_per_minute",tenant="tenant-rpm"} 2.0' in text
    assert 'loraserve_tenant_limit{limit="max_concurrent",tenant="tenant-b"} 1.0' in text
    line = next(x for x in text.splitlines()
                if x.startswith('loraserve_tenant_requests_total{tenant="tenant-a"}'))
    assert float(line.split()[-1]) >= 1
    assert 'loraserve_tenant_tokens_total{tenant="tenant-a"}' in text
    assert 'loraserve_tenant_rate_limited_total{limit="requests_per_minute",' in text


def test_reload_changes_keys_and_a_bad_file_changes_nothing(setup):
    server, keys = setup
    new = {**KEYS, "key-a": {"name": "tenant-a", "adapters": ["a0", "a1"]},
           "key-new": {"name": "tenant-new", "adapters": "*"}}
    write_keys(keys, new)
    assert server.post("/v1/reload_api_keys", {}, key="key-a").status_code == 403
    r = server.post("/v1/reload_api_keys", {}, key=ADMIN)
    assert r.status_code == 200 and "tenant-new" in r.json()["tenants"]
    assert "a1" in models(server, "key-a")
    assert complete(server, "key-new", "a1").status_code == 200
    keys.write_text('{"keys": {"key-x": {"name": "bad name!"}}}')
    r = server.post("/v1/reload_api_keys", {}, key=ADMIN)
    assert r.status_code == 400 and "name" in r.json()["error"]["message"]
    assert complete(server, "key-new", "a1").status_code == 200  # the old keys stay
    write_keys(keys, {**new, "key-hup": {"name": "tenant-hup", "adapters": "*"}})
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while complete(server, "key-hup", "a0").status_code != 200:
        assert time.monotonic() < deadline, "SIGHUP did not reload the keys"
        time.sleep(0.1)
    write_keys(keys, KEYS)
    assert server.post("/v1/reload_api_keys", {}, key=ADMIN).status_code == 200
    assert complete(server, "key-hup", "a0").status_code == 401

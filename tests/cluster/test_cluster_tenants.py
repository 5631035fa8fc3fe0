"""Tenants behind the ingress: the limits hold for the whole deployment (enforced at the
ingress, charged with what each replica reports), each key's adapter scope holds on every
replica, the keys reload everywhere; and a replica that just died never holds an unload."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from adapter_factory import make_peft_adapter
from cluster_utils import LocalCluster
from server_utils import start_long_stream

pytest.importorskip("ray.serve", reason="the cluster extra: pip install loraserve[cluster]")

ADMIN = "admin-key"
KEYS = {"key-a": {"name": "tenant-a", "adapters": ["a0"]},
        "key-rpm": {"name": "tenant-rpm", "adapters": "*", "requests_per_minute": 3},
        "key-tpm": {"name": "tenant-tpm", "adapters": "*", "tokens_per_minute": 40},
        "key-one": {"name": "tenant-one", "adapters": "*", "max_concurrent": 1}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    from loraserve.cluster.spec import ClusterSpec
    from loraserve.config import ClusterConfig, EngineConfig
    from loraserve.server.settings import ServerSettings

    root = tmp_path_factory.mktemp("cluster_tenants")
    a0 = make_peft_adapter(tiny_model_dir, root / "a0", r=4, seed=1)
    a1 = make_peft_adapter(tiny_model_dir, root / "a1", r=4, seed=2)
    keys = root / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    spec = ClusterSpec(model=str(tiny_model_dir), engine=EngineConfig(num_threads=1),
                       settings=ServerSettings(admin_api_key=ADMIN, api_keys_file=str(keys)),
                       cluster=ClusterConfig(replicas=2, routing="round_robin"),
                       adapters=(("a0", str(a0)), ("a1", str(a1))))
    c = LocalCluster(spec)
    try:
        yield c, keys, root
    finally:
        c.stop()


def post(c, path, body, key):
    return httpx.post(c.url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def complete(c, key, model, **kw):
    return post(c, "/v1/completions", {"model": model, "prompt": [5, 6, 7], "max_tokens": 2,
                                       "temperature": 0, **kw}, key)


def models(c, key):
    r = httpx.get(c.url + "/v1/models", timeout=60, headers={"Authorization": f"Bearer {key}"})
    return {m["id"] for m in r.json()["data"]}


def test_scope_holds_through_the_ingress(setup):
    c, _, _ = setup
    assert models(c, ADMIN) >= {"a0", "a1"}
    assert "a1" not in models(c, "key-a") and "a0" in models(c, "key-a")
    assert complete(c, "key-a", "a0").status_code == 200
    assert complete(c, "key-a", "a1").status_code == 404
    assert complete(c, "wrong", "a0").status_code == 401


def test_requests_per_minute_holds_for_the_deployment(setup):
    """Round robin over two replicas: a per-replica limit would let six through."""
    c, _, _ = setup
    assert [complete(c, "key-rpm", "a1").status_code for _ in range(3)] == [200] * 3
    r = complete(c, "key-rpm", "a1")
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60


def test_tokens_per_minute_uses_what_the_replica_reports(setup):
    c, _, _ = setup
    assert complete(c, "key-tpm", "a0", max_tokens=60, ignore_eos=True).status_code == 200
    r = complete(c, "key-tpm", "a0")
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_tokens_per_minute"
    text = httpx.get(c.url + "/metrics", timeout=60,
                     headers={"Authorization": f"Bearer {ADMIN}"}).text
    line = next(x for x in text.splitlines()
                if x.startswith('loraserve_tenant_tokens_total{tenant="tenant-tpm"}'))
    assert float(line.split()[-1]) == 63  # 3 prompt + 60 generated, counted once
    assert text.count("# TYPE loraserve_tenant_limit gauge") == 1


def test_max_concurrent_holds_for_the_deployment(setup):
    c, _, _ = setup
    t = start_long_stream(c.url, "key-one", "a0")
    r = complete(c, "key-one", "a1")
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    t.join(120)
    assert complete(c, "key-one", "a1").status_code == 200


def test_reload_reaches_the_ingress_and_every_replica(setup):
    c, keys, _ = setup
    keys.write_text(json.dumps({"keys": {**KEYS, "key-a": {"name": "tenant-a",
                                                           "adapters": ["a0", "a1"]}}}))
    assert post(c, "/v1/reload_api_keys", {}, "key-a").status_code == 403
    assert post(c, "/v1/reload_api_keys", {}, ADMIN).status_code == 200
    assert [complete(c, "key-a", "a1").status_code for _ in range(4)] == [200] * 4
    keys.write_text("not json")
    assert post(c, "/v1/reload_api_keys", {}, ADMIN).status_code == 400
    assert complete(c, "key-a", "a1").status_code == 200
    keys.write_text(json.dumps({"keys": KEYS}))  # replicas that start later read it too


def test_unload_right_after_a_replica_died_answers_within_bounds(setup, tiny_model_dir):
    import ray

    c, _, root = setup
    extra = make_peft_adapter(tiny_model_dir, root / "extra", r=4, seed=5)
    assert post(c, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": str(extra)},
                ADMIN).status_code == 200
    victim = c.replica_ids()[0]
    ray.kill(c.replica_actor(victim), no_restart=True)
    t0 = time.monotonic()
    r = post(c, "/v1/unload_lora_adapter", {"lora_name": "extra"}, ADMIN)
    took = time.monotonic() - t0
    assert took < 20, took
    assert r.status_code == 200 or (r.status_code == 503 and "retry-after" in r.headers), r.text
    c.wait_replicas(2, exclude=(victim,), timeout=300)  # a shared 2-core host is slow here
    assert "extra" not in models(c, ADMIN)

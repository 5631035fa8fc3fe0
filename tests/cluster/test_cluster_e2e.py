"""`loraserve serve --replicas 2` in miniature: two engine replicas of a tiny model
behind the Ray Serve ingress, on one small local Ray instance shared by every test here.

The real openai client; the base model and two adapters, streaming and not; outputs equal to
the offline LLM API's; errors equal to a single server's; adapter-affinity routing; load and
unload through the ingress on every replica; a load one replica refuses is rolled back on the
other; a replica killed mid-run is replaced, replays the registry, and requests succeed.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from adapter_factory import make_peft_adapter
from cluster_utils import LocalCluster, replicas_of
from server_utils import ServerProcess

pytest.importorskip("ray.serve", reason="the cluster extra: pip install loraserve[cluster]")

PROMPTS = ["hello world", "the cat reads a table"]
MODELS = [("{base}", None), ("sql", "sql"), ("{base}:chat", "chat")]  # {base}: its name


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("cluster")
    return {"root": root, "model": tiny_model_dir,
            "sql": make_peft_adapter(tiny_model_dir, root / "sql", seed=11),
            "chat": make_peft_adapter(tiny_model_dir, root / "chat", r=4, seed=12,
                                      target_modules=["q_proj", "o_proj", "down_proj"]),
            "extra": make_peft_adapter(tiny_model_dir, root / "extra", seed=13),
            "other": make_peft_adapter(tiny_model_dir, root / "other", seed=14)}


@pytest.fixture(scope="module")
def cluster(files):
    from loraserve.cluster.spec import ClusterSpec
    from loraserve.config import ClusterConfig, EngineConfig
    from loraserve.server.settings import ServerSettings

    spec = ClusterSpec(model=str(files["model"]),
                       engine=EngineConfig(max_loaded_loras=4, num_threads=1),
                       settings=ServerSettings(allow_runtime_lora_updates=True),
                       cluster=ClusterConfig(replicas=2),
                       adapters=(("sql", str(files["sql"])), ("chat", str(files["chat"]))))
    c = LocalCluster(spec)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def single(files):
    """A single server with the same adapters and flags: the reference for every answer."""
    with ServerProcess(files["model"], "--lora-paths", f"sql={files['sql']}",
                       f"chat={files['chat']}", "--allow-runtime-lora-updates",
                       "--max-loaded-loras", "4", log_dir=files["root"]) as s:
        yield s


@pytest.fixture(scope="module")
def llm(files):
    from loraserve import LLM

    return LLM(str(files["model"]), lora_paths={k: str(files[k]) for k in
                                                ("sql", "chat", "extra")})


def offline(llm, prompt, lora, max_tokens=12) -> str:
    from loraserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if isinstance(prompt, list):
        return llm.chat(prompt, params, lora=lora)[0].text
    return llm.generate(prompt, params, lora=lora)[0].text


@pytest.mark.parametrize("model,lora", MODELS)
def test_outputs_equal_offline_streaming_and_not(cluster, llm, model, lora, files):
    client = cluster.openai()
    model = model.format(base=files["model"].name)
    for prompt in PROMPTS:
        want = offline(llm, prompt, lora)
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                        temperature=0)
        assert out.choices[0].text == want
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    # Passed through chunk by chunk. The engine hands a reader that lags only the newest state
    # (async_engine.py), so 12 fast tokens once came as one chunk (a Zen 5 host, full suite):
    # 64 tokens, EOS ignored, leave the proxy no such chance.
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=64,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert len(chunks) > 1
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                          temperature=0)
    assert chat.choices[0].message.content == offline(llm, messages, lora, max_tokens=10)


def test_adapter_requests_stick_to_one_replica(cluster):
    client = cluster.openai()
    before = _adapter_requests(cluster, "sql")
    for _ in range(6):
        client.completions.create(model="sql", prompt="hello", max_tokens=2, temperature=0)
    after = _adapter_requests(cluster, "sql")
    served = {rid: after[rid] - before.get(rid, 0) for rid in after}
    assert sorted(served.values()) == [0, 6], served  # affinity: all on the replica holding it


BAD_REQUESTS = [
    ("POST", "/v1/completions", {"model": "nope", "prompt": "hi"}),
    ("POST", "/v1/completions", {"model": "sql", "prompt": ""}),
    ("POST", "/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 10**6}),
    ("POST", "/v1/chat/completions", {"model": "chat", "messages": "not a list"}),
    ("POST", "/v1/completions", "{not json"),
    ("GET", "/v1/completions", None),
    ("GET", "/no/such/route", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "bad:name", "lora_path": "/x"}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "{base}", "lora_path": "/x"}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": "/no/such/dir"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}),
]


@pytest.mark.parametrize("method,path,body", BAD_REQUESTS)
def test_errors_equal_the_single_servers(cluster, single, files, method, path, body):
    if isinstance(body, dict):
        body = {k: v.format(base=files["model"].name) for k, v in body.items()
                } if "lora_name" in body else body

    def send(url):
        content = body if isinstance(body, str) else None
        return httpx.request(method, url + path, json=None if content else body,
                             content=content, timeout=60)

    got, want = send(cluster.url), send(single.url)
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    assert set(got.json()["error"]) >= {"message", "type", "code"}


def test_load_and_unload_reach_every_replica(cluster, llm, files):
    client = cluster.openai()
    r = httpx.post(cluster.url + "/v1/load_lora_adapter",
                   json={"lora_name": "extra", "lora_path": str(files["extra"])}, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert "extra" in r.json()["loaded_adapters"]
    models = httpx.get(cluster.url + "/v1/models", timeout=30).json()
    assert len(replicas_of(models, "extra")) == 2  # registered on both replicas
    for _ in range(3):  # wherever it is routed, it answers with its own weights
        out = client.completions.create(model="extra", prompt=PROMPTS[1], max_tokens=12,
                                        temperature=0)
        assert out.choices[0].text == offline(llm, PROMPTS[1], "extra")
    r = httpx.post(cluster.url + "/v1/unload_lora_adapter", json={"lora_name": "extra"},
                   timeout=60)
    assert r.status_code == 200 and "extra" not in r.json()["loaded_adapters"]
    assert replicas_of(httpx.get(cluster.url + "/v1/models", timeout=30).json(), "extra") == {}
    gone = httpx.post(cluster.url + "/v1/completions", json={"model": "extra", "prompt": "x"},
                      timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_a_replace_is_one_version_number_on_every_replica(cluster, llm, files):
    load = {"lora_name": "policy", "lora_path": str(files["extra"])}
    r = httpx.post(cluster.url + "/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == 1, r.text
    r = httpx.post(cluster.url + "/v1/load_lora_adapter", timeout=60,
                   json={**load, "lora_path": str(files["other"]), "replace": True})
    assert r.status_code == 200 and r.json()["version"] == 2, r.text
    models = httpx.get(cluster.url + "/v1/models", timeout=30).json()
    assert len(replicas_of(models, "policy")) == 2 and len(replicas_of(models, "policy@1")) == 2
    assert next(c for c in models["data"] if c["id"] == "policy")["version"] == 2
    llm.load_lora_adapter("other", str(files["other"]))
    client = cluster.openai()
    for _ in range(3):  # wherever it is routed: the same weights under the same number
        new = client.completions.create(model="policy", prompt=PROMPTS[1], max_tokens=12,
                                        temperature=0)
        old = client.completions.create(model="policy@1", prompt=PROMPTS[1], max_tokens=12,
                                        temperature=0)
        assert (new.model, new.choices[0].text) == ("policy@2", offline(llm, PROMPTS[1],
                                                                         "other"))
        assert (old.model, old.choices[0].text) == ("policy@1", offline(llm, PROMPTS[1],
                                                                         "extra"))
    refused = httpx.post(cluster.url + "/v1/unload_lora_adapter",
                         json={"lora_name": "policy@2"}, timeout=60)
    assert refused.status_code == 400  # the replayed version: unload the name instead
    r = httpx.post(cluster.url + "/v1/unload_lora_adapter", json={"lora_name": "policy"},
                   timeout=60)
    assert r.status_code == 200 and "policy" not in r.json()["loaded_adapters"]


def test_load_refused_by_one_replica_is_rolled_back(cluster, files, single):
    first, second = cluster.replica_ids()
    # `dup` is already registered on one replica only, from another path: that replica
    # refuses the load (409), so the one that accepted it must drop it again
    assert cluster.call_replica(first, "/v1/load_lora_adapter",
                                {"lora_name": "dup", "lora_path": str(files["other"])}).ok
    body = {"lora_name": "dup", "lora_path": str(files["extra"])}
    got = httpx.post(cluster.url + "/v1/load_lora_adapter", json=body, timeout=60)
    # the single server, in the same state, answers the same
    httpx.post(single.url + "/v1/load_lora_adapter", timeout=60,
               json={"lora_name": "dup", "lora_path": str(files["other"])}).raise_for_status()
    want = httpx.post(single.url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert (got.status_code, got.json()) == (want.status_code, want.json()) and got.status_code \
        == 409
    models = httpx.get(cluster.url + "/v1/models", timeout=30).json()
    assert list(replicas_of(models, "dup")) == [first]  # rolled back on `second`
    card = next(c for c in models["data"] if c["id"] == "dup")
    assert card["root"] == str(files["other"])  # untouched where it was refused
    # the registry never took it: requests routed to the other replica do not find it
    cluster.call_replica(first, "/v1/unload_lora_adapter", {"lora_name": "dup"})
    assert replicas_of(httpx.get(cluster.url + "/v1/models", timeout=30).json(), "dup") == {}
    assert second in cluster.replica_ids()


def test_metrics_carry_a_replica_label(cluster):
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    ids = cluster.replica_ids()
    for rid in ids:
        assert f'loraserve_num_requests_running{{replica="{rid}"}}' in text
    assert text.count("# TYPE loraserve_num_requests_running gauge") == 1
    assert "loraserve_cluster_replicas 2" in text


def test_the_ingress_serves_the_dashboard_and_its_data(cluster):
    page = httpx.get(cluster.url + "/dashboard", timeout=30)
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="/dashboard/app.js">' in page.text
    js = httpx.get(cluster.url + "/dashboard/app.js", timeout=30)
    assert js.headers["content-type"].startswith("text/javascript")
    # loopback with runtime updates allowed: the page offers the admin actions
    assert httpx.get(cluster.url + "/dashboard/access", timeout=30).json() == \
        {"operator": True, "adapter_updates": True}
    cards = httpx.get(cluster.url + "/v1/models", timeout=30).json()["data"]
    sql = next(c for c in cards if c["id"] == "sql")
    assert sql["waiting"] == 0 and all("waiting" in r for r in sql["replicas"])


def test_killed_replica_is_replaced_and_requests_succeed(cluster, llm, files):
    import ray

    r = httpx.post(cluster.url + "/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "extra", "lora_path": str(files["extra"])})
    assert r.status_code == 200, r.text
    client = cluster.openai()
    victim = cluster.replica_ids()[0]
    stop, errors, done = threading.Event(), [], []

    def traffic():  # requests in flight while the replica dies
        while not stop.is_set():
            try:
                client.completions.create(model="sql", prompt="hello", max_tokens=24,
                                          temperature=0)
                done.append(time.monotonic())
            except Exception as e:  # noqa: BLE001 - counted, then checked below
                errors.append((time.monotonic(), e))

    workers = [threading.Thread(target=traffic) for _ in range(3)]
    for w in workers:
        w.start()
    time.sleep(1.0)
    ray.kill(cluster.replica_actor(victim), no_restart=True)
    killed_at = time.monotonic()
    time.sleep(2.0)
    stop.set()
    for w in workers:
        w.join(60)
    late = [e for t, e in errors if t > killed_at + 1.0]
    assert not late, late  # a second after the kill every request is served elsewhere
    assert any(t > killed_at for t in done)
    new_ids = cluster.wait_replicas(2, exclude=(victim,))
    models = httpx.get(cluster.url + "/v1/models", timeout=30).json()
    for name in ("sql", "chat", "extra"):  # the replacement replayed the registry
        assert set(replicas_of(models, name)) == set(new_ids), name
    for model, lora in MODELS + [("extra", "extra")]:
        model = model.format(base=files["model"].name)
        for _ in range(2):
            out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12,
                                            temperature=0)
            assert out.choices[0].text == offline(llm, PROMPTS[0], lora)


def _adapter_requests(cluster, adapter: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(cluster.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("loraserve_adapter_requests_total{") and \
                f'adapter="{adapter}"' in line:
            rid = line.split('replica="', 1)[1].split('"', 1)[0]
            counts[rid] = float(line.rsplit(" ", 1)[1])
    return counts

"""The real server process, driven by the real `openai` client: outputs equal the offline API's,
streaming equals non-streaming, mixed adapters in concurrent requests, and limits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from adapter_factory import make_peft_adapter
from model_factory import make_tiny_llama
from server_utils import ServerProcess, assert_error

PROMPTS = ["hello world", "the cat reads a table", "SELECT FROM WHERE", "Paris is the capital"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_openai")
    # A long context so a request can run long enough to be abandoned mid-way.
    model = make_tiny_llama(root / "model", max_position_embeddings=8192)
    a1 = make_peft_adapter(model, root / "a1", r=8, seed=1)
    a2 = make_peft_adapter(model, root / "a2", r=4, seed=2,
                           target_modules=["q_proj", "o_proj", "down_proj"])
    return {"root": root, "model": model, "a1": a1, "a2": a2}


@pytest.fixture(scope="module")
def server(files):
    with ServerProcess(files["model"], "--lora-paths", f"a1={files['a1']}", f"a2={files['a2']}",
                       "--max-n", "4", "--max-tokens-limit", "8000", "--max-prompt-tokens", "300",
                       "--max-request-bytes", "65536", log_dir=files["root"]) as s:
        yield s


@pytest.fixture(scope="module")
def llm(files):
    from loraserve import LLM

    return LLM(files["model"], lora_paths={"a1": str(files["a1"]), "a2": str(files["a2"])})


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def offline(llm, prompt, lora, **kw):
    from loraserve import SamplingParams

    params = SamplingParams(temperature=0.0, **{"max_tokens": 12, **kw})
    if isinstance(prompt, list) and isinstance(prompt[0], dict):
        return llm.chat(prompt, params, lora=lora)[0]
    return llm.generate(prompt, params, lora=lora)[0]


@pytest.mark.parametrize("model,lora", [("model", None), ("a1", "a1"), ("model:a2", "a2")])
def test_completion_matches_offline_and_stream_matches_non_stream(client, llm, model, lora):
    for prompt in PROMPTS[:2]:
        ref = offline(llm, prompt, lora)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_matches_offline_streaming_and_not(client, llm):
    messages = [{"role": "user", "content": "what is the capital of France"}]
    for model, lora in (("model", None), ("a1", "a1")):
        ref = offline(llm, messages, lora, max_tokens=10)
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                           temperature=0)
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=10, temperature=0,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_concurrent_base_and_two_adapters_match_offline(server, llm):
    jobs = [(p, lora) for p in PROMPTS for lora in (None, "a1", "a2")]
    refs = {(p, lora): offline(llm, p, lora, max_tokens=16).text for p, lora in jobs}
    assert len({refs[(PROMPTS[0], lora)] for lora in (None, "a1", "a2")}) == 3  # adapters matter

    def one(job):
        p, lora = job
        client = server.openai()
        r = client.completions.create(model=lora or "model", prompt=p, max_tokens=16,
                                      temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs))
    assert got == [refs[j] for j in jobs]
    server.wait_idle()


def test_n_seed_logprobs_stop_and_token_prompts(client, llm):
    r = client.completions.create(model="a1", prompt=PROMPTS[0], n=3, max_tokens=8,
                                  temperature=1.0, seed=7, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) > 0
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    again = client.completions.create(model="a1", prompt=PROMPTS[0], n=3, max_tokens=8,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded
    # Two prompts given as token ids, n=2 each: four choices, prompt-major.
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    r = client.completions.create(model="model", prompt=ids, n=2, max_tokens=6, temperature=0)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    refs = [offline(llm, i, None, max_tokens=6).text for i in ids]
    assert texts == [refs[0], refs[0], refs[1], refs[1]]
    # A stop string cuts the text before it, streamed or not.
    full = offline(llm, PROMPTS[1], "a2", max_tokens=16).text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    ref = offline(llm, PROMPTS[1], "a2", max_tokens=16, stop=(stop,))
    r = client.completions.create(model="a2", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == ref.text and stop not in ref.text
    chunks = client.completions.create(model="a2", prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    # Chat logprobs.
    c = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    lp = c.choices[0].logprobs.content
    assert len(lp) == c.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in lp)


def test_models_lists_base_and_adapters(client, files):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"model", "a1", "a2"}
    assert cards["a1"].parent == "model" and cards["a1"].root == str(files["a1"])
    assert cards["a1"].tier in ("disk", "host", "device") and cards["a1"].pinned is False
    assert cards["model"].object == "model" and cards["model"].owned_by


BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"model": "model:nope", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"model": "a1/../a2", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"model": "other:a1", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"model": "a1", "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": "a1", "prompt": []}, 400, "empty"),
    ("/v1/completions", {"model": "a1", "prompt": [99999]}, 400, "out of range"),
    ("/v1/completions", {"model": "a1", "prompt": "x", "n": 5}, 400, "--max-n"),
    ("/v1/completions", {"model": "a1", "prompt": "x", "max_tokens": 8001}, 400,
     "--max-tokens-limit"),
    ("/v1/completions", {"model": "a1", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "a1", "prompt": "hello " * 400}, 400, "--max-prompt-tokens"),
    ("/v1/completions", {"model": "a1", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "a1", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "a1", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "a1"}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "a1", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "a1", "messages": [{"role": "bot", "content": "x"}]},
     400, "role"),
    ("/v1/chat/completions", {"model": "zzz", "messages": [{"role": "user", "content": "x"}]},
     404, "does not exist"),
]


@pytest.mark.parametrize("path,body,status,fragment", BAD)
def test_bad_input_is_a_clear_4xx(server, path, body, status, fragment):
    assert_error(server.post(path, body), status, fragment)


def test_malformed_requests_and_server_keeps_serving(server, client):
    r = server.post("/v1/completions", content=b'{"model": "a1", "prompt": ', json=None)
    assert_error(r, 400, "not valid JSON")
    assert_error(server.post("/v1/completions", content=b"[1, 2]"), 400, "JSON object")
    big = {"model": "a1", "prompt": "x" * 70000}
    assert_error(server.post("/v1/completions", big), 413, "--max-request-bytes")
    import httpx

    try:  # a huge header is refused by h11's limit: a 4xx or a dropped connection
        r = httpx.get(server.url + "/v1/models", headers={"X-Big": "a" * 200_000}, timeout=10)
        assert 400 <= r.status_code < 500
    except httpx.TransportError:
        pass
    assert_error(server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
                 403, "--admin-api-key")
    assert_error(server.post("/unload_lora_adapter", {"lora_name": "a1"}), 403, "disabled")
    assert server.get("/health").status_code == 200
    r = client.completions.create(model="a1", prompt="hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    assert server.state()["engine_errors"] == 0


def test_metrics(server, client):
    client.completions.create(model="a2", prompt="hello", max_tokens=3, temperature=0)
    text = server.get("/metrics").text
    for line in ('loraserve_adapter_tier{adapter="a1"}', 'loraserve_adapter_requests_total',
                 "loraserve_num_requests_running", "loraserve_kv_cache_usage_ratio",
                 "loraserve_time_to_first_token_seconds_bucket",
                 'loraserve_adapter_generation_tokens_total{adapter="a2"}'):
        assert line in text, line


LONG = {"model": "a1", "prompt": "hello world", "max_tokens": 7000, "ignore_eos": True,
        "temperature": 0}


def test_disconnect_non_streaming_frees_blocks_and_adapter(server):
    import httpx

    server.wait_idle()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, server.url + "/v1/completions", json=LONG, timeout=3.0)
        busy = server.wait_busy()
        assert {a["name"]: a["refcount"] for a in busy["adapters"]}["a1"] == 1
        with pytest.raises(httpx.ReadTimeout):
            fut.result()  # the client gives up and closes the connection
    server.wait_idle(timeout=5)


def test_disconnect_streaming_frees_blocks_and_adapter(server):
    import httpx

    server.wait_idle()
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                      timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(5):
            assert next(lines) is not None
        assert server.state()["kv_blocks_used"] > 0
    server.wait_idle(timeout=5)

"""Request isolation: parameters that would fail a whole engine step are normalised or refused
at the edge, odd JSON gets a 400, and an unforeseen error inside the step costs only the
request that caused it."""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
import torch
from lora_reference import assert_idle
from server_utils import ServerProcess

from loraserve import LLM, SamplingParams
from loraserve.engine import runner as runner_module
from loraserve.model.sampler import sample
from loraserve.server.context import MAX_JSON_DEPTH, check_json_values
from loraserve.server.errors import ApiError
from loraserve.server.serving import _nth_seed
from loraserve.types import SEED_RANGE, FinishReason

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
P1, P2, P3 = [5, 77, 301, 12, 9], [400, 23, 8, 150, 66], [31, 17, 480, 2]


def test_tiny_temperature_means_greedy_and_odd_values_are_refused():
    for t in (1e-38, 1e-45, 5e-324, 9e-6):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    for bad in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    lo, hi = SEED_RANGE
    assert SamplingParams(seed=lo).seed == lo and SamplingParams(seed=hi).seed == hi
    for bad in (hi + 1, 10**30, lo - 1, 10**4000):
        with pytest.raises(ValueError, match="seed must be in"):
            SamplingParams(seed=bad)
    assert _nth_seed(hi, 1) == lo and _nth_seed(5, 2) == 7  # n > 1 fans out seed + j, wrapped


def test_tiny_top_p_keeps_the_top_token():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for top_p in (1e-46, 1e-300, 1e-8):
        params = [SamplingParams(temperature=1.0, top_p=top_p)] * 3
        out = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_json_depth_and_lone_surrogates_are_refused():
    deep: object = "x"
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    with pytest.raises(ApiError, match="nests deeper"):
        check_json_values({"prompt": deep})
    check_json_values({"prompt": [[1, 2]], "messages": [{"content": [{"text": "ok"}]}]})
    for bad in ({"prompt": "a\ud800b"}, {"\udfff": 1}, {"messages": [{"content": "\ud83d"}]}):
        with pytest.raises(ApiError, match="not valid Unicode"):
            check_json_values(bad)


def test_an_error_in_the_step_costs_only_its_request(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir))
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    solo = {i: llm.generate([p], sp)[0].token_ids
            for i, (p, sp) in enumerate([(P1, GREEDY), (P2, seeded)])}
    calls = {"failed": 0}

    def flaky_sample(logits, params, generators, *rest):
        if any(p.top_k == 13 for p in params):  # a request that trips an unforeseen bug
            calls["failed"] += 1
            raise RuntimeError("boom")
        return sample(logits, params, generators, *rest)

    monkeypatch.setattr(runner_module, "sample", flaky_sample)
    bad = SamplingParams(max_tokens=6, temperature=0.0, top_k=13, ignore_eos=True)
    outs = llm.generate([P1, P2, P3], [GREEDY, seeded, bad])
    assert calls["failed"] >= 2  # the batch, then the request alone
    assert outs[2].finish_reason is FinishReason.ERROR and "internal error" in outs[2].error
    assert outs[0].token_ids == solo[0]
    assert outs[1].token_ids == solo[1]  # its RNG was rewound before the retry
    assert_idle(llm.engine)
    monkeypatch.undo()
    assert llm.generate([P3], GREEDY)[0].finish_reason is FinishReason.LENGTH


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir, "--max-loras-per-batch", "2",
                       log_dir=tmp_path_factory.mktemp("isolation")) as s:
        yield s


def test_hostile_requests_get_4xx_and_harm_no_one(server):
    import httpx

    model = server.get("/v1/models").json()["data"][0]["id"]
    good = {"model": model, "prompt": [5, 77, 301, 12, 9], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    want = server.post("/v1/completions", good).json()["choices"][0]["text"]
    base = json.dumps(good)[:-1]
    raw = {  # each sent as raw bytes: some are not what a JSON library would write
        "temperature 1e-40": json.dumps({**good, "temperature": 1e-40}),
        "top_p 1e-46": json.dumps({**good, "temperature": 1.0, "top_p": 1e-46}),
        "top_p 1e-300": json.dumps({**good, "temperature": 1.0, "top_p": 1e-300}),
        "seed 2^64": json.dumps({**good, "seed": 2**64}),
        "seed 10^30": json.dumps({**good, "seed": 10**30}),
        "seed < -2^63": json.dumps({**good, "seed": -(2**63) - 1}),
        "n=3 at the top seed": json.dumps({**good, "n": 3, "seed": 2**64 - 1}),
        "5000-digit max_tokens": base + ', "max_tokens": ' + "9" * 5000 + "}",
        "1000-deep JSON": base + ', "x": ' + "[" * 1000 + "]" * 1000 + "}",
        "lone surrogate prompt": base.replace('"prompt": [5, 77, 301, 12, 9]',
                                              '"prompt": "a\\ud800b"') + "}",
        "lone surrogate chat": json.dumps({"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": "x"}]}).replace('"x"', '"\\udfff"'),
    }

    def send(body: str, chat: bool = False) -> httpx.Response:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return httpx.post(server.url + path, content=body.encode(), timeout=60,
                          headers={"content-type": "application/json"})

    with cf.ThreadPoolExecutor(16) as pool:
        goods = [pool.submit(server.post, "/v1/completions", good) for _ in range(8)]
        bads = {k: pool.submit(send, v, "chat" in k) for k, v in raw.items()}
        for name, fut in bads.items():
            r = fut.result()
            assert r.status_code < 500, (name, r.status_code, r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"], name
        for fut in goods:
            r = fut.result()
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    for name in ("temperature 1e-40", "top_p 1e-46", "top_p 1e-300", "n=3 at the top seed"):
        assert bads[name].result().status_code == 200, name  # served, not refused
    server.wait_idle()


def test_unimplemented_fields_are_refused_by_name_not_ignored(server):
    model = server.get("/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    # (tools and response_format are served: tests/server/test_structured_outputs_http.py)
    for field, value in [("functions", [{"name": "f"}]), ("guided_json", {"type": "object"}),
                         ("length_penalty", 0.5), ("echo", True), ("use_beam_search", True)]:
        r = server.post("/v1/chat/completions", {**chat, field: value})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
    # their no-op values, and nulls, change nothing and are served
    for field, value in [("length_penalty", 1.0), ("echo", False), ("tools", []),
                         ("response_format", {"type": "text"}), ("tools", None)]:
        assert server.post("/v1/chat/completions", {**chat, field: value}).status_code == 200


def test_a_small_request_is_not_queued_behind_a_huge_fan_out(server):
    """One client asks for 64 prompts x n=16 = 1024 sequences; another client's small request
    sent while they wait is served after at most one of them has finished, not after all:
    admission interleaves client requests (the bound: one sequence of the big request)."""
    import threading
    import time

    model = server.get("/v1/models").json()["data"][0]["id"]
    huge = {"model": model, "prompt": [[5 + i, 6, 7] for i in range(64)], "n": 16,
            "max_tokens": 16, "temperature": 0.5, "ignore_eos": True}
    result = {}
    t = threading.Thread(target=lambda: result.update(r=server.post("/v1/completions", huge)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        while server.state()["waiting"] < 500:
            assert time.monotonic() < deadline, "the big request never queued"
        small = server.post("/v1/completions", {"model": model, "prompt": [9, 9],
                                                "max_tokens": 4, "ignore_eos": True})
        assert small.status_code == 200
        state = server.state()
        assert state["waiting"] + state["running"] > 500, "the small request waited for all"
    finally:
        t.join(120)
    assert result["r"].status_code == 200 and len(result["r"].json()["choices"]) == 1024


def test_sampling_fields_change_the_answer_over_http(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [5, 77, 301, 12, 9], "max_tokens": 12, "temperature": 0}

    def complete(**kw) -> dict:
        r = server.post("/v1/completions", {**body, **kw})
        assert r.status_code == 200, (kw, r.text)
        return r.json()["choices"][0] | {"n": r.json()["usage"]["completion_tokens"]}

    plain = complete(ignore_eos=True)["text"]
    assert complete(ignore_eos=True, repetition_penalty=2.0)["text"] != plain
    assert complete(ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)["text"] != plain
    assert complete(ignore_eos=True, temperature=1.0, min_p=1.0)["text"] == plain  # top only
    assert complete(ignore_eos=True, logit_bias={"42": 100})["text"] == tok.decode([42] * 12)
    eos = complete(logit_bias={"1": 100})
    assert eos["n"] == 1 and eos["finish_reason"] == "stop"
    held = complete(logit_bias={"1": 100}, min_tokens=5)
    assert held["n"] == 6 and held["finish_reason"] == "stop"
    # the openai client sends them as the OpenAI schema has them (extras in extra_body)
    client = server.openai()
    out = client.completions.create(model=model, prompt="hello", max_tokens=5, temperature=0,
                                    logit_bias={"42": 100}, frequency_penalty=0.5,
                                    extra_body={"repetition_penalty": 1.1, "min_tokens": 5})
    assert out.choices[0].text == tok.decode([42] * 5)
    for bad, name in [({"repetition_penalty": 3}, "repetition_penalty"),
                      ({"presence_penalty": -2.5}, "presence_penalty"),
                      ({"min_p": -0.1}, "min_p"), ({"min_tokens": 13}, "min_tokens"),
                      ({"logit_bias": {"abc": 1}}, "logit_bias"),
                      ({"logit_bias": {"99999": 1}}, "outside the vocabulary"),
                      ({"logit_bias": {"5": 1e9}}, "logit_bias")]:
        r = server.post("/v1/completions", {**body, **bad})
        assert r.status_code == 400 and name in r.json()["error"]["message"], (bad, r.text)
    server.wait_idle()

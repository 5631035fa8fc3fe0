"""Which request fields the server takes, over HTTP with the real `openai` client (it sends
anything in `extra_body` as a top-level field): an unknown or unimplemented field is a 400
that names it (never an answer that silently ignores it), `top_logprobs` needs `logprobs` as
in OpenAI's API, and every validation error names its field in `param` without pydantic's
"Value error, " prefixes."""

from __future__ import annotations

import openai
import pytest
from model_factory import make_tiny_llama
from server_utils import ServerProcess

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("request_fields")
    with ServerProcess(make_tiny_llama(root / "model"), "--allow-runtime-lora-updates",
                       log_dir=root) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def model(server):
    return server.get("/v1/models").json()["data"][0]["id"]


def refused(call) -> dict:
    """The OpenAI error object of a call that must be a 400."""
    with pytest.raises(openai.BadRequestError) as e:
        call()
    err = e.value.body
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and "Value error" not in err["message"], err
    return err


def test_vllm_fields_we_do_not_implement_are_refused_not_ignored(client, model):
    # (structured_outputs itself is served: tests/server/test_structured_outputs_http.py)
    for body in ({"guided_json": {"type": "object"}},
                 {"guided_decoding_backend": "xgrammar"}):
        err = refused(lambda b=body: client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=3, extra_body=b))
        (field,) = body
        assert err["param"] == field and field in err["message"], err
        assert "not supported" in err["message"], err


def test_unknown_fields_are_a_400_that_lists_them(client, server, model):
    err = refused(lambda: client.completions.create(
        model=model, prompt="hi", max_tokens=3,
        extra_body={"frobnicate": 1, "temprature": 0.5}))
    assert "frobnicate" in err["message"] and "temprature" in err["message"], err
    assert err["param"] == "frobnicate" and err["code"] == "invalid_request", err
    # an unknown field inside a known object is named with its path
    err = refused(lambda: client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3,
        stream_options={"include_usage": True, "with_timings": True}, stream=True))
    assert err["param"] == "stream_options.with_timings", err
    # the admin routes too (vLLM's load_inplace is not ours)
    r = server.post("/v1/load_lora_adapter",
                    {"lora_name": "x", "lora_path": "/nowhere", "load_inplace": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "load_inplace", r.text


def test_fields_that_cannot_change_the_answer_and_nulls_are_served(client, server, model):
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3, temperature=0, user="u1",
        metadata={"team": "a"}, store=False, service_tier="auto", parallel_tool_calls=True,
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s", "some_new_field": None})
    assert out.choices[0].message.content is not None
    # OpenAI fields that would change the answer are refused by name
    err = refused(lambda: client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3, store=True))
    assert err["param"] == "store", err


def test_top_logprobs_without_logprobs_is_a_400(client, model):
    err = refused(lambda: client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, top_logprobs=2))
    assert err["param"] == "top_logprobs" and "logprobs" in err["message"], err
    refused(lambda: client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, top_logprobs=2, logprobs=False))
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                         top_logprobs=2, logprobs=True)
    assert all(len(t.top_logprobs) == 2 for t in out.choices[0].logprobs.content)


@pytest.mark.parametrize("body, param, text", [
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"stop": ["", "x"]}, "stop", "stop: at most 16 non-empty strings"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "keys are token ids"),
    ({"best_of": 3}, "best_of", "best_of"),
    ({"n": 0}, "n", "greater than or equal to 1"),
])
def test_every_validation_error_names_its_field(client, model, body, param, text):
    err = refused(lambda: client.completions.create(model=model, prompt="hi", max_tokens=2,
                                                    extra_body=body))
    assert err["param"] == param and text in err["message"], err
    assert not any(p in err["message"] for p in ("Value error", "Assertion failed")), err


def test_a_missing_required_field_names_it(server):
    r = server.post("/v1/chat/completions", {"max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages", r.text

"""Structured outputs and tool calls over HTTP with the real `openai` client, on the bundled
SmolLM2 model with two demo adapters and the base in concurrent requests (one batch): every
output satisfies its schema / regex / choice / grammar at temperature 1.0, streamed or not;
forced tool calls always parse and validate; bad constraints are a 400 naming why."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from server_utils import ServerProcess

import loraserve.demo

MODELS = ["SmolLM2-135M-Instruct", "pirate", "french"]
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
        "properties": {"city": {"type": "string", "maxLength": 30},
                       "population": {"type": "integer", "minimum": 0},
                       "country": {"enum": ["France", "Spain", "Italy", "other"]}}}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"type": "string", "maxLength": 40},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(bundled_model_dir, tmp_path_factory):
    demo = Path(loraserve.demo.__file__).parent / "data"
    s = ServerProcess(bundled_model_dir, "--lora-paths", f"pirate={demo / 'pirate'}",
                      f"french={demo / 'french'}", "--kv-cache-tokens", "16384",
                      log_dir=tmp_path_factory.mktemp("so_http"))
    try:
        yield s.wait_ready(timeout=240)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def in_parallel(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def test_json_schema_holds_for_every_adapter_and_choice(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                   "strict": True}}

    def ask(model):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a large city."}],
            response_format=fmt, temperature=1.0, n=2, max_tokens=120, seed=7)

    for r in in_parallel(ask, MODELS):
        for c in r.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.message.content), CITY)
    server.wait_idle()


def test_streamed_json_schema_and_json_object_on_completions(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    stream = client.chat.completions.create(
        model="pirate", messages=[{"role": "user", "content": "A city, as JSON."}],
        response_format=fmt, temperature=1.0, max_tokens=120, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), CITY)
    r = client.completions.create(model="french", prompt="A JSON object about cats:",
                                  max_tokens=100, temperature=1.0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # an open object may run to max_tokens; it is still JSON so far
        assert r.choices[0].text.startswith("{")


@pytest.mark.parametrize("spec, check", [
    ({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", t)),
    ({"choice": ["Paris", "Rome", "Madrid"]}, lambda t: t in ("Paris", "Rome", "Madrid")),
    ({"grammar": 'start: "The answer is " ("yes" | "no") "."'},
     lambda t: t in ("The answer is yes.", "The answer is no.")),
    ({"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     lambda t: jsonschema.validate(json.loads(t), {"type": "array", "items": {
         "type": "integer"}, "maxItems": 3}) is None),
])
def test_vllm_structured_outputs(client, spec, check):
    def ask(model):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Answer briefly."}],
            temperature=1.0, max_tokens=60, top_p=0.95, frequency_penalty=0.3,
            extra_body={"structured_outputs": spec})

    for r in in_parallel(ask, MODELS):
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), r


@pytest.mark.parametrize("body, why", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(["}}, "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "not both"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"tool_choice": "required"}, "needs tools"),
])
def test_bad_constraints_are_refused_naming_why(server, body, why):
    r = server.post("/v1/chat/completions", {"model": MODELS[0], "messages": ASK,
                                             "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert why in r.json()["error"]["message"]
    r = server.post("/v1/completions", {"model": MODELS[0], "prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]


def assert_valid_call(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_calls_always_parse_and_validate(client, server):
    def ask(job):
        model, choice, parallel = job
        return client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                              tool_choice=choice, temperature=1.0,
                                              max_tokens=150, n=2, seed=7,
                                              parallel_tool_calls=parallel)

    named = {"type": "function", "function": {"name": "add"}}
    jobs = [(m, c, p) for m in MODELS for c, p in (("required", False), (named, True),
                                                    ("required", True))]
    for (_, choice, parallel), r in zip(jobs, in_parallel(ask, jobs), strict=True):
        for c in r.choices:
            if parallel and c.finish_reason == "length":  # parallel calls are not capped
                assert not c.message.tool_calls  # calls cut by max_tokens: not returned
                continue
            assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
            assert parallel or len(c.message.tool_calls) == 1
            for call in c.message.tool_calls:
                assert_valid_call(call)
            if choice is named:
                assert [t.function.name for t in c.message.tool_calls] == ["add"]
    server.wait_idle()


def test_streamed_tool_calls_arrive_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model="pirate", messages=ASK, tools=TOOLS,
                                            tool_choice="required", temperature=1.0,
                                            max_tokens=150, stream=True,
                                            parallel_tool_calls=False)
    calls, finish, content = {}, None, ""
    for ch in stream:
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and content == ""
    call = calls[0]
    assert call["id"]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_parses_calls_and_accepts_tool_turns(client):
    r = client.chat.completions.create(model=MODELS[0], messages=ASK, tools=TOOLS,
                                       temperature=0.0, max_tokens=150)
    c = r.choices[0]
    if c.message.tool_calls:  # the model chose to call: parsed, finish_reason tool_calls
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            assert call.function.name in SCHEMAS
            json.loads(call.function.arguments)
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content
    # a whole tool turn: the assistant's call and the tool's answer go back in
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
    ]
    for model in MODELS:
        r = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                           temperature=0.0, max_tokens=30)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(model=MODELS[0], messages=ASK, tools=TOOLS,
                                       tool_choice="none", temperature=0.0, max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_bad_tool_turns_are_refused(server):
    history = ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]
    r = server.post("/v1/chat/completions", {"model": MODELS[0], "messages": history,
                                             "tools": TOOLS, "max_tokens": 5})
    assert r.status_code == 400 and "arguments" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.openai().chat.completions.create(model=MODELS[0], messages=ASK, tools=[
            {"type": "function", "function": {"name": "bad name!"}}])

"""Schemathesis over the server's own OpenAPI schema: for every operation, cases
that fit the schema and cases that break it, sent to a live server (tiny model, runtime
adapter updates confined to a root, small limits so a fuzzed max_tokens or n stays cheap).
No answer may be a 5xx; every 4xx is OpenAI-shaped JSON; afterwards the invariant check
passes with no block or refcount held. Bounded: a few dozen cases per operation."""

from __future__ import annotations

import pytest
import schemathesis
from adapter_factory import make_peft_adapter
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from server_utils import ServerProcess

EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 30}
SKIP = {"/metrics"}  # Prometheus text, nothing to fuzz


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    make_peft_adapter(tiny_model_dir, root / "loras" / "a", r=4, seed=3)
    with ServerProcess(tiny_model_dir, "--allow-runtime-lora-updates", "--lora-root",
                       str(root / "loras"), "--lora-paths", f"a={root / 'loras' / 'a'}",
                       "--max-tokens-limit", "8", "--max-n", "2",
                       "--max-prompt-tokens", "64", "--kv-cache-tokens", "1024",
                       log_dir=root) as s:
        yield s


def check_answer(case, r) -> None:
    where = f"{case.method} {case.path} {case.body!r:.300} -> {r.status_code} {r.text[:300]}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        err = r.json()["error"]
        assert {"message", "type", "code"} <= set(err) and err["message"], where


def test_no_5xx_and_every_4xx_is_openai_shaped(server):
    raw = server.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    ops = [op.ok() for op in schema.get_all_operations()]
    paths = {op.path for op in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"} <= paths
    calls = []
    for op in ops:
        if op.path in SKIP:
            continue
        for mode, n in EXAMPLES.items():
            if mode is GenerationMode.NEGATIVE and (op.method.upper() != "POST"
                                                    or not op.body):
                continue  # nothing to break in a GET, or a POST, without a body

            @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                r = case.call(base_url=server.url, timeout=60)
                calls.append(r.status_code)
                check_answer(case, r)

            run()
    assert len(calls) > 100 and any(s == 200 for s in calls) and any(s >= 400 for s in calls)
    server.wait_idle(timeout=30)
    rep = server.get("/debug/invariants").json()
    assert rep["ok"], rep["violations"]
    assert "Traceback" not in server.log()

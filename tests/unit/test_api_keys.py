"""The keys file (server/api_keys.py) and the per-tenant limits (server/quotas.py), without a
server: validation names what is wrong, lookups, buckets refill, Retry-After is honest."""

from __future__ import annotations

import json

import pytest

from loraserve.server.api_keys import KeyFileError, KeyRing, Tenant, parse_keys
from loraserve.server.quotas import QuotaGate


def table(keys: dict, reserved=()):
    return parse_keys(json.dumps({"keys": keys}).encode(), "keys.json", reserved)


def test_lookup_scope_and_defaults():
    t = table({"k1": {"name": "a", "adapters": ["x"]}, "k2": {"name": "b", "adapters": "*",
                                                              "base": False},
               "k3": {"name": "a", "adapters": ["x"]}})
    a, b = t.lookup("k1"), t.lookup("k2")
    assert a == t.lookup("k3") and a.name == "a"  # two keys, one tenant (rotation)
    assert a.may_use("x") and not a.may_use("y") and a.may_use(None)
    assert b.may_use("anything") and not b.may_use(None)
    assert t.lookup("k") is None and t.lookup(None) is None and t.lookup("k1 ") is None
    assert table({"k": {"name": "c"}}).lookup("k").adapters == frozenset()  # none by default


@pytest.mark.parametrize("keys,words", [
    ({"k": {"name": "bad name"}}, "name must be"),
    ({"k": {"name": "a", "adapters": "x"}}, "adapters must be"),
    ({"k": {"name": "a", "base": "yes"}}, "base must be"),
    ({"k": {"name": "a", "max_concurrent": 0}}, "max_concurrent must be"),
    ({"k": {"name": "a", "tokens_per_minute": 1.5}}, "tokens_per_minute must be"),
    ({"k": {"name": "a", "rpm": 3}}, "unknown fields ['rpm']"),
    ({"k k": {"name": "a"}}, "spaces"),
    ({"k": {"name": "a"}, "k2": {"name": "a", "base": False}}, "disagree"),
    ({"admin": {"name": "a"}}, "--admin-api-key"),
])
def test_bad_files_are_refused_naming_the_problem(keys, words):
    with pytest.raises(KeyFileError, match=words.replace("[", r"\[").replace("]", r"\]")) as ei:
        table(keys, reserved=("admin",))
    assert "k k" not in str(ei.value)  # keys never appear in messages


def test_reload_keeps_the_old_table_when_the_new_file_is_bad(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {"k1": {"name": "a"}}}))
    ring = KeyRing(str(path))
    path.write_text("{not json")
    with pytest.raises(KeyFileError, match="not valid JSON"):
        ring.reload()
    assert ring.table.lookup("k1").name == "a"
    path.write_text(json.dumps({"keys": {"k2": {"name": "b"}}}))
    ring.reload()
    assert ring.table.lookup("k1") is None and ring.table.lookup("k2").name == "b"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_requests_per_minute_bucket_and_retry_after():
    clock = Clock()
    gate, t = QuotaGate(clock), Tenant("a", requests_per_minute=2)
    assert gate.admit(t) is None and gate.admit(t) is None
    assert gate.admit(t) == ("requests_per_minute", 30)  # one request every 30 s
    clock.t += 30
    assert gate.admit(t) is None
    assert gate.usage["a"].refused["requests_per_minute"] == 1


def test_tokens_per_minute_is_charged_at_the_end_and_may_go_negative():
    clock = Clock()
    gate, t = QuotaGate(clock), Tenant("a", tokens_per_minute=60)
    assert gate.admit(t) is None
    gate.finish(t, 90)  # 30 tokens into debt
    assert gate.admit(t) == ("tokens_per_minute", 31)  # back above zero after 31 s
    clock.t += 31
    assert gate.admit(t) is None


def test_max_concurrent_and_a_limit_changed_on_reload():
    gate = QuotaGate(Clock())
    t = Tenant("a", max_concurrent=1)
    assert gate.admit(t) is None
    assert gate.admit(t) == ("max_concurrent", 1)
    gate.finish(t, 0)
    assert gate.admit(t) is None
    assert gate.admit(Tenant("a", max_concurrent=2)) is None  # the reloaded limit applies


def test_usage_is_charged_before_the_answer_leaves():
    """A client that reads a whole answer and asks again at once must meet the drawn-down
    bucket: the middleware charges before the body is sent, not after the app returns."""
    import asyncio

    from loraserve.server.quotas import QuotaMiddleware, record_usage

    t = Tenant("a", tokens_per_minute=40)
    gate = QuotaGate(Clock())
    seen = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        record_usage(scope, 63)
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):
        seen.append((message["type"], gate.usage["a"].tokens))

    scope = {"type": "http", "path": "/v1/completions", "state": {"tenant": t}}
    asyncio.run(QuotaMiddleware(app, gate)(scope, None, send))
    assert seen == [("http.response.start", 0), ("http.response.body", 63)]
    assert gate.usage["a"].in_flight == 0 and gate.admit(t)[0] == "tokens_per_minute"


def test_the_replica_bridge_reports_usage_before_the_last_bytes():
    import asyncio

    from loraserve.cluster.asgi_bridge import HttpRequest, HttpUsage, stream_app
    from loraserve.server.quotas import record_usage

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        record_usage(scope, 7)
        await send({"type": "http.response.body", "body": b"answer"})

    async def items():
        return [x async for x in stream_app(app, HttpRequest("POST", "/v1/completions"))]

    out = asyncio.run(items())
    assert out[1:] == [HttpUsage(7), b"answer"]

"""The cluster's pieces that need no running Ray: merging the replicas' model lists
and metrics, the routers' ranking, the in-process ASGI bridge, the `serve run` args, and that
the single-server path never imports ray."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
from collections import namedtuple
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

pytest.importorskip("ray.serve", reason="the cluster extra: pip install loraserve[cluster]")

from loraserve.cluster.aggregate import merge_cards, relabel_metrics  # noqa: E402
from loraserve.cluster.asgi_bridge import HttpHead, HttpRequest, call_app, stream_app  # noqa
from loraserve.cluster.registry import AdapterRegistry, RegistryEntry  # noqa: E402
from loraserve.cluster.routing import (  # noqa: E402
    AdapterAffinityRouter,
    RoundRobinRouter,
    routing_key,
)


def test_metrics_get_a_replica_label_and_each_family_once():
    a = ("# HELP x_total X\n# TYPE x_total counter\nx_total{adapter=\"s\"} 1.0\n"
         "# HELP y Y\n# TYPE y gauge\ny 2.0\n")
    b = a.replace("1.0", "3.0").replace("2.0", "4.0")
    out = relabel_metrics({"r1": a, "r2": b}, "z 1\n").splitlines()
    assert out == ["# HELP x_total X", "# TYPE x_total counter",
                   'x_total{replica="r1",adapter="s"} 1.0',
                   'x_total{replica="r2",adapter="s"} 3.0',
                   "# HELP y Y", "# TYPE y gauge", 'y{replica="r1"} 2.0', 'y{replica="r2"} 4.0',
                   "z 1"]


def test_model_cards_merge_with_per_replica_residency():
    def card(mid, tier, parent="m", **kw):
        return {"id": mid, "parent": parent, "tier": tier, "pinned": False, "root": mid, **kw}

    merged = merge_cards({
        "r1": [card("m", "device", None), card("b", "disk", in_flight=1, waiting=1,
                                                    rank=None)],
        "r2": [card("m", "device", None), card("b", "host", in_flight=2, waiting=0, rank=8),
               card("a", "disk")]})
    assert [c["id"] for c in merged] == ["m", "a", "b"]  # the base model first
    b = merged[2]
    # best tier; requests summed
    assert (b["tier"], b["in_flight"], b["waiting"], b["rank"]) == ("host", 3, 1, 8)
    assert b["replicas"] == [
        {"replica": "r1", "tier": "disk", "pinned": False, "in_flight": 1, "waiting": 1},
        {"replica": "r2", "tier": "host", "pinned": False, "in_flight": 2, "waiting": 0}]
    assert [r["replica"] for r in merged[1]["replicas"]] == ["r2"]


def test_routing_key():
    base = frozenset({"tiny", "/models/tiny"})
    assert routing_key("tiny", base) == "" and routing_key(None, base) == ""
    assert routing_key("sql", base) == "sql"
    assert routing_key("tiny:sql", base) == "sql"
    assert routing_key("other:sql", base) == ""  # the replica's app answers 404
    assert routing_key(["not", "a", "str"], base) == ""


ReplicaID = namedtuple("ReplicaID", "unique_id")  # hashable, as Ray's is


def _replica(rid, models=()):
    return SimpleNamespace(replica_id=ReplicaID(rid), multiplexed_model_ids=set(models),
                           max_ongoing_requests=64)


def _pending(adapter="", target=None):
    kwargs = {"target": target} if target else {}
    return SimpleNamespace(kwargs=kwargs, metadata=SimpleNamespace(multiplexed_model_id=adapter),
                           routing_context=SimpleNamespace(should_backoff=False))


def _router(cls, **state):
    from ray.serve._private.request_router.common import ReplicaQueueLengthCache

    router = cls.__new__(cls)  # the routing policy only: no Ray router machinery
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router.imbalance_threshold, router._sent = 4, {}
    router.__dict__.update(state)
    return router


def test_affinity_prefers_holders_then_everyone_and_follows_its_own_decisions():
    r1, r2, r3 = _replica("r1", {"sql"}), _replica("r2"), _replica("r3")
    router = _router(AdapterAffinityRouter)
    assert router.rank([r1, r2, r3], "sql") == [[r1], [r2, r3]]
    assert router.rank([r1, r2, r3], "chat") == [[r1, r2, r3]]  # nobody holds it
    assert router.rank([r1, r2, r3], "") == [[r1, r2, r3]]  # base model: least loaded
    router.on_request_routed(_pending("chat"), r3.replica_id, None)  # before Ray's report
    assert router.rank([r1, r2, r3], "chat") == [[r3], [r1, r2]]
    cache = router.replica_queue_len_cache
    for r, n in ((r1, 9), (r2, 1), (r3, 0)):
        cache.update(r.replica_id, n)
    assert router.rank([r1, r2, r3], "sql") == [[r1, r2, r3]]  # r1 too busy: no claim
    pending = _pending("sql", target="r2")
    ranks = asyncio.run(router.choose_replicas([r1, r2, r3], pending))
    assert ranks == [[r2]] and pending.routing_context.should_backoff


def test_round_robin_takes_turns_whatever_the_adapter():
    r1, r2 = _replica("r1", {"sql"}), _replica("r2")
    router = _router(RoundRobinRouter, _turn=itertools.count())
    firsts = [router.rank([r2, r1], "sql")[0][0].replica_id.unique_id for _ in range(4)]
    assert firsts == ["r1", "r2", "r1", "r2"]


def test_registry_versions_and_entries():
    reg = AdapterRegistry(seed=(("a", "/p/a"),))
    s0 = reg.state()
    assert s0.entries == {"a": RegistryEntry("/p/a")} and s0.at.version == 0
    at = reg.put("b", RegistryEntry("/p/b", pinned=True))
    assert at.version == 1 and at.covers(s0.at) and not s0.at.covers(at)
    assert reg.remove("a").version == 2 and set(reg.state().entries) == {"b"}
    other = AdapterRegistry()  # a restarted registry: another epoch, never "newer"
    assert not other.state().at.covers(at)
    # version numbers per name: seeded ones are 1, each reservation is new, even if refused
    assert [reg.reserve_version("a"), reg.reserve_version("a"), reg.reserve_version("c")] == \
        [2, 3, 1]


def test_asgi_bridge_streams_and_a_hang_up_cancels_the_handler():
    app, seen = FastAPI(), {}

    @app.post("/echo")
    async def echo(request: Request):
        return {"body": (await request.body()).decode(), "q": request.url.query}

    @app.get("/forever")
    async def forever():
        async def gen():
            try:
                while True:
                    yield b"tick\n"
                    await asyncio.sleep(0.01)
            finally:
                seen["closed"] = True
        return StreamingResponse(gen(), media_type="text/event-stream")

    async def run():
        reply = await call_app(app, HttpRequest("POST", "/echo", b"x=1", body=b"hi"))
        assert reply.ok and reply.body == b'{"body":"hi","q":"x=1"}'
        stream = stream_app(app, HttpRequest("GET", "/forever"))
        head = await anext(stream)
        assert isinstance(head, HttpHead) and head.status == 200
        assert await anext(stream) == b"tick\n"
        await stream.aclose()  # the client hung up
        await asyncio.sleep(0.05)
        missing = await call_app(app, HttpRequest("GET", "/nope"))
        assert missing.status == 404

    asyncio.run(run())
    assert seen.get("closed")


def test_serve_run_args_become_a_spec():
    from loraserve.cluster.app import spec_from_args

    spec = spec_from_args({"model": "/m", "replicas": "3", "max-loaded-loras": "8",
                           "allow-runtime-lora-updates": "true", "routing": "round_robin",
                           "lora-paths": "a=/x b=/y", "max-model-len": "none"})
    assert (spec.cluster.replicas, spec.cluster.routing) == (3, "round_robin")
    assert spec.engine.max_loaded_loras == 8 and spec.engine.max_model_len is None
    assert spec.settings.allow_runtime_lora_updates and spec.settings.served_model_names == (
        "/m",)
    assert spec.adapters == (("a", "/x"), ("b", "/y"))
    assert spec_from_args({"lora_paths": {"a": "/x"}}).adapters == (("a", "/x"),)
    assert spec_from_args({"shutdown-timeout": "2.5"}).shutdown_timeout_s == 2.5
    with pytest.raises(ValueError, match="unknown"):
        spec_from_args({"no-such-flag": "1"})
    with pytest.raises(ValueError, match="replicas"):
        spec_from_args({"replicas": "0"})


def test_single_server_path_never_imports_ray():
    code = ("import sys\n"
            "from loraserve.cli import build_parser, cluster_config_from_args\n"
            "import loraserve.server.app, loraserve.engine.async_engine\n"
            "args = build_parser().parse_args(['serve', '--max-loaded-loras', '4'])\n"
            "assert not cluster_config_from_args(args).enabled\n"
            "assert 'ray' not in sys.modules, 'ray imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_replicas_flag_is_a_usage_error(capsys):
    from loraserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--replicas", "0", "--port", "0"])
    assert e.value.code == 2 and "replicas must be >= 1" in capsys.readouterr().err


def test_replica_catches_up_with_the_registry_and_survives_its_restart():
    from loraserve.cluster.registry import EMPTY, RegistryState, RegistryVersion
    from loraserve.cluster.replica import EngineReplica
    from loraserve.cluster.spec import ClusterSpec

    calls, states = [], []

    class Engine:  # records what the replica asks of its engine
        live: dict[str, int] = {}

        async def snapshot(self):
            return SimpleNamespace(adapters=[SimpleNamespace(name=n, version=v, registered=True)
                                             for n, v in self.live.items()])

        async def load_lora_adapter(self, name, path, pinned=False, root=None, replace=False,
                                    version=None):
            calls.append(("load", name, path, pinned, version))
            self.live[name] = version or self.live[name]

        async def unload_lora_adapter(self, name):
            calls.append(("unload", name))
            self.live.pop(name)

        def shutdown(self):
            pass

    async def state():
        calls.append(("pull",))
        return states[-1]

    rep = EngineReplica.__new__(EngineReplica)  # the sync logic only: no Ray, no model
    rep.aengine, rep.spec, rep.replica_id = Engine(), ClusterSpec(), "r1"
    rep.registry = SimpleNamespace(state=SimpleNamespace(remote=state))
    rep.names, rep.synced, rep._old_epochs, rep._lock = set(), EMPTY, set(), None

    def at(epoch, v):
        return RegistryVersion(epoch, v)

    async def run():
        rep._lock = asyncio.Lock()
        states.append(RegistryState(at("A", 0), {"a": RegistryEntry("/a"),
                                                 "b": RegistryEntry("/b")}))
        await rep.sync(None, strict=True)  # start-up replay
        await rep.sync(at("A", 0))  # up to date: no pull
        states.append(RegistryState(at("A", 2), {"a": RegistryEntry("/a", pinned=True)}))
        await rep.sync(at("A", 2))  # behind: b unloaded, a pinned
        states.append(RegistryState(at("A", 3), {"a": RegistryEntry("/a2", True, 2)}))
        await rep.sync(at("A", 3))  # a replaced: version 2 under the same number
        states.append(RegistryState(at("B", 0), {}))  # the registry restarted, empty
        await rep.sync(at("A", 4))  # the ingress's old epoch: pull once, unload nothing
        await rep.sync(at("A", 4))

    asyncio.run(run())
    assert calls == [("pull",), ("load", "a", "/a", False, 1), ("load", "b", "/b", False, 1),
                     ("pull",), ("unload", "b"), ("load", "a", "/a", True, None),
                     ("pull",), ("load", "a", "/a2", True, 2), ("pull",)]
    assert rep.names == {"a"}

"""The prefix cache and forks through the real server: cached tokens in `usage`, the
Prometheus counters per adapter, n > 1 forking from one prefill, and --disable-prefix-cache."""

from __future__ import annotations

import re

import pytest
from lora_reference import LIFECYCLE_ADAPTERS, make_adapters
from server_utils import ServerProcess

PROMPT = [(7 * i) % 480 + 20 for i in range(42)]  # 10 full blocks of 4, and 2 tokens


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_http")
    return make_adapters(tiny_model_dir, root, {"a": LIFECYCLE_ADAPTERS["a"]})["a"]


def start(model_dir, adapter_dir, tmp_path_factory, *extra) -> ServerProcess:
    return ServerProcess(model_dir, "--block-size", "4", "--lora-paths", f"a={adapter_dir}",
                         *extra, log_dir=tmp_path_factory.mktemp("logs")).wait_ready()


def counter(server, name: str, adapter: str) -> float:
    text = server.get("/metrics").text
    m = re.search(rf'^{name}_total{{adapter="{re.escape(adapter)}"}} (\S+)$', text, re.M)
    assert m, f"{name} for {adapter} not in /metrics"
    return float(m.group(1))


def test_cached_tokens_counters_and_forks(tiny_model_dir, adapter_dir, tmp_path_factory):
    server = start(tiny_model_dir, adapter_dir, tmp_path_factory)
    try:
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                "ignore_eos": True}
        first = server.post("/v1/completions", body).json()
        second = server.post("/v1/completions", body).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert counter(server, "loraserve_prefix_cache_queries", "a") == 84
        assert counter(server, "loraserve_prefix_cache_hits", "a") == 40
        # n = 3 on a new prompt: choice 0 computes it, the two others fork (41 tokens each)
        fresh = [t + 1 for t in PROMPT]
        r = server.post("/v1/completions", {**body, "prompt": fresh, "n": 3, "seed": 1,
                                            "temperature": 0.9}).json()
        assert len(r["choices"]) == 3 and r["usage"]["prompt_tokens"] == 42
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert counter(server, "loraserve_prefix_cache_hits", "a") == 40 + 2 * 41
        base = server.get("/v1/models").json()["data"][0]["id"]
        client = server.openai()
        out = client.completions.create(model=base, prompt=PROMPT, max_tokens=2)
        out = client.completions.create(model=base, prompt=PROMPT, max_tokens=2)
        assert out.usage.prompt_tokens_details.cached_tokens == 40  # base: its own namespace
        assert counter(server, "loraserve_prefix_cache_hits", base) == 40
        chat = dict(model="a", messages=[{"role": "user", "content": "hi " * 30}], max_tokens=2,
                    stream=True, stream_options={"include_usage": True})
        cold, warm = (list(client.chat.completions.create(**chat))[-1] for _ in range(2))
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.usage.prompt_tokens_details.cached_tokens > 0
        state = server.wait_idle()
        assert state["kv_blocks_used"] == 0
    finally:
        server.stop()


def test_disable_prefix_cache_flag(tiny_model_dir, adapter_dir, tmp_path_factory):
    server = start(tiny_model_dir, adapter_dir, tmp_path_factory, "--disable-prefix-cache")
    try:
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        for _ in range(2):
            r = server.post("/v1/completions", body).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert counter(server, "loraserve_prefix_cache_hits", "a") == 0
    finally:
        server.stop()

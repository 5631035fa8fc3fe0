"""Prometheus metrics on a private registry.

Engine-wide and per-adapter gauges/counters are rebuilt from an engine snapshot at each scrape
(a custom collector), so the adapter label only ever takes registered names and an unloaded
adapter's series disappear. Latency histograms are observed by the request handlers.
Idle-but-resident adapters keep their series (routers rely on them). An adapter's newest
version is labelled with its name and older live versions as `name@N`, the ids /v1/models
lists; `loraserve_adapter_version` gives the number each name means now.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraserve.adapters.versions import label
from loraserve.engine.messages import EngineSnapshot
from loraserve.types import RequestOutput

TIERS = {"disk": 0, "host": 1, "device": 2}
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("loraserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("loraserve_inter_token_latency_seconds", "Time between tokens",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("loraserve_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY, registry=r)
        self.finished = Counter("loraserve_requests_finished", "Finished requests by reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("loraserve_prompt_tokens", "Prompt tokens", registry=r)
        self.output_tokens = Counter("loraserve_generation_tokens", "Generated tokens",
                                     registry=r)
        self.adapter_tokens = Counter("loraserve_adapter_generation_tokens",
                                      "Generated tokens per adapter", ["adapter"], registry=r)
        self.load_seconds = Histogram("loraserve_adapter_load_seconds",
                                      "Adapter load latency (read + validate), per adapter",
                                      ["adapter"], buckets=_LATENCY, registry=r)
        self._snap: EngineSnapshot | None = None
        self._seen_loads: dict[int, tuple[int, float]] = {}  # uid -> (loads, total seconds)
        self._labelled: set[str] = set()  # adapter names with series in the metrics above
        self._last_load: dict[str, float] = {}  # adapter -> seconds of its latest load seen
        r.register(_SnapshotCollector(self))

    # --- from the handlers ------------------------------------------------------------------
    def observe_load(self, adapter: str, seconds: float) -> None:
        self._labelled.add(adapter)
        self.load_seconds.labels(adapter).observe(seconds)
        self._last_load[adapter] = seconds

    def count_adapter_tokens(self, adapter: str, n: int) -> None:
        self._labelled.add(adapter)
        self.adapter_tokens.labels(adapter).inc(n)

    def render(self, snapshot: EngineSnapshot) -> bytes:
        self._update(snapshot)
        return generate_latest(self.registry)

    def _update(self, snap: EngineSnapshot) -> None:
        self._snap = snap
        live = {a.name for a in snap.adapters if a.registered}
        seen = {}
        for a in snap.adapters:
            loads, total = a.stats.loads, a.stats.total_load_seconds
            old_loads, old_total = self._seen_loads.get(a.uid, (loads, total))
            if loads > old_loads and a.registered:  # background reloads since last scrape
                avg = (total - old_total) / (loads - old_loads)
                for _ in range(loads - old_loads):
                    self.observe_load(a.name, avg)
            seen[a.uid] = (loads, total)
        self._seen_loads = seen
        for name in self._labelled - live:  # bounded cardinality: only registered adapters
            for metric in (self.adapter_tokens, self.load_seconds):
                try:
                    metric.remove(name)
                except KeyError:
                    pass
        self._labelled &= live
        self._last_load = {k: v for k, v in self._last_load.items() if k in live}


class RequestTimer:
    """Per-request latency bookkeeping: feed it every output of one sequence."""

    def __init__(self, metrics: ServerMetrics, lora_name: str | None):
        self.m, self.lora = metrics, lora_name
        self.t0 = self.last = time.monotonic()
        self.n = 0

    def on_output(self, out: RequestOutput) -> None:
        new = len(out.token_ids) - self.n
        if new > 0:
            now = time.monotonic()
            if self.n == 0:
                self.m.ttft.observe(now - self.t0)
            else:
                for _ in range(new):
                    self.m.itl.observe((now - self.last) / new)
            self.n, self.last = len(out.token_ids), now
        if out.finished:
            self.m.e2e.observe(time.monotonic() - self.t0)
            reason = out.finish_reason.value if out.finish_reason else "unknown"
            self.m.finished.labels(reason).inc()
            self.m.prompt_tokens.inc(out.num_prompt_tokens)
            self.m.output_tokens.inc(self.n)
            if self.lora and self.n:
                self.m.count_adapter_tokens(self.lora, self.n)


class _SnapshotCollector:
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []  # values exist only at scrape time

    def collect(self):
        snap = self.m._snap
        if snap is None:
            return
        yield _gauge("loraserve_num_requests_running", "Requests running", snap.running)
        yield _gauge("loraserve_num_requests_waiting", "Requests waiting", snap.waiting)
        yield _gauge("loraserve_num_requests_paused",
                     "Requests paused: their client does not read their stream", snap.paused)
        yield _gauge("loraserve_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                     snap.kv_usage)
        yield _gauge("loraserve_kv_cache_blocks_used", "KV blocks in use", snap.kv_blocks_used)
        yield _gauge("loraserve_kv_cache_blocks_total", "KV blocks", snap.kv_blocks_total)
        live = [a for a in snap.adapters if a.registered]
        yield _gauge("loraserve_adapters_registered", "Registered adapters", len(live))
        per = {
            "tier": GaugeMetricFamily("loraserve_adapter_tier",
                                      "Where the adapter's weights are: 0 disk, 1 host, 2 device",
                                      labels=["adapter"]),
            "pinned": GaugeMetricFamily("loraserve_adapter_pinned", "1 if pinned",
                                        labels=["adapter"]),
            "last_load": GaugeMetricFamily(
                "loraserve_adapter_last_load_seconds",
                "How long its latest load took (through the API: read, validate, commit)",
                labels=["adapter"]),
            "in_flight": GaugeMetricFamily("loraserve_adapter_requests_in_flight",
                                           "Requests holding the adapter", labels=["adapter"]),
            "waiting": GaugeMetricFamily("loraserve_adapter_requests_waiting",
                                         "Of those, requests waiting in the queue",
                                         labels=["adapter"]),
            "requests": CounterMetricFamily("loraserve_adapter_requests",
                                            "Requests admitted", labels=["adapter"]),
            "host_hits": CounterMetricFamily("loraserve_adapter_host_hits",
                                             "Requests that found it in host memory on arrival",
                                             labels=["adapter"]),
            "loads": CounterMetricFamily("loraserve_adapter_loads",
                                         "Loads into host memory (first load included)",
                                         labels=["adapter"]),
            "host_evictions": CounterMetricFamily("loraserve_adapter_host_evictions",
                                                  "Evictions from host memory",
                                                  labels=["adapter"]),
            "slot_evictions": CounterMetricFamily("loraserve_adapter_slot_evictions",
                                                  "Evictions from compute slots",
                                                  labels=["adapter"]),
        }
        yield _gauge("loraserve_kv_cache_blocks_cached", "Full KV blocks the prefix cache "
                     "indexes (held or reusable)", snap.kv_blocks_cached)
        # in tokens; the base model's requests under its own name (no adapter may take it)
        prefix = {
            "prefix_queries": CounterMetricFamily(
                "loraserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                labels=["adapter"]),
            "prefix_hits": CounterMetricFamily(
                "loraserve_prefix_cache_hits", "Prompt tokens whose K/V were reused",
                labels=["adapter"]),
        }
        prefix["prefix_queries"].add_metric([snap.model_name], snap.base_prefix_queries)
        prefix["prefix_hits"].add_metric([snap.model_name], snap.base_prefix_hits)
        version = GaugeMetricFamily("loraserve_adapter_version",
                                    "The version (name@N) the adapter's name means now",
                                    labels=["adapter"])
        newest = {}
        for a in live:
            newest[a.name] = max(a.version, newest.get(a.name, 0))
        for name, number in newest.items():
            version.add_metric([name], number)
        yield version
        for a in live:
            name = [a.name if a.version == newest[a.name] else label(a.name, a.version)]
            per["tier"].add_metric(name, TIERS[a.tier])
            per["pinned"].add_metric(name, int(a.pinned))
            per["in_flight"].add_metric(name, a.refcount)
            per["waiting"].add_metric(name, a.waiting)
            if a.version == newest[a.name] and a.name in self.m._last_load:
                per["last_load"].add_metric(name, self.m._last_load[a.name])
            elif a.stats.last_load_seconds:  # read by the engine (start-up, reloads)
                per["last_load"].add_metric(name, a.stats.last_load_seconds)
            for key in ("requests", "host_hits", "loads", "host_evictions", "slot_evictions"):
                per[key].add_metric(name, getattr(a.stats, key))
            for key, family in prefix.items():
                family.add_metric(name, getattr(a.stats, key))
        yield from per.values()
        yield from prefix.values()


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)

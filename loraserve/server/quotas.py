"""Per-tenant limits on completions, checked before the body is read; over a limit: 429 with
Retry-After.

- `max_concurrent`: completions of the tenant in progress at once (a stream counts until its
  last byte).
- `requests_per_minute`: a token bucket of that many requests, refilled continuously.
- `tokens_per_minute`: a bucket of that many tokens (prompt + generated), refilled
  continuously. A request is admitted while the bucket is not empty and is charged what it
  used when it ends, so one long request may take the bucket below zero; the next waits until
  it refills (its Retry-After says when).

On replicas the gate runs at the ingress only, so the limits hold for the whole deployment;
the replica that served a request reports what it used back with the answer.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Receive, Scope, Send

from loraserve.server.api_keys import LIMITS, KeyRing, Tenant
from loraserve.server.errors import error_bytes

QUOTA_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
USAGE_KEY = "usage_tokens"  # scope["state"] entry: the tokens a request used (prompt + output)


@dataclass
class _Bucket:
    per_minute: int
    level: float
    at: float

    def refill(self, now: float) -> float:
        rate = self.per_minute / 60.0
        self.level = min(float(self.per_minute), self.level + (now - self.at) * rate)
        self.at = now
        return rate


@dataclass
class TenantUsage:
    in_flight: int = 0
    requests: int = 0
    tokens: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LIMITS, 0))
    buckets: dict[str, _Bucket] = field(default_factory=dict)


class QuotaGate:
    """Every tenant's usage; thread-safe (the ingress and tests call it from one loop, the
    metrics collector from another thread)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.usage: dict[str, TenantUsage] = {}

    def admit(self, t: Tenant) -> tuple[str, int] | None:
        """None when admitted (then `finish` must follow), else (the limit, Retry-After s)."""
        with self._lock:
            now = self._clock()
            u = self.usage.setdefault(t.name, TenantUsage())
            rpm, tpm = self._bucket(u, t, "requests_per_minute", now), \
                self._bucket(u, t, "tokens_per_minute", now)
            refusal = None
            if t.max_concurrent is not None and u.in_flight >= t.max_concurrent:
                refusal = ("max_concurrent", 1)
            elif rpm is not None and rpm.level < 1:
                refusal = ("requests_per_minute", _wait(1 - rpm.level, rpm.per_minute))
            elif tpm is not None and tpm.level <= 0:
                refusal = ("tokens_per_minute", _wait(1 - tpm.level, tpm.per_minute))
            if refusal is not None:
                u.refused[refusal[0]] += 1
                return refusal
            if rpm is not None:
                rpm.level -= 1
            u.in_flight += 1
            u.requests += 1
            return None

    def finish(self, t: Tenant, tokens: int) -> None:
        with self._lock:
            u = self.usage.setdefault(t.name, TenantUsage())
            u.in_flight = max(0, u.in_flight - 1)
            u.tokens += tokens
            tpm = self._bucket(u, t, "tokens_per_minute", self._clock())
            if tpm is not None:
                tpm.level -= tokens

    def _bucket(self, u: TenantUsage, t: Tenant, which: str, now: float) -> _Bucket | None:
        limit = t.limit(which)
        if limit is None:
            u.buckets.pop(which, None)
            return None
        b = u.buckets.get(which)
        if b is None or b.per_minute != limit:  # new, or the limit changed on reload
            b = u.buckets[which] = _Bucket(limit, float(limit) if b is None else
                                           min(b.level, float(limit)), now)
        b.refill(now)
        return b

    def forget_missing(self, names: set[str]) -> None:
        """Tenants gone from the keys file lose their series (bounded label values)."""
        with self._lock:
            for name in list(self.usage):
                if name not in names and self.usage[name].in_flight == 0:
                    del self.usage[name]


def _wait(missing: float, per_minute: int) -> int:
    return max(1, math.ceil(missing * 60.0 / per_minute))


class QuotaMiddleware:
    """Counts a tenant's completions against its limits (the gate), outermost after auth."""

    def __init__(self, app: ASGIApp, gate: QuotaGate):
        self.app, self.gate = app, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = scope.get("state", {}).get("tenant") if scope["type"] == "http" else None
        if tenant is None or (scope["path"].rstrip("/") or "/") not in QUOTA_PATHS:
            return await self.app(scope, receive, send)
        refusal = self.gate.admit(tenant)
        if refusal is not None:
            which, retry = refusal
            message = (f"tenant {tenant.name!r} is over its {which} limit "
                       f"({tenant.limit(which)}); retry after {retry} s")
            await send({"type": "http.response.start", "status": 429,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"retry-after", str(retry).encode())]})
            await send({"type": "http.response.body",
                        "body": error_bytes(429, message, f"rate_limit_{which}")})
            return
        charged = False

        def charge() -> None:
            nonlocal charged
            if not charged:
                charged = True
                self.gate.finish(tenant, int(scope["state"].get(USAGE_KEY, 0)))

        async def send_charging(message: dict) -> None:
            # Charge before the answer's bytes go out: a client that reads the whole answer and
            # asks again at once must meet the bucket already drawn down.
            if message["type"] == "http.response.body" and USAGE_KEY in scope["state"]:
                charge()
            await send(message)

        try:
            await self.app(scope, receive, send_charging)
        finally:
            charge()


def record_usage(scope: Scope, tokens: int) -> None:
    scope.setdefault("state", {})[USAGE_KEY] = tokens


class TenantCollector:
    """Limits and usage per tenant for /metrics; the label values are the keys file's names."""

    def __init__(self, gate: QuotaGate, ring: KeyRing):
        self.gate, self.ring = gate, ring

    def describe(self):
        return []

    def collect(self):
        tenants = self.ring.table.tenants
        self.gate.forget_missing(set(tenants))
        limit = GaugeMetricFamily("loraserve_tenant_limit", "A tenant's configured limit "
                                  "(absent: none)", labels=["tenant", "limit"])
        flight = GaugeMetricFamily("loraserve_tenant_requests_in_flight",
                                   "Completions of the tenant in progress", labels=["tenant"])
        reqs = CounterMetricFamily("loraserve_tenant_requests", "Completions admitted",
                                   labels=["tenant"])
        toks = CounterMetricFamily("loraserve_tenant_tokens", "Tokens used (prompt + "
                                   "generated)", labels=["tenant"])
        refused = CounterMetricFamily("loraserve_tenant_rate_limited", "Completions refused "
                                      "with a 429, by limit", labels=["tenant", "limit"])
        for name, t in sorted(tenants.items()):
            u = self.gate.usage.get(name) or TenantUsage()
            for which in LIMITS:
                if t.limit(which) is not None:
                    limit.add_metric([name, which], t.limit(which))
                refused.add_metric([name, which], u.refused[which])
            flight.add_metric([name], u.in_flight)
            reqs.add_metric([name], u.requests)
            toks.add_metric([name], u.tokens)
        yield from (limit, flight, reqs, toks, refused)

"""Per-adapter counters, read by /metrics and /v1/models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdapterStats:
    requests: int = 0
    host_hits: int = 0  # requests that found it in host memory when they arrived
    loads: int = 1  # the registration itself is the first load
    host_evictions: int = 0
    slot_evictions: int = 0
    last_load_seconds: float = 0.0
    total_load_seconds: float = 0.0
    prefix_queries: int = 0  # prompt tokens of its requests (at their first admission)
    prefix_hits: int = 0  # of those, tokens whose K/V came from the prefix cache or a fork

    def record_load(self, seconds: float) -> None:
        self.loads += 1
        self.last_load_seconds = seconds
        self.total_load_seconds += seconds

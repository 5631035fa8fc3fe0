"""One registered adapter's record in the store, and the read-only view others get of it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.stats import AdapterStats


@dataclass
class AdapterEntry:
    """Owned by the AdapterStore; nobody else changes it."""

    uid: int
    name: str
    path: str
    fingerprint: str  # content hash of the weights registered under this uid
    pinned: bool = False
    weights: LoraAdapterWeights | None = None  # host tier
    slot: int | None = None  # compute tier
    refcount: int = 0  # requests admitted and not yet ended
    unloading: bool = False  # unregistered; freed when refcount reaches 0
    last_error: str | None = None  # the last failed background load, for operators
    last_used: int = 0  # LRU tick
    prefetched: bool = False  # brought in ahead of use and not used since: evicted first
    stats: AdapterStats = field(default_factory=AdapterStats)
    version: int = 1  # the name's load count when this uid was minted (adapters/versions.py)
    owned: bool = False  # `path` is the store's own copy (spill directory): removed with it

    @property
    def tier(self) -> str:
        return "device" if self.slot is not None else "host" if self.weights else "disk"

    def public_error(self, err: str) -> str:
        """A load error as clients see it: it names the adapter, not the server's directories."""
        for p in {self.path, os.path.realpath(self.path)}:
            err = err.replace(f"adapter {p}: ", "").replace(p, f"<{self.name}>")
        return err

    def snapshot(self, tier: str | None = None) -> AdapterSnapshot:
        """This adapter now; `tier`: as the store's residency policy names it (default:
        where its weights are)."""
        return AdapterSnapshot(
            name=self.name, uid=self.uid, path=self.path, tier=tier or self.tier,
            pinned=self.pinned, refcount=self.refcount, registered=not self.unloading,
            last_error=self.last_error,
            rank=self.weights.rank if self.weights is not None else None,
            fingerprint=self.fingerprint, stats=replace(self.stats), version=self.version)


@dataclass(frozen=True)
class AdapterSnapshot:
    """An adapter as /v1/models, /metrics and tests see it at one moment between steps."""

    name: str
    uid: int
    path: str
    tier: str  # "disk", "host" or "device"
    pinned: bool
    refcount: int
    registered: bool  # False while an unloaded adapter drains its last requests
    last_error: str | None
    rank: int | None  # None while its weights are on disk only
    fingerprint: str
    stats: AdapterStats
    version: int = 1  # `name@version` names exactly these weights
    waiting: int = 0  # of the requests holding it (refcount), those queued (the engine's count)

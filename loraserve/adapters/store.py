"""AdapterStore: the single authority on adapter identity and residency.

Tiers: registered (disk path) -> host memory (weights, at most `max_loaded_loras`, LRU) ->
compute slots (`num_slots`, LRU). Invariants (DESIGN.md §3):
- every load mints a fresh uid; names resolve to uids once, at admission (`acquire`);
- host keeps a superset of the slots: losing host weights frees the slot too;
- pinned adapters and adapters of running requests are never evicted implicitly;
- refcounts are acquired at admission and released exactly once (`release`); an unloaded
  adapter is unregistered at once and freed when its last request ends;
- a failed load changes nothing (validation happens before `register` commits).
Only the engine thread calls these methods; disk reads run on HostLoader's workers.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field

from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.host_cache import HostLoader
from loraserve.adapters.slot_pool import LoraSlotPool
from loraserve.adapters.stats import AdapterStats
from loraserve.scheduler.batch import AdapterState
from loraserve.types import (
    ADAPTER_NAME_RE,
    AdapterConflictError,
    AdapterNotFoundError,
    LoraServeError,
)

log = logging.getLogger("loraserve.adapters")


@dataclass
class AdapterEntry:
    uid: int
    name: str
    path: str
    pinned: bool = False
    weights: LoraAdapterWeights | None = None  # host tier
    slot: int | None = None  # compute tier
    refcount: int = 0  # requests admitted and not yet ended
    unloading: bool = False  # unregistered; freed when refcount reaches 0
    error: str | None = None  # last failed background load
    last_used: int = 0  # LRU tick
    fingerprint: str = ""  # content hash of the weights registered under this uid
    prefetched: bool = False  # brought in ahead of use and not used since: evicted first
    stats: AdapterStats = field(default_factory=AdapterStats)

    @property
    def tier(self) -> str:
        return "device" if self.slot is not None else "host" if self.weights else "disk"


class AdapterStore:
    def __init__(self, slot_pool: LoraSlotPool, loader: HostLoader, *, max_loras_per_batch: int,
                 max_loaded_loras: int | None):
        self.slots = slot_pool
        self.loader = loader
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded = max_loaded_loras
        self.names: dict[str, int] = {}  # registered names only
        self.entries: dict[int, AdapterEntry] = {}  # registered + draining
        self.slot_owner: list[int | None] = [None] * slot_pool.num_slots
        self._uids = itertools.count(1)
        self._tick = itertools.count(1)
        self.running_uids: set[int] = set()  # set by the engine each step: never evicted

    # --- registration -----------------------------------------------------------------------
    @staticmethod
    def check_name(name: str) -> None:
        if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
            raise LoraServeError(
                f"invalid adapter name {name!r}: use 1-64 of [A-Za-z0-9._-] (':' is reserved "
                "for 'base:adapter')")

    def check_new(self, name: str, path: str, pinned: bool) -> bool:
        """Validate a load before any I/O. Returns True if it is a no-op (same name and path)."""
        self.check_name(name)
        uid = self.names.get(name)
        existing = self.entries[uid] if uid is not None else None
        if existing is not None and (
                os.path.realpath(existing.path) != os.path.realpath(path)):
            raise AdapterConflictError(
                f"adapter {name!r} is already loaded from {existing.path}; unload it "
                "first to load a different path")
        # Also when pinning an adapter already loaded: too many pins starve every other one.
        newly_pinned = pinned and not (existing is not None and existing.pinned)
        if newly_pinned and self.num_pinned + 1 > self.max_loras_per_batch - 1:
            raise LoraServeError(
                f"cannot pin {name!r}: at most max_loras_per_batch - 1 = "
                f"{self.max_loras_per_batch - 1} adapters may be pinned")
        return existing is not None

    def register(self, name: str, path: str, weights: LoraAdapterWeights,
                 pinned: bool = False) -> AdapterEntry:
        """Commit an adapter whose weights were already read and validated."""
        if self.check_new(name, path, pinned):
            entry = self.entries[self.names[name]]
            entry.pinned = entry.pinned or pinned
            return entry
        if not self.make_host_room(exclude=None):
            raise LoraServeError(
                f"cannot load {name!r}: host memory holds max_loaded_loras={self.max_loaded} "
                "adapters that are all pinned or in use")
        entry = AdapterEntry(uid=next(self._uids), name=name, path=str(path), pinned=pinned)
        entry.weights, entry.fingerprint = weights, weights.fingerprint
        entry.last_used = next(self._tick)
        self.entries[entry.uid] = entry
        self.names[name] = entry.uid
        log.info("adapter %s loaded (uid %d, rank %d, %s)", name, entry.uid, weights.rank, path)
        return entry

    def unregister(self, name: str) -> None:
        uid = self.names.get(name)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        del self.names[name]
        entry = self.entries[uid]
        entry.unloading = True
        log.info("adapter %s unloading (uid %d, %d requests in flight)", name, uid,
                 entry.refcount)
        if entry.refcount == 0:
            self._free(entry)

    def _free(self, entry: AdapterEntry) -> None:
        self.loader.cancel(entry.uid)
        self._drop_slot(entry)
        entry.weights = None
        del self.entries[entry.uid]
        log.info("adapter %s freed (uid %d)", entry.name, entry.uid)

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pinned and not e.unloading)

    # --- refcounts --------------------------------------------------------------------------
    def acquire(self, name: str) -> int:
        uid = self.names.get(name)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        entry = self.entries[uid]
        entry.refcount += 1
        entry.stats.requests += 1
        return uid

    def release(self, uid: int) -> None:
        entry = self.entries[uid]
        if entry.refcount <= 0:
            raise RuntimeError(f"adapter uid {uid} released more often than acquired")
        entry.refcount -= 1
        if entry.unloading and entry.refcount == 0:
            self._free(entry)

    # --- host tier --------------------------------------------------------------------------
    def _host_entries(self) -> list[AdapterEntry]:
        return [e for e in self.entries.values() if e.weights is not None]

    def _evictable(self, e: AdapterEntry, protect: set[int] | frozenset = frozenset()) -> bool:
        return not e.pinned and e.uid not in self.running_uids and e.uid not in protect

    def make_host_room(self, exclude: int | None,
                        protect: set[int] | frozenset = frozenset()) -> bool:
        """Evict LRU host entries until one more fits. False if every one is protected."""
        if self.max_loaded is None:
            return True
        resident = [e for e in self._host_entries() if e.uid != exclude]
        pending = self.loader.num_pending
        while len(resident) + pending >= self.max_loaded:
            victims = [e for e in resident if self._evictable(e, protect)]
            if not victims:
                return False
            victim = min(victims, key=lambda e: (not e.prefetched, e.last_used))
            self._evict_host(victim)
            resident.remove(victim)
        return True

    def _evict_host(self, entry: AdapterEntry) -> None:
        self._drop_slot(entry)
        entry.weights = None
        entry.stats.host_evictions += 1
        log.info("adapter %s evicted from host memory (stays registered)", entry.name)

    def poll_loads(self) -> None:
        """Move finished background loads into the host tier (engine thread, between steps)."""
        for uid, weights, secs, err in self.loader.collect():
            entry = self.entries.get(uid)
            if entry is None:
                continue  # unloaded while loading
            if err is not None:
                entry.error = err
                log.warning("adapter %s failed to load: %s", entry.name, err)
                continue
            if weights.fingerprint != entry.fingerprint:
                # Same uid must mean same weights (uid-keyed caches rely on it).
                entry.error = (f"the files at {entry.path} changed on disk since it was "
                               "loaded; unload and load it again")
                log.warning("adapter %s: %s", entry.name, entry.error)
                continue
            entry.weights, entry.error = weights, None
            entry.stats.record_load(secs)
            log.info("adapter %s reloaded into host memory in %.3fs", entry.name, secs)

    def ensure_host(self, entry: AdapterEntry,
                    protect: set[int] | frozenset = frozenset()) -> AdapterState:
        if entry.weights is not None:
            return AdapterState.READY
        if self.loader.is_loading(entry.uid):
            return AdapterState.LOADING
        if not self.make_host_room(exclude=entry.uid, protect=protect):
            return AdapterState.NO_SLOT
        self.loader.start(entry.uid, entry.path)
        return AdapterState.LOADING

    # --- compute slots ----------------------------------------------------------------------
    def admission(self, uid: int, running_uids: set[int]) -> tuple[AdapterState, str]:
        """Scheduler gate: may a request for `uid` join a batch running `running_uids`?"""
        entry = self.entries.get(uid)
        if entry is None:
            return AdapterState.FAILED, f"adapter uid {uid} is gone"
        if entry.error is not None:
            err, entry.error = entry.error, None  # a later request may retry the load
            return AdapterState.FAILED, f"adapter {entry.name!r} failed to load: {err}"
        # running_uids includes adapters admitted earlier in this same step: keep them.
        state = self.ensure_host(entry, protect=running_uids)
        if state is not AdapterState.READY:
            return state, ""
        pinned = {e.uid for e in self.entries.values() if e.pinned and e.slot is not None}
        if len(running_uids | pinned | {uid}) > self.slots.num_slots:
            return AdapterState.NO_SLOT, ""
        return AdapterState.READY, ""

    def bind(self, uids: set[int]) -> dict[int, int]:
        """Give every adapter of this step a slot (loading weights into it); uid -> slot."""
        self.running_uids = set(uids)
        tick = next(self._tick)
        out = {}
        for uid in uids:
            e = self.entries[uid]
            e.last_used, e.prefetched = tick, False
            if e.slot is None:
                self._assign_slot(e, protected=uids)
            out[uid] = e.slot
        return out

    def _assign_slot(self, entry: AdapterEntry, protected: set[int]) -> None:
        if entry.weights is None:
            raise RuntimeError(f"adapter {entry.name} scheduled without host weights")
        slot = self.pick_slot(protected)
        if slot is None:
            raise RuntimeError("no LoRA slot to evict: admission should have prevented it")
        self.fill_slot(entry, slot)

    def pick_slot(self, protected: set[int]) -> int | None:
        """A free slot, else the LRU slot whose adapter is not protected/pinned (evicted)."""
        free = [s for s, owner in enumerate(self.slot_owner) if owner is None]
        if free:
            return free[0]
        owners = [self.entries[o] for o in self.slot_owner if o is not None]
        victims = [e for e in owners if not e.pinned and e.uid not in protected]
        if not victims:
            return None
        # Prefetched-but-unused adapters go first, then least recently used.
        victim = min(victims, key=lambda e: (not e.prefetched, e.last_used))
        slot = victim.slot
        self._drop_slot(victim)
        victim.stats.slot_evictions += 1
        return slot

    def fill_slot(self, entry: AdapterEntry, slot: int) -> None:
        self.slots.write(slot, entry.weights)  # zeroes the whole slot first
        self.slot_owner[slot] = entry.uid
        entry.slot = slot

    def _drop_slot(self, entry: AdapterEntry) -> None:
        if entry.slot is not None:
            self.slot_owner[entry.slot] = None  # the next write zeroes the whole slot
            entry.slot = None

    # --- views ------------------------------------------------------------------------------
    def registered(self) -> list[AdapterEntry]:
        return [self.entries[u] for u in self.names.values()]

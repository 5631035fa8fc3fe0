"""AdapterStore: the single authority on adapter identity and residency.

Tiers: registered (disk path) -> host memory (weights, at most `max_loaded_loras`, LRU) ->
compute slots (`max_loras_per_batch` + `max_loras_prefetch`, LRU). Invariants (DESIGN.md §3):
- every load mints a fresh uid; names resolve to uids once, at admission (`acquire`);
- host keeps a superset of the slots: losing host weights frees the slot too;
- pinned adapters and adapters in use (running or scheduled) are never evicted implicitly;
- refcounts are acquired at admission and released exactly once (`release`); an unloaded
  adapter is unregistered at once and freed when its last request ends;
- a failed load changes nothing (validation happens before `register` commits);
- every residency decision is made here: disk reads start only in `prepare`, slots are
  filled only in `prepare` (prefetch) and `bind`; `is_ready` / `can_bind` are pure queries.
Only the engine thread calls these methods; disk reads run on DiskLoader's workers.

Unified mode (`unified=True`, the CPU default: one adapter memory): an adapter is packed into
the kernel's layout once, when its weights reach host memory, and the unpacked copy is dropped;
the slot pool grows to hold every host-resident adapter, so each of them can join any batch
(no distinct-adapter cap, no slot eviction), and prefetch is disk -> packed host memory for the
adapters the waiting queue needs, evicting only what no running or upcoming request needs.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable, Mapping, Set
from dataclasses import replace
from typing import Protocol

from loraserve.adapters.disk_loader import DiskLoader
from loraserve.adapters.entry import AdapterEntry, AdapterSnapshot
from loraserve.adapters.eviction import pick_victim
from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.stats import AdapterStats
from loraserve.adapters.store_check import check_store
from loraserve.types import (
    AdapterBusyError,
    AdapterConflictError,
    AdapterNotFoundError,
    LoraServeError,
    is_valid_adapter_name,
)

log = logging.getLogger("loraserve.adapters")


class SlotPool(Protocol):
    """Compute slots (adapters/slot_pool.LoraSlotPool); `write` fully overwrites a slot."""

    num_slots: int
    content: list[str | None]  # the fingerprint of the weights in each slot

    def write(self, slot: int, weights: LoraAdapterWeights) -> None: ...

    def grow(self, num_slots: int) -> None: ...

    def before_step(self, slots: Iterable[int]) -> None: ...

    def release(self, slot: int) -> None:
        """The slot's adapter is gone: drop what it holds beyond the preallocated rows."""


class AdapterStore:
    def __init__(self, slot_pool: SlotPool, loader: DiskLoader, *, max_loras_per_batch: int,
                 max_loaded_loras: int | None, max_loras_prefetch: int = 0,
                 reserved_names: frozenset[str] = frozenset(), unified: bool = False,
                 unified_prefetch: bool = True):
        self.slots = slot_pool
        self.loader = loader
        self.max_loras_per_batch = max_loras_per_batch
        self.max_loaded = max_loaded_loras
        self.max_prefetch = max_loras_prefetch
        self.reserved_names = reserved_names  # the base model's names: never an adapter's
        self.unified = unified
        # distinct adapters one batch may hold (None: any number, unified mode)
        self.batch_cap: int | None = None if unified else max_loras_per_batch
        # how far down the waiting queue loads start: the adapters that can join soon
        if unified:  # prefetch: all the queue needs that fits; without, the next one only
            self.lookahead = (max_loaded_loras or 1 << 30) if unified_prefetch else 1
        else:
            self.lookahead = max_loras_per_batch + max_loras_prefetch
        self.names: dict[str, int] = {}  # registered names only
        self.entries: dict[int, AdapterEntry] = {}  # registered + draining
        self._uids = itertools.count(1)
        self._tick = itertools.count(1)
        self.loads_started = 0  # disk reads started ahead of admission
        self.slots_prefetched = 0  # spare slots filled ahead of admission

    # --- registration -----------------------------------------------------------------------
    @staticmethod
    def check_name(name: str) -> None:
        if not is_valid_adapter_name(name):
            raise LoraServeError(
                f"invalid adapter name {name!r}: use 1-64 of [A-Za-z0-9._-], not only dots "
                "(':' is reserved for 'base:adapter')")

    def check_new(self, name: str, path: str, pinned: bool) -> bool:
        """Validate a load before any I/O. Returns True if it is a no-op (same name and path)."""
        self.check_name(name)
        if name in self.reserved_names:
            raise LoraServeError(f"adapter name {name!r} is the base model's name: choose "
                                 "another")
        uid = self.names.get(name)
        existing = self.entries[uid] if uid is not None else None
        if existing is not None and (
                os.path.realpath(existing.path) != os.path.realpath(path)):
            raise AdapterConflictError(
                f"adapter {name!r} is already loaded from {existing.path}; unload it "
                "first to load a different path")
        # Also when pinning an adapter already loaded: too many pins starve every other one.
        newly_pinned = pinned and not (existing is not None and existing.pinned)
        limit, knob = ((self.max_loaded, "max_loaded_loras") if self.unified
                       else (self.max_loras_per_batch, "max_loras_per_batch"))
        if newly_pinned and limit is not None and self.num_pinned + 1 > limit - 1:
            raise LoraServeError(
                f"cannot pin {name!r}: at most {knob} - 1 = {limit - 1} adapters may be "
                "pinned")
        return existing is not None

    def register(self, name: str, path: str, weights: LoraAdapterWeights | None,
                 pinned: bool = False, in_use: Set[int] = frozenset()) -> AdapterEntry:
        """Commit an adapter whose weights were already read and validated (None: the same
        name and path are registered already; this may pin it)."""
        if self.check_new(name, path, pinned):
            entry = self.entries[self.names[name]]
            entry.pinned = entry.pinned or pinned
            return entry
        if weights is None:
            raise ValueError("a new adapter needs its weights")
        # Host memory full of adapters in use: a pinned one must be resident (503, retry);
        # any other is registered on disk and read back when a request needs it, as after
        # an eviction (its files were validated already).
        resident = self._make_host_room(protected=in_use)
        if not resident and pinned:
            raise AdapterBusyError(
                f"cannot pin {name!r} now: host memory holds max_loaded_loras="
                f"{self.max_loaded} adapters that are all pinned or in use; retry shortly")
        entry = AdapterEntry(uid=next(self._uids), name=name, path=str(path),
                             fingerprint=weights.fingerprint, pinned=pinned,
                             last_used=next(self._tick))
        if resident:
            self._settle(entry, weights)  # may refuse the weights: nothing changed yet
        self.entries[entry.uid] = entry
        self.names[name] = entry.uid
        log.info("adapter %s loaded (uid %d, rank %d, %s%s)", name, entry.uid, weights.rank,
                 path, "" if resident else "; on disk until used: host memory is busy")
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
        if entry.slot is not None:
            self.slots.release(entry.slot)  # the next write zeroes the whole slot
        entry.slot = None
        entry.weights = None
        del self.entries[entry.uid]
        log.info("adapter %s freed (uid %d)", entry.name, entry.uid)

    # --- refcounts --------------------------------------------------------------------------
    def acquire(self, name: str) -> int:
        uid = self.names.get(name)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        entry = self.entries[uid]
        entry.refcount += 1
        entry.stats.requests += 1
        entry.stats.host_hits += entry.weights is not None
        return uid

    def fingerprint(self, uid: int) -> str:
        """The content hash of the weights under `uid`: the K/V namespace of its requests."""
        return self.entries[uid].fingerprint

    def stats(self, uid: int) -> AdapterStats:
        return self.entries[uid].stats

    def release(self, uid: int) -> None:
        entry = self.entries[uid]
        if entry.refcount <= 0:
            raise RuntimeError(f"adapter uid {uid} released more often than acquired")
        entry.refcount -= 1
        if entry.unloading and entry.refcount == 0:
            self._free(entry)

    # --- between steps: the residency decisions ---------------------------------------------
    def prepare(self, in_use: Set[int], upcoming: list[int]) -> dict[int, str]:
        """Collect finished disk reads, start reads for the adapters the waiting queue needs
        next (`upcoming`, in queue order), and prefetch spare slots for them. `in_use`: the
        adapters of running requests. Returns uid -> error for loads that failed: the
        requests waiting on those adapters must fail, nobody else."""
        failed = self._collect_loads()
        window = [u for u in upcoming[: self.lookahead] if u in self.entries]
        protected = set(in_use) | set(window)
        for uid in window:
            # Unified: no more reads in flight than the loader has workers. A read queued
            # behind them would evict a resident adapter now for weights that come later; on
            # a 2-core Zen 5 host, 16 reads at once gave a p99 TTFT 1.2-1.3x that of one at
            # a time (benchmarks/prefetch.py).
            if self.unified and self.loader.num_pending >= self.loader.workers:
                break
            e = self.entries[uid]
            if (e.weights is None and uid not in failed and not self.loader.is_loading(uid)
                    and self._make_host_room(protected)):
                self.loader.start(uid, e.path)
                self.loads_started += 1
        if self.max_prefetch and not self.unified:
            self._prefetch_slots(window, protected)
        return failed

    def _collect_loads(self) -> dict[int, str]:
        failed = {}
        for uid, weights, secs, err in self.loader.collect():
            entry = self.entries.get(uid)
            if entry is None:
                continue  # unloaded while loading
            if err is None and weights.fingerprint != entry.fingerprint:
                # Same uid must mean same weights (uid-keyed caches rely on it).
                err = (f"the files at {entry.path} changed on disk since it was loaded; "
                       "unload and load it again")
            if err is None:
                try:  # one adapter memory: packed now; a refusal fails its requests only
                    self._settle(entry, weights)
                except ValueError as e:
                    err = str(e)
            if err is not None:
                entry.last_error = err  # the operator's view, paths included
                failed[uid] = f"adapter {entry.name!r} failed to load: {entry.public_error(err)}"
                log.warning("adapter %s failed to load: %s", entry.name, err)
                continue
            entry.last_error = None
            entry.stats.record_load(secs)
            log.info("adapter %s reloaded into host memory in %.3fs", entry.name, secs)
        return failed

    def _settle(self, entry: AdapterEntry, weights: LoraAdapterWeights) -> None:
        """Weights just reached host memory. Unified: pack them into a slot now and keep only
        their description (the slot is the one copy). Tiered: keep them; a slot comes later."""
        if not self.unified:
            entry.weights = weights
            return
        owners = self.slot_owner
        if None in owners:
            slot = owners.index(None)
        else:
            slot = len(owners)
            # double, within max_loaded_loras (host room was made before these weights came)
            self.slots.grow(max(slot + 1, min(2 * len(owners), self.max_loaded or 1 << 30)))
        self.slots.write(slot, weights)  # validates before it writes
        entry.slot, entry.weights = slot, weights.description()

    def _prefetch_slots(self, window: list[int], protected: set[int]) -> None:
        filled = 0
        for uid in window:
            e = self.entries[uid]
            if filled == self.max_prefetch:
                return
            if e.weights is not None and e.slot is None:
                slot = self._free_or_evict_slot(protected)
                if slot is None:
                    return
                self._fill_slot(e, slot)
                e.prefetched = True
                filled += 1
                self.slots_prefetched += 1

    def _make_host_room(self, protected: Set[int]) -> bool:
        """Evict host entries until one more fits. False if every one is protected/pinned."""
        if self.max_loaded is None:
            return True
        while self.num_host + self.loader.num_pending >= self.max_loaded:
            victim = pick_victim(self._host_entries(), protected)
            if victim is None:
                return False
            if victim.slot is not None:
                self.slots.release(victim.slot)
            victim.slot = None
            victim.weights = None
            victim.stats.host_evictions += 1
            log.info("adapter %s evicted from host memory (stays registered)", victim.name)
        return True

    # --- admission queries (pure) and binding -----------------------------------------------
    def is_ready(self, uid: int) -> bool:
        entry = self.entries.get(uid)
        return entry is not None and entry.weights is not None

    def can_bind(self, uids: Set[int]) -> bool:
        if self.unified:  # every host-resident adapter holds its slot already
            return True
        holders = set(uids) | {e.uid for e in self.entries.values()
                               if e.pinned and e.slot is not None}
        return len(holders) <= self.slots.num_slots

    def bind(self, uids: Set[int]) -> dict[int, int]:
        """Give every adapter of this step a slot (writing its weights there if it has
        none); uid -> slot. Admission (`can_bind`) guarantees the slots exist."""
        tick = next(self._tick)
        out = {}
        for uid in uids:
            e = self.entries[uid]
            e.last_used, e.prefetched = tick, False
            if e.slot is None:
                if e.weights is None:
                    raise RuntimeError(f"adapter {e.name} scheduled without host weights")
                slot = self._free_or_evict_slot(protected=uids)
                if slot is None:
                    raise RuntimeError("no LoRA slot to evict: admission should have refused")
                self._fill_slot(e, slot)
            out[uid] = e.slot
        self.slots.before_step(out.values())  # GPU: the step waits for their copies
        return out

    def _free_or_evict_slot(self, protected: Set[int]) -> int | None:
        owners = self.slot_owner
        if None in owners:
            return owners.index(None)
        victim = pick_victim((e for e in self.entries.values() if e.slot is not None),
                             protected)
        if victim is None:
            return None
        slot, victim.slot = victim.slot, None
        victim.stats.slot_evictions += 1
        return slot

    def _fill_slot(self, entry: AdapterEntry, slot: int) -> None:
        self.slots.write(slot, entry.weights)  # zeroes the whole slot first
        entry.slot = slot

    # --- views ------------------------------------------------------------------------------
    @property
    def slot_owner(self) -> list[int | None]:
        """uid in each slot (None: free); derived from the entries, the one record of it."""
        owners: list[int | None] = [None] * self.slots.num_slots
        for e in self.entries.values():
            if e.slot is not None:
                owners[e.slot] = e.uid
        return owners

    def _host_entries(self) -> list[AdapterEntry]:
        return [e for e in self.entries.values() if e.weights is not None]

    @property
    def num_host(self) -> int:
        return sum(1 for e in self.entries.values() if e.weights is not None)

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pinned and not e.unloading)

    @property
    def num_registered(self) -> int:
        return len(self.names)

    def registered(self) -> list[AdapterEntry]:
        return [self.entries[u] for u in self.names.values()]

    def snapshot(self) -> tuple[AdapterSnapshot, ...]:
        snaps = tuple(e.snapshot() for e in self.entries.values())
        if self.unified:  # the slots are host memory: resident adapters are in the host tier
            snaps = tuple(replace(sn, tier="host") if sn.tier == "device" else sn
                          for sn in snaps)
        return snaps

    def check(self, refs: Mapping[int, int], running: Set[int],
              waiting: list[int | None]) -> list[str]:
        """This store's consistency report (adapters/store_check.py); [] when all hold."""
        return check_store(self, refs, running, waiting)

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to `timeout` for a disk read to finish (when nothing else can run)."""
        self.loader.wait_any(timeout)

    def shutdown(self) -> None:
        self.loader.shutdown()


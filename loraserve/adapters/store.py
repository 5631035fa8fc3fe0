"""AdapterStore: the single authority on adapter identity and residency.

Tiers: registered (disk path) -> host memory (weights, at most `max_loaded_loras`, LRU) ->
compute slots. Invariants (DESIGN.md §3):
- every load mints a fresh uid; names resolve to uids once, at admission (`acquire`);
- host keeps a superset of the slots: losing host weights frees the slot too;
- pinned adapters and adapters in use (running or scheduled) are never evicted implicitly;
- refcounts are acquired at admission and released exactly once (`release`); an unloaded
  adapter is unregistered at once and freed when its last request ends;
- every load of a name is a new version with its own uid (adapters/versions.py); a replace
  switches `name` to the new version in one step between engine steps, and old versions
  retire (as an unload) once more than `max_versions` are live and nothing holds them;
- a failed load changes nothing (validation happens before `register` commits);
- every residency decision is made here, with its policy: disk reads start only in
  `prepare`, slots are filled only in `prepare` (prefetch) and `bind`; `is_ready` /
  `can_bind` are pure queries.
Only the engine thread calls these methods; disk reads run on DiskLoader's workers.

How host memory and slots relate is the residency policy's (adapters/residency/: `tiered`
or `unified`), chosen once by name when the store is made. Others read the store through its
read-only views; its consistency report is adapters/store_check.py.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Set
from types import MappingProxyType

from loraserve.adapters.disk_loader import DiskLoader
from loraserve.adapters.entry import AdapterEntry
from loraserve.adapters.eviction import pick_victim
from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.residency import ResidencyLimits, SlotPool, residency_class
from loraserve.adapters.spill import spill_dir
from loraserve.adapters.stats import AdapterStats
from loraserve.adapters.store_views import StoreViews
from loraserve.adapters.versions import VersionTable, label, split_model
from loraserve.types import (
    AdapterBusyError,
    AdapterConflictError,
    AdapterNotFoundError,
    LoraServeError,
    is_valid_adapter_name,
)

log = logging.getLogger("loraserve.adapters")


class AdapterStore(StoreViews):
    def __init__(self, slot_pool: SlotPool, loader: DiskLoader, limits: ResidencyLimits, *,
                 memory: str = "tiered", reserved_names: frozenset[str] = frozenset(),
                 max_versions: int = 2):
        """`memory`: the residency policy's name (adapters/residency/), chosen once here.
        `max_versions`: live versions of one name beyond which idle old ones retire."""
        if max_versions < 1:
            raise ValueError("max_versions must be at least 1")
        self._loader = loader
        self._reserved_names = reserved_names  # the base model's names: never an adapter's
        self._versions = VersionTable()  # live versions: name / name@N -> uid
        self.max_versions = max_versions
        self._entries: dict[int, AdapterEntry] = {}  # registered + draining
        self._entries_view = MappingProxyType(self._entries)
        self._residency = residency_class(memory)(slot_pool, self._entries_view, limits)
        self._uids = itertools.count(1)
        self._tick = itertools.count(1)
        self.loads_started = 0  # disk reads started ahead of admission
        self.slots_prefetched = 0  # spare slots filled ahead of admission

    # --- registration -----------------------------------------------------------------------
    def check_new(self, name: str, path: str, pinned: bool, replace: bool = False) -> bool:
        """Validate a load before any I/O. Returns True if it is a no-op (same name and path,
        no replace). With `replace`, a loaded name gets a new version (its pin moves over)."""
        if not is_valid_adapter_name(name):
            raise LoraServeError(
                f"invalid adapter name {name!r}: use 1-64 of [A-Za-z0-9._-], not only dots "
                "(':' is reserved for 'base:adapter')")
        if name in self._reserved_names:
            raise LoraServeError(f"adapter name {name!r} is the base model's name: choose "
                                 "another")
        newest = self._versions.newest(name)
        existing = self._entries[newest[1]] if newest is not None else None
        if existing is not None and not replace and (
                os.path.realpath(existing.path) != os.path.realpath(path)):
            raise AdapterConflictError(
                f"adapter {name!r} is already loaded from {existing.path}; send "
                "\"replace\": true to load a new version of it, or unload it first")
        # Also when pinning an adapter already loaded: too many pins starve every other one.
        # A replace moves the old version's pin to the new one: no pin more.
        newly_pinned = pinned and not (existing is not None and existing.pinned)
        if newly_pinned and not self._residency.pin_limit.allows(self.num_pinned + 1):
            raise LoraServeError(f"cannot pin {name!r}: {self._residency.pin_limit}")
        return existing is not None and not replace

    def register(self, name: str, path: str, weights: LoraAdapterWeights | None,
                 pinned: bool = False, in_use: Set[int] = frozenset(), *, replace: bool = False,
                 version: int | None = None, owned: bool = False) -> AdapterEntry:
        """Commit an adapter whose weights were already read and validated (None: the same
        name and path are registered already; this may pin it). `replace`: a new version of
        a loaded name. `version`: the number a deployment chose (else the next one).
        `owned`: `path` is a copy in the spill directory, removed when the version is freed."""
        if self.check_new(name, path, pinned, replace):
            entry = self._entries[self._versions.newest(name)[1]]
            entry.pinned = entry.pinned or pinned
            return entry
        if weights is None:
            raise ValueError("a new adapter needs its weights")
        number = self._versions.next_version(name, version)
        previous = self._versions.newest(name)
        old = self._entries[previous[1]] if previous is not None else None
        pinned = pinned or (old is not None and old.pinned)
        # Host memory full of adapters in use: a pinned one must be resident (503, retry);
        # any other is registered on disk and read back when a request needs it, as after
        # an eviction (its files were validated already).
        resident = self._make_host_room(protected=in_use)
        if not resident and pinned:
            raise AdapterBusyError(
                f"cannot pin {name!r} now: host memory holds max_loaded_loras="
                f"{self._residency.limits.max_loaded_loras} adapters that are all pinned or "
                "in use; retry shortly")
        entry = AdapterEntry(uid=next(self._uids), name=name, path=str(path),
                             fingerprint=weights.fingerprint, pinned=pinned,
                             last_used=next(self._tick), version=number, owned=owned)
        if resident:
            self._residency.admit(entry, weights)  # may refuse the weights: nothing changed
        # the switch: from here on `name` means the new version
        self._entries[entry.uid] = entry
        self._versions.add(name, number, entry.uid)
        if old is not None:
            old.pinned = False  # the pin moved to the new version
        log.info("adapter %s loaded (uid %d, rank %d, %s%s)", label(name, number), entry.uid,
                 weights.rank, path,
                 "" if resident else "; on disk until used: host memory is busy")
        self._retire_old_versions(name)
        return entry

    def unregister(self, model: str) -> None:
        """Unload `name` (every version of it) or one version, `name@N`."""
        name, version = split_model(model)
        live = self._versions.live(name)
        if not live or (version is not None and version not in live):
            raise AdapterNotFoundError(f"adapter {model!r} is not loaded")
        for v in [version] if version is not None else list(live):
            self._retire(name, v)

    def _retire(self, name: str, version: int) -> None:
        """`name@version` takes no new requests; it is freed when its last one ends."""
        entry = self._entries[self._versions.remove(name, version)]
        entry.unloading = True
        # its pin goes with it: a draining adapter held its compute slot past the pin limit
        # (a new pin may take its place at once), and with every slot pinned a request for
        # an unpinned adapter starved, holding back the drain's own last requests
        entry.pinned = False
        log.info("adapter %s unloading (uid %d, %d requests in flight)", label(name, version),
                 entry.uid, entry.refcount)
        if entry.refcount == 0:
            self._free(entry)

    def _retire_old_versions(self, name: str) -> None:
        """Versions of `name` older than its newest `max_versions` retire once nothing holds
        them. Never waits: a held one retires when its last request releases it."""
        live = self._versions.live(name)
        for version, uid in list(live.items())[: -self.max_versions]:
            if self._entries[uid].refcount == 0:
                self._retire(name, version)

    def _free(self, entry: AdapterEntry) -> None:
        self._loader.cancel(entry.uid)
        self._residency.drop(entry)
        del self._entries[entry.uid]
        if entry.owned:
            spill_dir().remove(entry.path)
        log.info("adapter %s freed (uid %d)", label(entry.name, entry.version), entry.uid)

    # --- refcounts --------------------------------------------------------------------------
    def acquire(self, model: str) -> int:
        """The uid `name` (its newest version) or `name@N` means now, refcount + 1."""
        uid = self._versions.resolve(model)
        if uid is None:
            raise AdapterNotFoundError(f"adapter {model!r} is not loaded")
        entry = self._entries[uid]
        entry.refcount += 1
        entry.stats.requests += 1
        entry.stats.host_hits += entry.weights is not None
        return uid

    def fingerprint(self, uid: int) -> str:
        """The content hash of the weights under `uid`: the K/V namespace of its requests."""
        return self._entries[uid].fingerprint

    def version(self, uid: int) -> int:
        """Which version of its name `uid` is (`name@N`)."""
        return self._entries[uid].version

    def stats(self, uid: int) -> AdapterStats:
        return self._entries[uid].stats

    def release(self, uid: int) -> None:
        entry = self._entries[uid]
        if entry.refcount <= 0:
            raise RuntimeError(f"adapter uid {uid} released more often than acquired")
        entry.refcount -= 1
        if entry.refcount == 0:
            if entry.unloading:
                self._free(entry)
            else:
                self._retire_old_versions(entry.name)

    # --- between steps: the residency decisions ---------------------------------------------
    def prepare(self, in_use: Set[int], upcoming: list[int]) -> dict[int, str]:
        """Collect finished disk reads, start reads for the adapters the waiting queue needs
        next (`upcoming`, in queue order), and prefetch spare slots for them. `in_use`: the
        adapters of running requests. Returns uid -> error for loads that failed: the
        requests waiting on those adapters must fail, nobody else."""
        failed = self._collect_loads()
        policy = self._residency
        window = [u for u in upcoming[: policy.lookahead] if u in self._entries]
        protected = set(in_use) | set(window)
        max_reads = policy.max_reads(self._loader.workers)
        for uid in window:
            if max_reads is not None and self._loader.num_pending >= max_reads:
                break
            e = self._entries[uid]
            if (e.weights is None and uid not in failed and not self._loader.is_loading(uid)
                    and self._make_host_room(protected)):
                self._loader.start(uid, e.path)
                self.loads_started += 1
        self.slots_prefetched += policy.prefetch([self._entries[u] for u in window],
                                                 protected)
        return failed

    def _collect_loads(self) -> dict[int, str]:
        failed = {}
        for uid, weights, secs, err in self._loader.collect():
            entry = self._entries.get(uid)
            if entry is None:
                continue  # unloaded while loading
            if err is None and weights.fingerprint != entry.fingerprint:
                # Same uid must mean same weights (uid-keyed caches rely on it).
                err = (f"the files at {entry.path} changed on disk since it was loaded; "
                       "unload and load it again")
            if err is None:
                try:  # the slot pool may refuse the weights: that fails its requests only
                    self._residency.admit(entry, weights)
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

    def _make_host_room(self, protected: Set[int]) -> bool:
        """Evict host entries until one more fits. False if every one is protected/pinned."""
        cap = self._residency.limits.max_loaded_loras
        while cap is not None and self.num_host + self._loader.num_pending >= cap:
            victim = pick_victim(self.host_entries(), protected)
            if victim is None:
                return False
            self._residency.drop(victim)
            victim.stats.host_evictions += 1
            log.info("adapter %s evicted from host memory (stays registered)", victim.name)
        return True

    # --- admission queries (pure) and binding -----------------------------------------------
    @property
    def batch_cap(self) -> int | None:  # the policy's
        return self._residency.batch_cap

    def is_ready(self, uid: int) -> bool:
        entry = self._entries.get(uid)
        return entry is not None and entry.weights is not None

    def can_bind(self, uids: Set[int]) -> bool:
        return self._residency.can_bind(uids)

    def bind(self, uids: Set[int]) -> dict[int, int]:
        """Give every adapter of this step a slot (writing its weights there if it has
        none); uid -> slot. Admission (`can_bind`) guarantees the slots exist."""
        tick = next(self._tick)
        out = {}
        for uid in uids:
            e = self._entries[uid]
            e.last_used, e.prefetched = tick, False
            out[uid] = self._residency.slot_for(e, protected=uids)
        self.slots.before_step(out.values())  # GPU: the step waits for their copies
        return out

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to `timeout` for a disk read to finish (when nothing else can run)."""
        self._loader.wait_any(timeout)

    def shutdown(self) -> None:
        self._loader.shutdown()
        for e in self._entries.values():
            if e.owned:
                spill_dir().remove(e.path)

"""What others may read of the AdapterStore: read-only views over its entries, versions and
residency policy. Only the store's own methods (adapters/store.py) change any of them."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from loraserve.adapters.disk_loader import DiskLoader
from loraserve.adapters.entry import AdapterEntry, AdapterSnapshot
from loraserve.adapters.residency import Residency, SlotPool
from loraserve.adapters.versions import VersionTable


class StoreViews:
    """Mixed into AdapterStore, which sets these fields."""

    _entries: dict[int, AdapterEntry]
    _entries_view: MappingProxyType
    _versions: VersionTable
    _residency: Residency
    _loader: DiskLoader

    @property
    def entries(self) -> Mapping[int, AdapterEntry]:
        """uid -> entry, registered and draining (a read-only view; only the store changes
        an entry)."""
        return self._entries_view

    @property
    def names(self) -> Mapping[str, int]:
        """Registered name -> the uid of its newest version."""
        return {n: self._versions.newest(n)[1] for n in self._versions.names()}

    def resolve(self, model: str) -> int | None:
        """The uid `name` or `name@N` means now (None: not loaded); no refcount taken."""
        return self._versions.resolve(model)

    def live_versions(self, name: str) -> dict[int, int]:
        """version -> uid of every live version of `name`, oldest first."""
        return self._versions.live(name)

    @property
    def residency(self) -> Residency:
        """The residency policy, for its limits and views (`batch_cap`, `lookahead`,
        `pin_limit`, `tier`, `check`); only the store calls its load, evict and bind steps."""
        return self._residency

    @property
    def slots(self) -> SlotPool:
        return self._residency.slots

    @property
    def loader(self) -> DiskLoader:
        return self._loader

    @property
    def slot_owner(self) -> list[int | None]:
        """uid in each slot (None: free); derived from the entries, the one record of it."""
        return self._residency.slot_owner

    def host_entries(self) -> list[AdapterEntry]:
        """The adapters whose weights are in host memory."""
        return [e for e in self._entries.values() if e.weights is not None]

    @property
    def num_host(self) -> int:
        return len(self.host_entries())

    @property
    def num_pinned(self) -> int:
        # an unloading adapter has lost its pin already (store.py)
        return sum(1 for e in self._entries.values() if e.pinned)

    @property
    def num_registered(self) -> int:
        """Registered names (each counted once, whatever its live versions)."""
        return sum(1 for _ in self._versions.names())

    def registered(self) -> list[AdapterEntry]:
        """The newest version of every registered name."""
        return [self._entries[u] for u in self.names.values()]

    def snapshot(self) -> tuple[AdapterSnapshot, ...]:
        return tuple(e.snapshot(self._residency.tier(e)) for e in self._entries.values())

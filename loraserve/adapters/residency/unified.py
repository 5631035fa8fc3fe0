"""Unified residency (the CPU default): one adapter memory.

An adapter is packed into the kernel's layout once, when its weights reach host memory, and
the unpacked copy is dropped: the slot is the one copy, and host memory holds at most
`max_loaded_loras` of them (LRU beyond). The slot pool grows to hold every host-resident
adapter, so each of them can join any batch: no distinct-adapter cap, no slot eviction, and
binding never writes. Prefetch is disk -> packed host memory for the adapters the waiting
queue needs (all that fit, or only the next one without `unified_prefetch`), with no more
reads in flight than the loader has workers: a read queued behind them would evict a resident
adapter now for weights that come later, which lengthens the tail of time to first token
(benchmarks/prefetch.py). Pins may hold all but one place in host memory.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from loraserve.adapters.entry import AdapterEntry
from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.residency.base import PinLimit, Residency, ResidencyLimits

UNBOUNDED = 1 << 30
FIRST_SLOTS = 4  # the pool starts small and doubles as adapters arrive


class UnifiedResidency(Residency):
    name = "unified"

    @classmethod
    def initial_slots(cls, limits: ResidencyLimits) -> int:
        return min(FIRST_SLOTS, limits.max_loaded_loras or FIRST_SLOTS)

    @property
    def batch_cap(self) -> None:
        return None  # every host-resident adapter holds its slot already

    @property
    def lookahead(self) -> int:
        if not self.limits.unified_prefetch:
            return 1
        return self.limits.max_loaded_loras or UNBOUNDED

    @property
    def pin_limit(self) -> PinLimit:
        return PinLimit("max_loaded_loras", self.limits.max_loaded_loras)

    def max_reads(self, workers: int) -> int:
        return workers

    def admit(self, entry: AdapterEntry, weights: LoraAdapterWeights) -> None:
        owners = self.slot_owner
        if None in owners:
            slot = owners.index(None)
        else:
            slot = len(owners)
            # double, within max_loaded_loras (host room was made before these weights came)
            cap = self.limits.max_loaded_loras or UNBOUNDED
            self.slots.grow(max(slot + 1, min(2 * len(owners), cap)))
        self.slots.write(slot, weights)  # validates before it writes
        entry.slot, entry.weights = slot, weights.description()  # the slot is the one copy

    def prefetch(self, window: Sequence[AdapterEntry], protected: Set[int]) -> int:
        return 0  # reading ahead into host memory is the prefetch: the slot comes with it

    def can_bind(self, uids: Set[int]) -> bool:
        return True

    def slot_for(self, entry: AdapterEntry, protected: Set[int]) -> int:
        if entry.slot is None:
            raise RuntimeError(f"adapter {entry.name} scheduled without host weights")
        return entry.slot

    def tier(self, entry: AdapterEntry) -> str:
        # the slots are host memory: a resident adapter is in the host tier
        return "host" if entry.slot is not None else entry.tier

    def check(self) -> list[str]:
        return [f"adapter {e.name}: in one adapter memory, host means a slot"
                for e in self.entries.values() if (e.slot is None) != (e.weights is None)]

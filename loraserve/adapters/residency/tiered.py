"""Tiered residency (the GPU default): host memory, then a bounded pool of compute slots.

Host memory keeps an adapter's weights as read (at most `max_loaded_loras`, LRU); a step's
adapters are written into compute slots when it is bound, `max_loras_per_batch` of them plus
`max_loras_prefetch` spare ones that the waiting queue's next adapters are copied into ahead
of admission. A full pool evicts the slot of an adapter no step needs now (the one eviction
rule, adapters/eviction.py); its weights stay in host memory for the next copy. A batch holds
at most `max_loras_per_batch` distinct adapters, and pins may hold all but one of those slots.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from loraserve.adapters.entry import AdapterEntry
from loraserve.adapters.eviction import pick_victim
from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.residency.base import PinLimit, Residency, ResidencyLimits


class TieredResidency(Residency):
    name = "tiered"

    @classmethod
    def initial_slots(cls, limits: ResidencyLimits) -> int:
        return limits.max_loras_per_batch + limits.max_loras_prefetch

    @property
    def batch_cap(self) -> int:
        return self.limits.max_loras_per_batch

    @property
    def lookahead(self) -> int:
        # the adapters that can join soon: a batch's worth and the spare slots'
        return self.limits.max_loras_per_batch + self.limits.max_loras_prefetch

    @property
    def pin_limit(self) -> PinLimit:
        return PinLimit("max_loras_per_batch", self.limits.max_loras_per_batch)

    def max_reads(self, workers: int) -> None:
        # host room is made before a read starts and slots come later: no reason to wait
        return None

    def admit(self, entry: AdapterEntry, weights: LoraAdapterWeights) -> None:
        entry.weights = weights  # a slot comes when a step binds it, or by prefetch

    def prefetch(self, window: Sequence[AdapterEntry], protected: Set[int]) -> int:
        filled = 0
        for e in window:
            if filled == self.limits.max_loras_prefetch:
                break
            if e.weights is not None and e.slot is None:
                slot = self._free_or_evict_slot(protected)
                if slot is None:
                    break
                self._fill(e, slot)
                e.prefetched = True
                filled += 1
        return filled

    def can_bind(self, uids: Set[int]) -> bool:
        # pinned adapters hold their slots whether or not this batch uses them
        holders = set(uids) | {e.uid for e in self.entries.values()
                               if e.pinned and e.slot is not None}
        return len(holders) <= self.slots.num_slots

    def slot_for(self, entry: AdapterEntry, protected: Set[int]) -> int:
        if entry.slot is None:
            if entry.weights is None:
                raise RuntimeError(f"adapter {entry.name} scheduled without host weights")
            slot = self._free_or_evict_slot(protected)
            if slot is None:
                raise RuntimeError("no LoRA slot to evict: admission should have refused")
            self._fill(entry, slot)
        return entry.slot

    def _free_or_evict_slot(self, protected: Set[int]) -> int | None:
        owners = self.slot_owner
        if None in owners:
            return owners.index(None)
        victim = pick_victim((e for e in self.entries.values() if e.slot is not None),
                             protected)
        if victim is None:
            return None
        slot, victim.slot = victim.slot, None
        self.slots.release(slot)  # the victim's parts beyond B @ A go before the next write
        victim.stats.slot_evictions += 1
        return slot

    def _fill(self, entry: AdapterEntry, slot: int) -> None:
        self.slots.write(slot, entry.weights)  # zeroes the whole slot first
        entry.slot = slot

"""What a residency policy decides for the adapter store: how host memory and compute slots
relate.

The store (adapters/store.py) owns the entries and makes every residency decision; what
differs between adapter memories is asked of one policy, chosen by name when the store is
made (`lora_memory`: `tiered` or `unified`, settled by EngineConfig.resolve):
- load: `admit` runs when an adapter's weights reach host memory;
- evict: `drop` forgets an adapter's host weights and its slot together (host memory always
  holds a superset of the slots), on a host eviction and when an unloaded adapter is freed;
- bind: `slot_for` gives an adapter of this step its slot; `can_bind` is the pure query
  admission asks first; `prefetch` fills spare slots ahead of admission;
- limits: the distinct adapters one batch may hold (`batch_cap`), how far down the waiting
  queue disk reads start (`lookahead`), how many reads may be in flight (`max_reads`), how
  many adapters may be pinned (`pin_limit`);
- views: the tier clients see (`tier`) and the policy's own invariants (`check`).
A policy keys everything by uid and entry, never by name: names resolve to uids once, in the
store, and each entry is one load (one uid, one set of weights), so whatever maps names to
loads stays the store's. A policy reads the store's entries through a read-only mapping and
changes only the residency fields of an entry (`weights`, `slot`, `prefetched`, its count of
slot evictions).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import ClassVar, Protocol

from loraserve.adapters.entry import AdapterEntry
from loraserve.adapters.format import LoraAdapterWeights
from loraserve.config import EngineConfig


class SlotPool(Protocol):
    """Compute slots (adapters/slot_pool.LoraSlotPool); `write` fully overwrites a slot."""

    num_slots: int
    content: list[str | None]  # the fingerprint of the weights in each slot

    def write(self, slot: int, weights: LoraAdapterWeights) -> None: ...

    def grow(self, num_slots: int) -> None: ...

    def before_step(self, slots: Iterable[int]) -> None: ...

    def release(self, slot: int) -> None:
        """The slot's adapter left it: drop what it holds beyond the preallocated rows."""


@dataclass(frozen=True)
class ResidencyLimits:
    """The knobs (EngineConfig) that bound residency."""

    max_loras_per_batch: int
    max_loaded_loras: int | None = None  # adapters in host memory (None: unbounded)
    max_loras_prefetch: int = 0  # spare slots filled ahead of admission (tiered)
    unified_prefetch: bool = True  # unified: read ahead everything the queue needs

    @classmethod
    def of(cls, c: EngineConfig) -> ResidencyLimits:
        return cls(c.max_loras_per_batch, c.max_loaded_loras, c.max_loras_prefetch,
                   c.unified_prefetch)


@dataclass(frozen=True)
class PinLimit:
    """Pins may take all but one of the places `knob` bounds, so that an unpinned adapter can
    always run; `places` None: no bound."""

    knob: str
    places: int | None

    @property
    def max_pinned(self) -> int | None:
        return None if self.places is None else max(self.places - 1, 0)

    def allows(self, num_pinned: int) -> bool:
        return self.max_pinned is None or num_pinned <= self.max_pinned

    def __str__(self) -> str:
        return f"at most {self.knob} - 1 = {self.max_pinned} adapters may be pinned"


class Residency(ABC):
    name: ClassVar[str]

    def __init__(self, slots: SlotPool, entries: Mapping[int, AdapterEntry],
                 limits: ResidencyLimits):
        self.slots = slots
        self.entries = entries  # the store's, read-only
        self.limits = limits

    @classmethod
    @abstractmethod
    def initial_slots(cls, limits: ResidencyLimits) -> int:
        """How many slots the pool is made with."""

    # --- limits -----------------------------------------------------------------------------
    @property
    @abstractmethod
    def batch_cap(self) -> int | None:
        """Distinct adapters one batch may hold, the base model counting as one (None: any)."""

    @property
    @abstractmethod
    def lookahead(self) -> int:
        """How far down the waiting queue disk reads start."""

    @property
    @abstractmethod
    def pin_limit(self) -> PinLimit: ...

    @abstractmethod
    def max_reads(self, workers: int) -> int | None:
        """Most disk reads in flight while reading ahead, with `workers` readers (None: any)."""

    # --- load, evict, bind ------------------------------------------------------------------
    @abstractmethod
    def admit(self, entry: AdapterEntry, weights: LoraAdapterWeights) -> None:
        """`weights` just reached host memory for `entry` (the store made room for them).
        Raises ValueError, changing nothing, if the slot pool refuses them."""

    def drop(self, entry: AdapterEntry) -> None:
        """Forget `entry`'s host weights, and its slot with them (the next write to the slot
        overwrites all of it; what the slot holds beyond its preallocated rows goes now)."""
        if entry.slot is not None:
            self.slots.release(entry.slot)
        entry.slot = None
        entry.weights = None

    @abstractmethod
    def prefetch(self, window: Sequence[AdapterEntry], protected: Set[int]) -> int:
        """Fill spare slots for adapters of the waiting queue's `window`, evicting none of
        `protected`; returns how many slots were filled."""

    @abstractmethod
    def can_bind(self, uids: Set[int]) -> bool:
        """These adapters can all hold a slot at the same time (pure)."""

    @abstractmethod
    def slot_for(self, entry: AdapterEntry, protected: Set[int]) -> int:
        """The slot `entry` computes from in this step, filled now if it has none; the
        adapters in `protected` keep theirs."""

    # --- views ------------------------------------------------------------------------------
    def tier(self, entry: AdapterEntry) -> str:
        """The tier clients see: "disk", "host" or "device"."""
        return entry.tier

    def check(self) -> list[str]:
        """Problems with this policy's own invariants ([] when all hold; pure)."""
        return []

    @property
    def slot_owner(self) -> list[int | None]:
        """uid in each slot (None: free); derived from the entries, the one record of it."""
        owners: list[int | None] = [None] * self.slots.num_slots
        for e in self.entries.values():
            if e.slot is not None:
                owners[e.slot] = e.uid
        return owners

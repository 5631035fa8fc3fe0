"""Each residency policy alone (adapters/residency/), over a fake slot pool and entries of its
own: what the tier does when weights reach host memory (admit), when they leave it (drop),
when a step binds its adapters (can_bind, slot_for, prefetch), and the limits it sets (batch
cap, lookahead, reads in flight, pins). The store drives these through its own tests
(test_adapter_store.py, test_property_store.py)."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from test_adapter_store import weights
from test_property_store import GrowingSlots

from loraserve.adapters.entry import AdapterEntry
from loraserve.adapters.residency import (
    RESIDENCIES,
    PinLimit,
    ResidencyLimits,
    TieredResidency,
    UnifiedResidency,
    residency_class,
)
from loraserve.config import EngineConfig


class Policy:
    """A policy over entries the test owns (the store's role): `add` registers an entry."""

    def __init__(self, cls, slots=2, **limits):
        self.entries: dict[int, AdapterEntry] = {}
        self.slots = GrowingSlots(slots)
        self.p = cls(self.slots, MappingProxyType(self.entries),
                     ResidencyLimits(**{"max_loras_per_batch": 2, **limits}))

    def add(self, name: str, resident: bool = True, **fields) -> AdapterEntry:
        e = AdapterEntry(uid=len(self.entries) + 1, name=name, path=f"/p/{name}",
                         fingerprint=name, last_used=len(self.entries), **fields)
        self.entries[e.uid] = e
        if resident:
            self.p.admit(e, weights(name))
        return e


# --- tiered -----------------------------------------------------------------------------
def test_tiered_load_keeps_weights_on_the_host_and_writes_no_slot():
    t = Policy(TieredResidency)
    a = t.add("a")
    assert a.weights is not None and a.weights.fingerprint == "a" and a.slot is None
    assert (t.p.tier(a), t.slots.writes) == ("host", 0)


def test_tiered_bind_fills_free_slots_then_evicts_the_least_recently_used():
    t = Policy(TieredResidency, slots=2)
    a, b, c = t.add("a"), t.add("b"), t.add("c")
    assert t.p.slot_for(a, protected={a.uid}) == 0 and t.p.slot_for(b, {b.uid}) == 1
    assert t.slots.content == ["a", "b"] and t.p.tier(a) == "device"
    assert t.p.slot_for(a, {a.uid}) == 0 and t.slots.writes == 2  # held: no rewrite
    assert t.p.slot_for(c, protected={c.uid, b.uid}) == 0  # a is the one not protected
    assert a.slot is None and a.weights is not None and a.stats.slot_evictions == 1
    assert t.slots.released == [0]  # a's parts beyond B @ A go before c is written there
    assert t.slots.content == ["c", "b"] and t.p.slot_owner == [c.uid, b.uid]
    with pytest.raises(RuntimeError, match="admission should have refused"):
        t.p.slot_for(a, protected={b.uid, c.uid, a.uid})
    d = t.add("d", resident=False)
    with pytest.raises(RuntimeError, match="without host weights"):
        t.p.slot_for(d, protected={d.uid})


def test_tiered_can_bind_counts_pinned_slots_and_drop_frees_the_slot():
    t = Policy(TieredResidency, slots=2)
    p, a, b = t.add("p", pinned=True), t.add("a"), t.add("b")
    t.p.slot_for(p, {p.uid})
    assert t.p.can_bind({a.uid}) and not t.p.can_bind({a.uid, b.uid})
    t.p.drop(p)  # evicted from host memory (or freed): its slot goes with it
    assert (p.weights, p.slot) == (None, None) and t.p.slot_owner == [None, None]
    assert t.slots.released == [0]
    t.p.drop(a)  # host weights but no slot: nothing to release
    assert t.slots.released == [0]
    assert t.p.can_bind({a.uid, b.uid})


def test_tiered_prefetch_fills_spare_slots_for_the_queue_only_up_to_the_knob():
    t = Policy(TieredResidency, slots=3, max_loras_prefetch=1)
    a, b, c = t.add("a"), t.add("b"), t.add("c")
    cold = t.add("cold", resident=False)
    assert t.p.prefetch([cold, b, c], protected={b.uid, c.uid}) == 1  # cold has no weights
    assert b.slot is not None and b.prefetched and c.slot is None
    t.p.slot_for(a, {a.uid})
    t.p.slot_for(c, {c.uid})
    # full: a prefetched adapter never used goes before the least recently used one
    d = t.add("d")
    t.p.slot_for(d, {d.uid})
    assert b.slot is None and a.slot is not None and c.slot is not None
    assert Policy(TieredResidency).p.prefetch([a], set()) == 0  # no spare slots asked for


def test_tiered_limits():
    t = Policy(TieredResidency, max_loras_per_batch=3, max_loaded_loras=5,
               max_loras_prefetch=2)
    assert t.p.batch_cap == 3 and t.p.lookahead == 5 and t.p.max_reads(2) is None
    assert t.p.pin_limit == PinLimit("max_loras_per_batch", 3)
    assert TieredResidency.initial_slots(t.p.limits) == 5
    assert t.p.check() == []


# --- unified ----------------------------------------------------------------------------
def test_unified_load_packs_into_a_slot_keeping_only_the_description():
    u = Policy(UnifiedResidency, slots=1, max_loaded_loras=3)
    a = u.add("a")
    assert a.slot == 0 and u.slots.content == ["a"] and a.weights.layers == ()
    assert a.weights.fingerprint == "a" and a.weights.rank == 8 and a.weights.vocab is None
    assert u.p.tier(a) == "host"  # the slots are host memory


def test_unified_pool_doubles_within_max_loaded_and_reuses_freed_slots():
    u = Policy(UnifiedResidency, slots=1, max_loaded_loras=3)
    a, b = u.add("a"), u.add("b")
    assert u.slots.num_slots == 2 and (a.slot, b.slot) == (0, 1)
    c = u.add("c")
    assert u.slots.num_slots == 3 and c.slot == 2  # 4 would pass max_loaded_loras
    u.p.drop(a)  # host eviction: the slot is free for the next arrival, no growth
    assert (a.slot, a.weights, u.p.tier(a)) == (None, None, "disk")
    assert u.slots.released == [0]
    d = u.add("d")
    assert d.slot == 0 and u.slots.num_slots == 3 and u.slots.content[0] == "d"


def test_unified_bind_never_writes_or_evicts():
    u = Policy(UnifiedResidency, slots=2, max_loaded_loras=4)
    ads = [u.add(n) for n in "abcd"]
    writes = u.slots.writes
    assert u.p.can_bind({e.uid for e in ads})  # no distinct-adapter cap
    assert [u.p.slot_for(e, {e.uid}) for e in ads] == [e.slot for e in ads]
    assert u.p.prefetch(ads, set()) == 0 and u.slots.writes == writes
    assert all(e.stats.slot_evictions == 0 for e in ads)
    cold = u.add("cold", resident=False)
    with pytest.raises(RuntimeError, match="without host weights"):
        u.p.slot_for(cold, {cold.uid})


def test_unified_refused_weights_change_nothing():
    class Refusing(GrowingSlots):
        def write(self, slot, w):
            raise ValueError("rank 99 exceeds max_lora_rank 64")

    entries: dict[int, AdapterEntry] = {}
    policy = UnifiedResidency(Refusing(1), entries, ResidencyLimits(1, max_loaded_loras=2))
    e = AdapterEntry(uid=1, name="a", path="/p/a", fingerprint="a")
    entries[1] = e
    with pytest.raises(ValueError, match="exceeds"):
        policy.admit(e, weights("a"))
    assert (e.slot, e.weights) == (None, None)


def test_unified_limits_and_check():
    u = Policy(UnifiedResidency, max_loaded_loras=6)
    assert u.p.batch_cap is None and u.p.lookahead == 6 and u.p.max_reads(2) == 2
    assert u.p.pin_limit == PinLimit("max_loaded_loras", 6)
    assert Policy(UnifiedResidency, unified_prefetch=False).p.lookahead == 1  # the next only
    assert Policy(UnifiedResidency).p.pin_limit.max_pinned is None  # unbounded host memory
    assert UnifiedResidency.initial_slots(ResidencyLimits(8, max_loaded_loras=2)) == 2
    assert UnifiedResidency.initial_slots(ResidencyLimits(8)) == 4
    a = u.add("a")
    assert u.p.check() == []
    a.weights = None  # host weights gone, slot kept: what the policy never does
    assert u.p.check() == ["adapter a: in one adapter memory, host means a slot"]


# --- shared -----------------------------------------------------------------------------
def test_pin_limit_leaves_one_place_free():
    assert PinLimit("k", 3).max_pinned == 2
    assert PinLimit("k", 3).allows(2) and not PinLimit("k", 3).allows(3)
    assert PinLimit("k", 1).max_pinned == 0 and not PinLimit("k", 1).allows(1)
    assert PinLimit("k", None).allows(10**6)
    assert str(PinLimit("max_loaded_loras", 3)) == (
        "at most max_loaded_loras - 1 = 2 adapters may be pinned")


def test_policies_by_name():
    assert set(RESIDENCIES) == {"tiered", "unified"}
    assert residency_class("unified") is UnifiedResidency
    with pytest.raises(ValueError, match="unknown adapter memory 'auto'.*resolve"):
        residency_class("auto")
    limits = ResidencyLimits.of(EngineConfig(max_loras_per_batch=3, max_loaded_loras=7,
                                             max_loras_prefetch=1, unified_prefetch=False))
    assert limits == ResidencyLimits(3, 7, 1, False)

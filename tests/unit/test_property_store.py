"""Property-based test (hypothesis, stateful) of the adapter store, with a fake slot
pool and a fake disk loader (tests/unit/test_adapter_store.py): random sequences of load / unload /
pin / acquire (a request, forks included) / release / prepare / finish or break a disk read /
bind keep every invariant of the store's own check (refcounts equal live requests, slots hold
their adapter's weights, host and pin caps, no stuck or orphan loads), in both tiered and
unified (one adapter memory) mode. Also: a running adapter keeps its host weights, a pinned
one is never evicted, and a failed load or register changes nothing."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_adapter_store import FakeLoader, FakeSlots, weights

from loraserve.adapters.residency import ResidencyLimits
from loraserve.adapters.store import AdapterStore
from loraserve.adapters.store_check import check_store
from loraserve.types import LoraServeError

NAMES = [f"n{i}" for i in range(6)]


class GrowingSlots(FakeSlots):
    def grow(self, num_slots: int) -> None:
        self.content += [None] * (num_slots - self.num_slots)
        self.num_slots = max(self.num_slots, num_slots)

    def before_step(self, slots) -> None:  # GPU slot copies: nothing to wait for here
        pass


def test_unified_queue_reads_stay_within_the_loader_workers():
    # A read queued behind busy workers would evict a resident adapter long before its own
    # weights land: the queue's prefetch starts at most `workers` reads at a time.
    loader = FakeLoader()
    store = AdapterStore(GrowingSlots(1), loader, ResidencyLimits(1, max_loaded_loras=8),
                         memory="unified")
    # the lookahead (max_loaded_loras) takes in the whole queue: only the workers limit
    # the reads (each evicts a resident adapter no request needs)
    uids = [store.register(n, f"/p/{n}", weights(n)).uid for n in "abcdefghijk"]
    uids = uids[:3]  # evicted to disk by the last three
    assert not any(store.is_ready(u) for u in uids)
    store.prepare(in_use=set(), upcoming=uids[:3])
    assert loader.started == uids[:2]
    loader.finish()
    store.prepare(in_use=set(), upcoming=uids[:3])  # a, b land; c's read starts
    assert loader.started == uids[:3] and all(store.is_ready(u) for u in uids[:2])
    loader.finish()
    store.prepare(in_use=set(), upcoming=uids[:3])
    assert all(store.is_ready(u) for u in uids)


class CheckedLoader(FakeLoader):
    def check(self, uids):
        return [f"orphan load {u}" for u in self.pending if u not in uids]


class StoreMachine(RuleBasedStateMachine):
    memory = "tiered"

    def __init__(self):
        super().__init__()
        self.loader = CheckedLoader()
        self.store = AdapterStore(GrowingSlots(3), self.loader,
                                  ResidencyLimits(3, max_loaded_loras=4, max_loras_prefetch=1),
                                  memory=self.memory)
        self.live: list[int] = []  # one acquired uid per live request
        self.running: set[int] = set()  # adapters bound for running requests
        self.pinned_resident: set[int] = set()

    def _state(self):
        s = self.store
        return (dict(s.names), {u: (e.weights is not None, e.slot, e.pinned, e.refcount)
                                for u, e in s.entries.items()})

    @rule(name=st.sampled_from(NAMES), pinned=st.booleans(), new_weights=st.booleans(),
          replace=st.booleans())
    def load(self, name, pinned, new_weights, replace):
        path = f"/p/{name}" + ("-v2" if new_weights else "")
        before = self._state()
        try:  # replace: a new version; the old ones retire once idle and beyond the limit
            self.store.register(name, path, weights(path.rsplit("/", 1)[1]), pinned,
                                in_use=self.running, replace=replace)
        except LoraServeError:  # conflict, pin cap, host full of busy adapters
            assert self._state() == before, "a refused load changed the store"

    @precondition(lambda self: self.store.names)
    @rule(i=st.integers(0, 50))
    def unload(self, i):
        names = sorted(self.store.names)
        self.store.unregister(names[i % len(names)])

    @precondition(lambda self: self.store.names)
    @rule(i=st.integers(0, 50), forks=st.integers(1, 3))
    def request(self, i, forks):
        names = sorted(self.store.names)
        for _ in range(forks):  # n > 1: each sequence holds the adapter itself
            self.live.append(self.store.acquire(names[i % len(names)]))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def end_request(self, i):
        uid = self.live.pop(i % len(self.live))
        if uid not in self.live:
            self.running.discard(uid)
        self.store.release(uid)

    @rule()
    def prepare(self):
        waiting = [u for u in dict.fromkeys(self.live) if u not in self.running]
        failed = self.store.prepare(in_use=self.running, upcoming=waiting)
        for uid in failed:  # the engine fails the waiting requests of a failed load
            while uid in self.live and uid not in self.running:
                self.live.remove(uid)
                self.store.release(uid)

    @precondition(lambda self: self.loader.pending)
    @rule(i=st.integers(0, 50), broken=st.booleans())
    def finish_read(self, i, broken):
        todo = sorted(self.loader.pending)
        uid = todo[i % len(todo)]
        if broken:
            self.loader.broken.add(self.loader.pending[uid])
        self.loader.finish(uid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def bind(self, data):
        ready = sorted({u for u in self.live if self.store.is_ready(u)})
        if not ready:
            return
        want = set(data.draw(st.lists(st.sampled_from(ready), max_size=3)))
        if self.store.can_bind(self.running | want):
            got = self.store.bind(self.running | want)
            assert set(got) == self.running | want
            assert len(set(got.values())) == len(got), "two adapters share a slot"
            self.running |= want

    @invariant()
    def consistent(self):
        s = self.store
        waiting = [u for u in dict.fromkeys(self.live) if u not in self.running]
        assert check_store(s, Counter(self.live), self.running, waiting) == []
        for uid, e in s.entries.items():
            if e.pinned and e.weights is not None:
                self.pinned_resident.add(uid)
            if uid in self.pinned_resident and e.pinned:  # a replace moves the pin on
                assert e.weights is not None, "a pinned adapter was evicted"
            if uid in self.running:
                assert e.weights is not None, "a running adapter lost its weights"
        if s.residency.name == "unified":  # a queued read would evict a resident adapter
            # long before it lands
            assert self.loader.num_pending <= self.loader.workers, "reads beyond the workers"


class UnifiedStoreMachine(StoreMachine):
    memory = "unified"


SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None,
                    suppress_health_check=list(HealthCheck))
StoreMachine.TestCase.settings = SETTINGS
UnifiedStoreMachine.TestCase.settings = SETTINGS
test_tiered_store_under_random_operations = StoreMachine.TestCase
test_unified_store_under_random_operations = UnifiedStoreMachine.TestCase


def test_a_slot_refusing_reloaded_weights_fails_only_that_adapter():
    # Registered on disk while host memory was busy, an adapter is first packed when a
    # request reads it back; if the slot pool refuses the weights then, that load fails
    # (its requests get the error), the store stays consistent, the engine step goes on.
    class Refusing(GrowingSlots):
        def write(self, slot, w):
            if w.fingerprint == "bad":
                raise ValueError("layer 0 q_proj: rank 99 exceeds max_lora_rank 64")
            super().write(slot, w)

    loader = CheckedLoader()
    store = AdapterStore(Refusing(2), loader, ResidencyLimits(2, max_loaded_loras=1),
                         memory="unified")
    ok = store.register("ok", "/p/ok", weights("ok"))
    busy = store.acquire("ok")
    bad = store.register("bad", "/p/bad", weights("bad"), in_use={busy})
    assert bad.tier == "disk"
    store.release(busy)
    uid = store.acquire("bad")
    store.prepare(in_use=set(), upcoming=[uid])
    loader.finish(uid)
    failed = store.prepare(in_use=set(), upcoming=[uid])
    assert "exceeds max_lora_rank" in failed[uid] and bad.tier == "disk"
    store.release(uid)
    assert check_store(store, Counter(), set(), []) == [] and ok.uid in store.entries


def test_reads_in_flight_for_ended_requests_are_not_a_stall():
    """Found by the unified machine: host memory full of pinned adapters and reads in flight
    for adapters whose requests ended, while a new request waits on a cold adapter. The reads
    land, become evictable, and the next prepare starts the waiting one: progress, not a
    stall (the check had flagged it)."""
    loader = CheckedLoader()
    store = AdapterStore(GrowingSlots(3), loader, ResidencyLimits(3, max_loaded_loras=4),
                         memory="unified")
    for name, pinned in (("n4", True), ("n0", False), ("n1", False), ("n2", False),
                         ("n5", True), ("n3", False)):
        store.register(name, f"/p/{name}", weights(name), pinned)
    a, b = store.acquire("n0"), store.acquire("n1")  # both evicted to disk by now
    store.prepare(in_use=set(), upcoming=[a, b])  # their reads start, evicting n2, n3
    assert loader.num_pending == 2 and store.num_host == 2
    store.release(a)
    store.release(b)
    c = store.acquire("n2")
    assert check_store(store, Counter({c: 1}), set(), [c]) == []
    loader.finish()
    store.prepare(in_use=set(), upcoming=[c])  # lands n0, n1; evicts one for n2's read
    assert loader.is_loading(c)
    loader.finish()
    store.prepare(in_use=set(), upcoming=[c])
    assert store.is_ready(c) and check_store(store, Counter({c: 1}), set(), [c]) == []

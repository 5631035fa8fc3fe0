"""The AdapterStore alone, with a fake slot pool and a fake disk loader (no model, no torch
work): residency decisions, the one eviction rule, pure admission queries, and random
sequences of register / acquire / release / unload / pin / prepare / bind keeping every
invariant of docs/design.md §3."""

from __future__ import annotations

import random

import pytest

from loraserve.adapters.disk_loader import LoadResult
from loraserve.adapters.format import LoraAdapterWeights
from loraserve.adapters.residency import ResidencyLimits
from loraserve.adapters.store import AdapterStore
from loraserve.types import (
    AdapterBusyError,
    AdapterConflictError,
    AdapterNotFoundError,
    LoraServeError,
)


def weights(fp: str, rank: int = 8) -> LoraAdapterWeights:
    return LoraAdapterWeights(f"/w/{fp}", rank, frozenset(), (), 0, fp)


class FakeSlots:
    """Records which adapter's weights each slot holds."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.content: list[str | None] = [None] * num_slots
        self.writes = 0
        self.released: list[int] = []  # slots whose adapter left them, in order

    def write(self, slot: int, w: LoraAdapterWeights) -> None:
        self.content[slot] = w.fingerprint
        self.writes += 1

    def release(self, slot: int) -> None:
        self.released.append(slot)

    def before_step(self, slots) -> None:
        self.read_by_step = sorted(slots)  # on a GPU: the step waits for these slots' copies


class FakeLoader:
    """Disk reads that finish when the test says so; as in DiskLoader, a finished read counts
    as pending until collected. Paths map to fingerprints: '/p/x' reads weights 'x'; paths
    in `broken` fail."""

    workers = 2  # as DiskLoader's default: the unified store keeps no more reads in flight

    def __init__(self):
        self.pending: dict[int, str] = {}
        self.ready: dict[int, LoadResult] = {}
        self.broken: set[str] = set()
        self.started: list[int] = []

    def start(self, uid, path):
        if uid not in self.pending:
            self.pending[uid] = path
            self.started.append(uid)

    def is_loading(self, uid):
        return uid in self.pending

    @property
    def num_pending(self):
        return len(self.pending)

    def cancel(self, uid):
        self.pending.pop(uid, None)
        self.ready.pop(uid, None)

    def finish(self, uid=None):
        for u in [uid] if uid is not None else list(self.pending):
            path = self.pending[u]
            if path in self.broken:
                self.ready[u] = LoadResult(u, None, 0.0, "file vanished")
            else:
                self.ready[u] = LoadResult(u, weights(path.rsplit("/", 1)[1]), 0.01, None)

    def collect(self):
        out, self.ready = list(self.ready.values()), {}
        for r in out:
            del self.pending[r.uid]
        return out

    def wait_any(self, timeout):
        pass

    def shutdown(self):
        pass


def make(slots=3, per_batch=3, max_loaded=None, prefetch=0, reserved_names=frozenset()):
    loader = FakeLoader()
    store = AdapterStore(FakeSlots(slots), loader,
                         ResidencyLimits(per_batch, max_loaded, prefetch),
                         reserved_names=reserved_names)
    return store, loader


def reg(store, name, pinned=False, in_use=frozenset()):
    return store.register(name, f"/p/{name}", weights(name), pinned, in_use=in_use)


def test_host_eviction_order():
    store, _ = make(max_loaded=2, per_batch=3)
    a, b = reg(store, "a"), reg(store, "b")
    store.bind({a.uid})  # a used more recently than b
    reg(store, "c")
    assert (a.tier, b.tier) == ("device", "disk") and b.stats.host_evictions == 1
    assert "b" in store.names  # evicted, still registered
    # host memory busy: a new adapter is registered on disk (read back when used) ...
    d = reg(store, "d", in_use={a.uid, store.names["c"]})
    assert d.tier == "disk" and store.names["d"] == d.uid and a.tier == "device"
    # ... but one to pin must be resident: retry later (503)
    with pytest.raises(AdapterBusyError, match="all pinned or in use"):
        reg(store, "e", pinned=True, in_use={a.uid, store.names["c"]})
    assert "e" not in store.names


def test_pinned_never_evicted_and_pin_limit():
    store, _ = make(max_loaded=2, per_batch=3)
    p = reg(store, "p", pinned=True)
    reg(store, "q")
    reg(store, "r")  # evicts q, never p
    assert p.weights is not None and store.entries[store.names["q"]].weights is None
    reg(store, "s", pinned=True)  # second pin: per_batch - 1 = 2
    with pytest.raises(LoraServeError, match="pinned"):
        store.check_new("t", "/p/t", pinned=True)


def test_names_conflicts_and_no_op_reload():
    store, _ = make(reserved_names=frozenset({"Base-Model"}))
    a = reg(store, "a")
    assert store.check_new("a", "/p/a", False) is True  # same name and path: a no-op
    assert store.register("a", "/p/a", None, pinned=True) is a and a.pinned
    with pytest.raises(AdapterConflictError):
        store.check_new("a", "/p/other", False)
    for bad in ("x:y", "", "a/b", "n" * 65, "good\n", "..", ".", "a\nb"):
        with pytest.raises(LoraServeError, match="invalid adapter name"):
            store.check_new(bad, "/p/x", False)
    with pytest.raises(AdapterNotFoundError):
        store.acquire("nope")
    with pytest.raises(LoraServeError, match="base model's name"):
        store.check_new("Base-Model", "/p/b", False)
    assert store.check_new("a.b-c_1", "/p/x", False) is False  # dots inside are fine


def test_unload_drains_then_frees_and_a_reload_gets_a_new_uid():
    store, _ = make()
    a = reg(store, "a")
    uid = store.acquire("a")
    store.bind({uid})
    store.unregister("a")
    assert "a" not in store.names and uid in store.entries and a.slot is not None
    with pytest.raises(AdapterNotFoundError):
        store.acquire("a")
    a2 = reg(store, "a")
    assert a2.uid != uid
    store.release(uid)
    assert uid not in store.entries and uid not in store.slot_owner and a.weights is None
    with pytest.raises(RuntimeError, match="released more often"):
        store.release(a2.uid)


def test_prepare_starts_loads_for_the_waiting_queue_only():
    store, loader = make(max_loaded=1, per_batch=2)
    a, b = reg(store, "a"), reg(store, "b")  # b evicted a
    assert a.tier == "disk"
    assert store.is_ready(b.uid) and not store.is_ready(a.uid)
    assert not loader.started  # queries and registration start no read
    assert store.prepare(in_use={b.uid}, upcoming=[a.uid]) == {}
    assert not loader.started  # b is in use and host holds one: a must wait
    store.prepare(in_use=set(), upcoming=[a.uid])
    assert loader.started == [a.uid] and b.tier == "disk"
    loader.finish()
    store.prepare(in_use=set(), upcoming=[a.uid])
    assert store.is_ready(a.uid) and a.stats.loads == 2


def test_failed_load_is_reported_once_and_retried_later():
    store, loader = make(max_loaded=1)
    a, _ = reg(store, "a"), reg(store, "b")
    loader.broken.add("/p/a")
    store.prepare(set(), [a.uid])
    loader.finish()
    failed = store.prepare(set(), [a.uid])
    assert list(failed) == [a.uid] and "'a' failed to load: file vanished" in failed[a.uid]
    assert a.last_error == "file vanished" and a.weights is None
    assert store.prepare(set(), [a.uid]) == {} and loader.pending  # a later request retries


def test_changed_files_fail_the_reload():
    store, loader = make(max_loaded=1)
    a, _ = reg(store, "a"), reg(store, "b")
    a.path = "/p/other"  # the same uid would read other weights
    store.prepare(set(), [a.uid])
    loader.finish()
    assert "changed on disk" in store.prepare(set(), [a.uid])[a.uid]


def test_can_bind_counts_pinned_slots_and_bind_fully_rewrites():
    store, _ = make(slots=2, per_batch=2)
    p, a, b = reg(store, "p", pinned=True), reg(store, "a"), reg(store, "b")
    assert store.bind({p.uid}) == {p.uid: p.slot}
    assert store.can_bind({a.uid}) and not store.can_bind({a.uid, b.uid})
    slots = store.bind({a.uid})
    assert store.slots.content[slots[a.uid]] == "a"
    assert store.slots.read_by_step == [slots[a.uid]]  # the step is ordered after its copy
    store.bind({b.uid})  # evicts a's slot (p is pinned)
    assert a.slot is None and a.stats.slot_evictions == 1 and store.slots.content[b.slot] == "b"
    assert store.can_bind(set()) and store.slot_owner.count(None) == 0


def test_prefetch_fills_spare_slots_and_prefetched_go_first():
    store, _ = make(slots=3, per_batch=2, prefetch=1)
    a, b, c = reg(store, "a"), reg(store, "b"), reg(store, "c")
    store.bind({a.uid})
    store.prepare(in_use={a.uid}, upcoming=[b.uid])
    assert b.tier == "device" and b.prefetched and store.slots_prefetched == 1
    store.bind({c.uid})
    store.bind({a.uid, c.uid})  # full now: a, c used; b prefetched and unused
    d = reg(store, "d")
    store.bind({d.uid})
    assert b.slot is None and a.slot is not None and c.slot is not None


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_keep_every_invariant(seed):
    rng = random.Random(seed)
    store, loader = make(slots=4, per_batch=3, max_loaded=rng.choice([None, 2, 3, 5]),
                         prefetch=1)
    names = [f"n{i}" for i in range(7)]
    live: list[int] = []  # acquired uids (one per request), running or waiting
    running: set[int] = set()  # uids bound for running requests
    ever_pinned_loaded: set[int] = set()
    seen = {}  # every entry of the walk, unloaded ones included
    for _ in range(400):
        op = rng.random()
        name = rng.choice(names)
        if op < 0.15:
            try:
                reg(store, name, pinned=rng.random() < 0.2, in_use=running)
            except LoraServeError:
                pass
        elif op < 0.22 and name in store.names:
            store.unregister(name)
        elif op < 0.4 and store.names:
            live.append(store.acquire(rng.choice(sorted(store.names))))
        elif op < 0.6 and live:  # a request ends
            uid = live.pop(rng.randrange(len(live)))
            if uid not in live:
                running.discard(uid)
            store.release(uid)
        elif op < 0.75:
            waiting = [u for u in dict.fromkeys(live) if u not in running]
            store.prepare(in_use=running, upcoming=waiting)
        elif op < 0.85:
            todo = [u for u in loader.pending if u not in loader.ready]
            if todo:
                if rng.random() < 0.2:
                    loader.broken.add(loader.pending[todo[0]])
                loader.finish(rng.choice(todo))
        else:
            want = {u for u in live if store.is_ready(u) and rng.random() < 0.7}
            if want and store.can_bind(running | want):
                got = store.bind(running | want)
                assert set(got) == running | want
                running |= want
        check_invariants(store, live, running, ever_pinned_loaded)
        seen.update(store.entries)
    # the walk went through the interesting states, not around them
    assert store.slots.writes > 5
    max_loaded = store.residency.limits.max_loaded_loras
    if max_loaded is not None and max_loaded < 5:
        assert loader.started and any(e.stats.host_evictions for e in seen.values())


def check_invariants(store, live, running, ever_pinned_loaded):
    for uid, e in store.entries.items():
        assert e.refcount == live.count(uid), "refcount differs from live requests"
        if e.slot is not None:
            assert e.weights is not None, "a slot without host weights"
            assert store.slots.content[e.slot] == e.fingerprint, "slot holds other weights"
        if e.uid in running:
            assert e.slot is not None, "a running adapter lost its slot or host weights"
        if e.pinned and e.weights is not None:
            ever_pinned_loaded.add(uid)
        if uid in ever_pinned_loaded:
            assert e.weights is not None, "a pinned adapter was evicted"
        if e.unloading:
            assert e.refcount > 0, "a drained adapter was not freed"
            assert e.name not in store.names or store.names[e.name] != uid
    owners = [u for u in store.slot_owner if u is not None]
    assert len(owners) == len(set(owners))
    limits = store.residency.limits
    if limits.max_loaded_loras is not None:
        assert store.num_host <= limits.max_loaded_loras
    assert store.num_pinned <= limits.max_loras_per_batch - 1
    assert set(store.names.values()) <= set(store.entries)

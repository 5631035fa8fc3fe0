"""Admission rules (scheduler/admission.py), driven through the scheduler with a fake adapter
store: the distinct-adapter cap counts everything in the batch (running requests, chunked
prefills, this step's admits; base counts as one), slots, adapters still loading, the
starvation bound, and refusals that change nothing."""

from __future__ import annotations

from loraserve.config import EngineConfig
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request
from loraserve.scheduler.batch import StepOutput
from loraserve.scheduler.scheduler import Scheduler
from loraserve.types import SamplingParams


class FakeResidency:
    def __init__(self, num_slots: int = 8, batch_cap: int | None = 2):
        self.batch_cap = batch_cap
        self.loading: set[int] = set()
        self.num_slots = num_slots
        self.queries = 0

    def is_ready(self, uid):
        self.queries += 1
        return uid not in self.loading

    def can_bind(self, uids):
        return len(uids) <= self.num_slots


def make(cap=2, slots=8, **knobs):
    cfg = EngineConfig(kv_cache_tokens=1024, block_size=4, max_loras_per_batch=cap, **knobs)
    res = FakeResidency(slots, cap)
    return Scheduler(cfg, KVCacheManager(256, 4, enable_prefix_caching=False), res), res


def req(rid, uid, n=4, max_tokens=4):
    return Request(rid, list(range(4, 4 + n)), SamplingParams(max_tokens=max_tokens),
                   adapter_uid=uid)


def ids(batch):
    return [r.request_id for r, _ in batch.entries]


def advance(s, batch):
    rids = [r.request_id for r, n in batch.entries if r.num_computed_tokens + n == r.num_tokens]
    return s.update_from_output(batch, StepOutput(rids, [5] * len(rids)))


def test_base_counts_as_one_adapter():
    s, _ = make(cap=2)
    for r in (req("base", None), req("a", 1), req("b", 2)):
        s.add(r)
    assert ids(s.schedule()) == ["base", "a"]  # base + a = 2: b waits
    assert [r.request_id for r in s.waiting] == ["b"]


def test_cap_counts_a_running_chunked_prefill():
    # a's long prompt is prefilled in 8-token chunks over four steps. b (a second adapter)
    # fits a cap of 2 beside it, and goes before a's next chunk (it was served less); c (a
    # third) waits until one of them is gone.
    s, _ = make(cap=2, max_num_batched_tokens=8)
    a, b, c = req("a", 1, n=30, max_tokens=20), req("b", 2, n=3), req("c", 3, n=3)
    s.add(a)
    advance(s, s.schedule())
    s.add(b)
    s.add(c)
    second = s.schedule()
    assert ids(second) == ["b", "a"] and c in s.waiting and c.blocked_steps == 1
    advance(s, second)
    for _ in range(40):
        batch = s.schedule()
        in_batch = {r.adapter_uid for r in s.running}
        assert len(in_batch) <= 2, "a third adapter joined while two were in the batch"
        if c in s.running:
            assert b.is_finished  # c got in only once b was done
        advance(s, batch)
    assert a.is_finished and b.is_finished and c.is_finished


def test_loading_adapter_is_skipped_not_counted_as_blocked():
    s, res = make(cap=4)
    res.loading.add(1)
    a, b = req("a", 1), req("b", 2)
    s.add(a)
    s.add(b)
    assert ids(s.schedule()) == ["b"]
    assert a.blocked_steps == 0 and a.block_table == []
    res.loading.clear()
    assert ids(s.schedule()) == ["b", "a"]


def test_slots_refuse_without_side_effects():
    s, _ = make(cap=8, slots=1)
    a, b = req("a", 1), req("b", 2)
    s.add(a)
    s.add(b)
    free = s.kv.pool.num_free
    batch = s.schedule()
    assert ids(batch) == ["a"] and b.block_table == [] and b.blocked_steps == 1
    assert s.kv.pool.num_free == free - len(a.block_table)


def test_starvation_bound_stops_newer_admissions():
    s, _ = make(cap=1, starvation_steps=3)
    s.add(req("long", 1, max_tokens=50))
    advance(s, s.schedule())
    starved = req("starved", 2)
    s.add(starved)
    admitted = []
    for i in range(6):
        s.add(req(f"same{i}", 1))  # same adapter as the running one: fits the cap
        batch = s.schedule()
        admitted += [r.request_id for r, _ in batch.entries if r.request_id != "long"
                     and r.num_computed_tokens == 0]
        advance(s, batch)
    # refused twice, newer requests went ahead; from the third refusal on, none does
    assert admitted == ["same0", "same1"]
    assert starved.blocked_steps >= 3 and starved in s.waiting


def test_fan_out_of_one_origin_does_not_queue_others_behind_all_of_it():
    s, _ = make(cap=4)
    big = [Request(f"A{i}", [4, 5, 6], SamplingParams(max_tokens=4), origin="A")
           for i in range(6)]
    for r in big:
        s.add(r)
    s.add(Request("B0", [4, 5], SamplingParams(max_tokens=4), origin="B"))
    s.add(Request("B1", [4, 5], SamplingParams(max_tokens=4), origin="B"))
    s.add(Request("C0", [4, 5], SamplingParams(max_tokens=4), origin="C"))
    s.add(Request("offline", [4, 5], SamplingParams(max_tokens=4)))  # no origin: at the end
    order = [r.request_id for r in s.waiting]
    assert order == ["A0", "B0", "C0", "A1", "B1", "A2", "A3", "A4", "A5", "offline"]


def test_one_client_request_holds_at_most_its_fair_share_while_others_wait():
    # 8 seats, share 0.5: with B waiting, A may hold 4 seats; alone, A may hold all 8.
    s, _ = make(cap=4, max_num_seqs=8)
    for i in range(10):
        s.add(Request(f"A{i}", [4, 5, 6], SamplingParams(max_tokens=4), origin="A"))
    first = s.schedule()  # A alone: work-conserving, it takes every seat
    assert len(first.entries) == 8
    advance(s, first)
    s2, _ = make(cap=4, max_num_seqs=8)
    for i in range(10):
        s2.add(Request(f"A{i}", [4, 5, 6], SamplingParams(max_tokens=4), origin="A"))
    for i in range(6):
        s2.add(Request(f"B{i}", [4, 5], SamplingParams(max_tokens=4), origin="B"))
    batch = s2.schedule()
    origins = [r.origin for r, _ in batch.entries]
    assert origins.count("A") == 4 and origins.count("B") == 4
    assert all(r.blocked_steps == 0 for r in s2.waiting)  # a deferral is not a refusal


def test_fair_share_counts_kv_tokens_and_always_admits_a_first_sequence():
    # KV 1024 tokens, share 0.7 = 716: A's sequences of 300 prompt + 100 out fit one at a time
    # while B waits (queue A0 B0 A1 B1 A2; 3 seats): A1 is deferred and B1 takes its seat.
    s, _ = make(cap=4, max_num_seqs=3, max_num_batched_tokens=4096, request_fair_share=0.7)
    for i in range(3):
        s.add(Request(f"A{i}", list(range(4, 304)), SamplingParams(max_tokens=100), origin="A"))
    s.add(Request("B0", [4, 5], SamplingParams(max_tokens=4), origin="B"))
    s.add(Request("B1", [4, 5], SamplingParams(max_tokens=4), origin="B"))
    assert sorted(ids(s.schedule())) == ["A0", "B0", "B1"]
    s2, _ = make(cap=4, max_num_seqs=2, request_fair_share=0.1)  # 0.2 seats: still one
    s2.add(Request("A0", [4, 5], SamplingParams(max_tokens=4), origin="A"))
    s2.add(Request("A1", [4, 5], SamplingParams(max_tokens=4), origin="A"))
    s2.add(Request("B0", [4, 5], SamplingParams(max_tokens=4), origin="B"))
    assert sorted(ids(s2.schedule())) == ["A0", "B0"]

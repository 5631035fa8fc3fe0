"""Property-based test (hypothesis, stateful) of the scheduler with the KV cache manager and
the adapter store (fake slots and disk reads), stepped the way LLMEngine.step does with a fake
forward pass. Random sequences of add (n > 1 forks, shared prefixes, several clients) /
abort / step / step costs that move the prefill budget / pause and resume (a client that does
not read) / load / unload (mid-flight) / pin / finish or break a disk read keep
every invariant of the engine's check (engine/invariants.py) between steps, and at the end
every request still queued completes: nothing stalls, no block or refcount leaks."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_adapter_store import weights
from test_property_store import CheckedLoader, GrowingSlots

from loraserve.adapters.residency import ResidencyLimits
from loraserve.adapters.store import AdapterStore
from loraserve.config import EngineConfig
from loraserve.engine.invariants import check_engine
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request
from loraserve.scheduler.batch import StepOutput
from loraserve.scheduler.scheduler import Scheduler
from loraserve.types import FinishReason, LoraServeError, SamplingParams

NAMES = ["a", "b", "c", "d"]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9], [6]]


class NoDetokenizer:
    def tracked_ids(self):
        return []


class MiniEngine:
    """LLMEngine's step and request bookkeeping over the real scheduler, KV manager and
    store, with a forward pass that samples token 7 (what check_engine reads)."""

    def __init__(self, unified: bool):
        self.config = EngineConfig(max_num_seqs=5, max_num_batched_tokens=16,
                                   max_loras_per_batch=2, starvation_steps=4)
        self.kv = KVCacheManager(num_blocks=12, block_size=4)
        self.loader = CheckedLoader()
        self.store = AdapterStore(GrowingSlots(2), self.loader,
                                  ResidencyLimits(2, max_loaded_loras=3),
                                  memory="unified" if unified else "tiered")
        self.scheduler = Scheduler(self.config, self.kv, self.store, eos_token_ids=[0])
        self.output_processor = NoDetokenizer()
        self.requests: dict[str, Request] = {}

    def retire(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        req.fork_parent, req.forks = None, []
        if req.adapter_uid is not None:
            uid, req.adapter_uid = req.adapter_uid, None
            self.store.release(uid)

    def abort(self, req: Request) -> None:
        for fork in list(req.forks):
            self.abort(fork)
        if not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT)
            self.retire(req)

    def step(self) -> None:
        sched = self.scheduler
        errors = self.store.prepare(sched.running_adapters(), sched.waiting_adapters())
        for req in sched.fail_waiting(errors):
            self.retire(req)
        batch = sched.schedule()
        if not batch:
            return
        self.store.bind(batch.adapter_uids)
        done = [r.request_id for r, n in batch.entries if r.num_computed_tokens + n == r.num_tokens]
        out = StepOutput(done, [7] * len(done))
        for req in sched.update_from_output(batch, out):
            if req.is_finished:
                self.retire(req)


class SchedulerMachine(RuleBasedStateMachine):
    unified = False

    def __init__(self):
        super().__init__()
        self.eng = MiniEngine(self.unified)
        self.ids = itertools.count()

    @rule(name=st.sampled_from(NAMES), pinned=st.booleans(), v2=st.booleans())
    def load(self, name, pinned, v2):
        path = f"/p/{name}{'-v2' if v2 else ''}"
        try:
            self.eng.store.register(name, path, weights(path[3:]), pinned,
                                    in_use=self.eng.scheduler.running_adapters())
        except LoraServeError:
            pass

    @precondition(lambda self: self.eng.store.names)
    @rule(i=st.integers(0, 50))
    def unload(self, i):
        names = sorted(self.eng.store.names)
        self.eng.store.unregister(names[i % len(names)])

    @rule(adapter=st.sampled_from([None, *NAMES]), prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(1, 9), max_size=5), n=st.integers(1, 3),
          max_tokens=st.integers(1, 6), origin=st.sampled_from(["x", "y", None]),
          client=st.sampled_from(["c1", "c2", None]))
    def add(self, adapter, prefix, tail, n, max_tokens, origin, client):
        eng = self.eng
        if adapter is not None and adapter not in eng.store.names:
            return  # a 404 at admission: nothing queued
        parent = None
        for _ in range(n):
            uid = None if adapter is None else eng.store.acquire(adapter)
            ns = b"base" if uid is None else eng.store.fingerprint(uid).encode()
            req = Request(f"r{next(self.ids)}", prefix + tail,
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          adapter_uid=uid, origin=origin, cache_namespace=ns,
                          fork_parent=parent, client_id=client)
            parent = parent or req
            eng.requests[req.request_id] = req
            eng.scheduler.add(req)

    @precondition(lambda self: self.eng.requests)
    @rule(i=st.integers(0, 50))
    def abort(self, i):
        reqs = sorted(self.eng.requests)
        self.eng.abort(self.eng.requests[reqs[i % len(reqs)]])

    @rule()
    def step(self):
        self.eng.step()

    @rule(decodes=st.integers(0, 5), prefill=st.integers(0, 40), ms=st.integers(1, 50))
    def measured_step(self, decodes, prefill, ms):
        self.eng.scheduler.pace.observe(decodes, prefill, ms / 1000)

    @precondition(lambda self: self.eng.requests)
    @rule(i=st.integers(0, 50), resume=st.booleans())
    def pause_or_resume(self, i, resume):
        sched = self.eng.scheduler
        reqs = sorted(self.eng.requests)
        req = self.eng.requests[reqs[i % len(reqs)]]
        (sched.resume if resume else sched.pause)(req)

    @precondition(lambda self: self.eng.loader.pending)
    @rule(i=st.integers(0, 50), broken=st.booleans())
    def finish_read(self, i, broken):
        loader = self.eng.loader
        todo = sorted(loader.pending)
        uid = todo[i % len(todo)]
        if broken:
            loader.broken.add(loader.pending[uid])
        loader.finish(uid)

    @invariant()
    def consistent(self):
        assert check_engine(self.eng).violations == ()

    def teardown(self):
        eng = self.eng
        eng.loader.broken.clear()
        for req in list(eng.scheduler.paused.values()):  # their clients read again
            eng.scheduler.resume(req)
        for _ in range(400):  # everything queued completes: no stall, no deadlock
            if not eng.scheduler.has_work:
                break
            eng.loader.finish()
            eng.step()
            assert check_engine(eng).violations == ()
        assert not eng.scheduler.has_work and not eng.requests, eng.scheduler.waiting
        assert eng.kv.pool.num_free == eng.kv.pool.num_blocks, "KV blocks leaked"
        assert all(e.refcount == 0 and not e.unloading for e in eng.store.entries.values())


class UnifiedSchedulerMachine(SchedulerMachine):
    unified = True


SETTINGS = settings(max_examples=60, stateful_step_count=50, deadline=None,
                    suppress_health_check=list(HealthCheck))
SchedulerMachine.TestCase.settings = SETTINGS
UnifiedSchedulerMachine.TestCase.settings = SETTINGS
test_tiered_scheduler_under_random_operations = SchedulerMachine.TestCase
test_unified_scheduler_under_random_operations = UnifiedSchedulerMachine.TestCase


def test_a_pinned_adapter_unloaded_with_a_request_queued_gives_up_its_slot():
    # found by the machine above: b pinned holds one of the 2 slots while it drains (a request
    # of it queued), a new pin takes the pin limit's place at once, and a request for d (not
    # pinned) had no slot ever, starved, and held back b's last request: nothing moved
    m = SchedulerMachine()
    one = {"max_tokens": 1, "n": 1, "origin": "x", "prefix": PREFIXES[0], "tail": []}
    m.load(name="a", pinned=False, v2=False)
    m.load(name="d", pinned=False, v2=False)
    m.add(adapter="a", client="c2", **{**one, "max_tokens": 3, "n": 3})
    m.step()
    m.unload(i=0)  # a, with its requests in flight
    m.load(name="b", pinned=True, v2=False)
    m.add(adapter=None, client="c1", **one)
    m.add(adapter=None, client="c1", **one)
    m.add(adapter="d", client="c2", **one)
    m.add(adapter="b", client="c2", **{**one, "n": 2})
    m.unload(i=0)  # b, pinned, two requests queued
    m.load(name="a", pinned=True, v2=False)
    m.add(adapter="a", client="c1", **one)
    m.teardown()  # everything queued completes


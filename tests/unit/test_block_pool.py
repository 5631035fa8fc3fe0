"""KV block pool and manager: allocate/free, double free, and no leak however a request ends
(finished, preempted and recomputed, aborted mid-prefill or mid-decode, failed)."""

from __future__ import annotations

import pytest

from loraserve import LLM, SamplingParams
from loraserve.adapters.stats import AdapterStats
from loraserve.config import EngineConfig
from loraserve.engine.engine import LLMEngine
from loraserve.kvcache.block_pool import BlockPool
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request
from loraserve.types import FinishReason

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)



# ---- the pool --------------------------------------------------------------------------------


def test_pool_allocate_and_free():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and set(a + b) == set(range(8))
    assert (pool.num_free, pool.num_used) == (0, 8)
    assert pool.can_allocate(0) and not pool.can_allocate(1)
    pool.free(a)
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    c = pool.allocate(3)
    assert set(c) == set(a)
    pool.free(b + c)
    assert pool.num_free == 8 and pool.num_used == 0


def test_pool_exhaustion_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_pool_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([3])  # never allocated
    assert pool.num_free == 4


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_manager_block_arithmetic():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.capacity_tokens == 24
    req = Request("r", [1] * 5, GREEDY)
    assert kv.can_allocate(req, 5)
    kv.allocate(req, 5)  # 5 tokens -> 2 blocks
    assert len(req.block_table) == 2 and kv.usage == pytest.approx(2 / 6)
    req.num_computed_tokens = 5
    kv.allocate(req, 3)  # up to 8 tokens: still 2 blocks
    assert len(req.block_table) == 2
    req.num_computed_tokens = 8
    kv.allocate(req, 1)  # the 9th token opens a third block
    assert len(req.block_table) == 3
    assert kv.can_allocate(req, 16) and not kv.can_allocate(req, 17)  # 24, 25 of 24 tokens
    kv.free(req)
    assert req.block_table == [] and kv.pool.num_free == 6
    kv.free(req)  # safe twice: the table is empty
    assert kv.pool.num_free == 6


# ---- no leak through the engine --------------------------------------------------------------


def all_free(engine) -> bool:
    pool = engine.kv.pool
    return pool.num_free == pool.num_blocks and pool.num_used == 0


def drain(engine) -> dict:
    done = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 7 * i) % 500 + 4 for i in range(n)]


@pytest.fixture(scope="module")
def solo(tiny_model_dir):
    """Greedy outputs of requests run one at a time, for comparison."""
    llm = LLM(str(tiny_model_dir))

    def run(p, params=GREEDY):
        return llm.generate([p], params)[0].token_ids

    return run


def test_no_leak_after_preemption(tiny_model_dir, solo):
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=64, block_size=4, max_num_batched_tokens=32)
    prompts = [prompt(n, n) for n in (20, 12, 16, 9, 25, 5)]
    preempted = []
    orig = llm.engine.scheduler._preempt
    llm.engine.scheduler._preempt = lambda r, b: (preempted.append(r.request_id), orig(r, b))
    outs = llm.generate(prompts, GREEDY)
    assert preempted, "the pool was never short"
    assert all_free(llm.engine)
    assert [o.token_ids for o in outs] == [solo(p) for p in prompts]


def test_no_leak_after_abort_mid_prefill_and_mid_decode(tiny_model_dir, solo):
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=256, block_size=4, max_num_batched_tokens=8)
    eng = llm.engine
    long = eng.add_request(prompt(40), GREEDY)
    eng.step()  # first 8-token chunk of 40
    assert 0 < long.num_computed_tokens < 40 and long.block_table
    out = eng.abort(long.request_id)
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.token_ids == []
    assert all_free(eng) and not eng.has_work
    assert eng.abort(long.request_id) is None  # a second abort is a no-op

    keep = eng.add_request(prompt(6, 3), GREEDY)
    dec = eng.add_request(prompt(5, 9), SamplingParams(max_tokens=50, temperature=0.0,
                                                       ignore_eos=True))
    waiting = eng.add_request(prompt(30, 1), GREEDY)  # budget is spent: stays queued a while
    while dec.num_output_tokens < 3:
        eng.step()
    assert dec.block_table
    assert eng.abort(dec.request_id).finish_reason is FinishReason.ABORT
    done = drain(eng)
    assert done[keep.request_id].token_ids == solo(prompt(6, 3))
    assert done[waiting.request_id].token_ids == solo(prompt(30, 1))
    assert all_free(eng)

    never_ran = eng.add_request(prompt(7), GREEDY)
    eng.abort(never_ran.request_id)  # aborted while waiting
    assert all_free(eng) and not eng.has_work


class BreakingStore:
    """An adapter store whose adapter 'x' (uid 7) is ready at first, and whose reload from
    disk fails once `victim` was preempted (its host copy evicted, the file gone meanwhile)."""

    batch_cap = 8

    def __init__(self):
        self.victim: Request | None = None

    def acquire(self, name):
        return 7

    def fingerprint(self, uid):
        return "x"

    def version(self, uid):
        return 1

    def stats(self, uid):
        return AdapterStats()

    def release(self, uid):
        pass

    def prepare(self, in_use, upcoming):
        if self.victim is not None and self.victim.num_preemptions and 7 in upcoming:
            return {7: "adapter 'x' failed to load: file vanished"}
        return {}

    def is_ready(self, uid):
        return True

    def can_bind(self, uids):
        return True

    def bind(self, uids):
        return {u: 0 for u in uids}  # an empty slot: the delta is zero


def test_no_leak_after_a_request_errors(tiny_model_dir, solo):
    cfg = EngineConfig(kv_cache_tokens=64, block_size=4, max_num_batched_tokens=64)
    eng = LLMEngine(str(tiny_model_dir), cfg)
    gate = BreakingStore()
    eng.store = eng.scheduler.adapters = gate
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    a = eng.add_request(prompt(20, 2), params)
    b = eng.add_request(prompt(10, 4), params)
    x = eng.add_request(prompt(10, 6), params, lora_name="x")  # admitted last: preempted first
    gate.victim = x
    done = drain(eng)
    assert x.num_preemptions == 1
    out = done[x.request_id]
    assert out.finish_reason is FinishReason.ERROR and "failed to load" in out.error
    assert done[a.request_id].token_ids == solo(prompt(20, 2), params)
    assert done[b.request_id].token_ids == solo(prompt(10, 4), params)
    assert all_free(eng) and not eng.requests

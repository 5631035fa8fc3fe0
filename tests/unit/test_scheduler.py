"""Scheduler admission and preemption (driven without a model), and what add_request refuses."""

from __future__ import annotations

import pytest

from loraserve import LLM, SamplingParams
from loraserve.config import EngineConfig
from loraserve.kvcache.manager import NO_PREFIX, KVCacheManager
from loraserve.request import Request, RequestStatus
from loraserve.scheduler.batch import StepOutput
from loraserve.scheduler.scheduler import Scheduler
from loraserve.types import FinishReason, LoraServeError, RequestTooLargeError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)



class CheckedKV(KVCacheManager):
    """Fails the test if `allocate` is ever called without a successful `can_allocate` for
    the same request and token count just before (check/commit)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.ok: tuple | None = None
        self.refused = 0

    def can_allocate(self, req, n, prefix=NO_PREFIX):
        ok = super().can_allocate(req, n, prefix)
        self.ok = (id(req), n, prefix) if ok else None
        self.refused += not ok
        return ok

    def allocate(self, req, n, prefix=NO_PREFIX):
        assert self.ok == (id(req), n, prefix), "allocate without a successful can_allocate"
        self.ok = None
        super().allocate(req, n, prefix)


def make(kv_tokens=256, block_size=4, **knobs) -> Scheduler:
    # The prompts below share prefixes (4, 5, 6, ...): token counts here assume no cache
    # unless a test turns it on (tests/test_prefix_cache.py tests the cache).
    knobs.setdefault("enable_prefix_caching", False)
    cfg = EngineConfig(kv_cache_tokens=kv_tokens, block_size=block_size, **knobs)
    return Scheduler(cfg, CheckedKV(kv_tokens // block_size, block_size,
                                    cfg.enable_prefix_caching))


def req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(4, 4 + n)), SamplingParams(max_tokens=max_tokens,
                                                              temperature=0.0))


def fake_model(batch) -> StepOutput:
    """A model that always says token 5, for every request whose tokens are all computed."""
    rids = [r.request_id for r, n in batch.entries if r.num_computed_tokens + n == r.num_tokens]
    return StepOutput(rids, [5] * len(rids))


def step(s: Scheduler):
    """One step as the engine runs it: schedule, the fake model, update_from_output."""
    batch = s.schedule()
    assert batch.num_tokens <= s.config.max_num_batched_tokens
    assert len(batch.entries) <= s.config.max_num_seqs
    for r, n in batch.entries:
        assert r.status is RequestStatus.RUNNING
        assert len(r.block_table) * s.kv.block_size >= r.num_computed_tokens + n
    s.update_from_output(batch, fake_model(batch))
    return batch


def run(s: Scheduler, limit: int = 500) -> list:
    batches = []
    while s.has_work:
        batches.append(step(s))
        assert len(batches) < limit, "no progress"
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    return batches


def test_chunked_prefill_of_a_prompt_longer_than_the_budget():
    s = make(max_num_batched_tokens=8)
    r = req("long", 30, max_tokens=3)
    s.add(r)
    sizes = [dict((q.request_id, n) for q, n in b.entries)["long"] for b in run(s)]
    assert sizes == [8, 8, 8, 6, 1, 1]  # four prefill chunks, then two decodes
    assert r.num_output_tokens == 3


@pytest.mark.parametrize("fair", [True, False])
def test_token_budget_and_decodes_first(fair):
    s = make(max_num_batched_tokens=10, fair_scheduling=fair)
    reqs = [req(f"r{i}", n) for i, n in enumerate([3, 17, 9, 12, 2])]
    for r in reqs:
        s.add(r)
    full = 0
    while s.has_work:
        before = list(s.running)
        decoding = [r for r in before if r.num_tokens - r.num_computed_tokens == 1]
        batch = step(s)  # asserts the budget
        full += batch.num_tokens == 10
        scheduled = [q for q, _ in batch.entries]
        # Decodes go first, every step; first come, first served also gives running prompts
        # their next chunk before anyone is admitted.
        assert scheduled[: len(decoding)] == decoding == scheduled[: batch.num_decodes]
        if not fair:
            assert scheduled[: len(before)] == before
    assert full >= 3 and s.kv.pool.num_free == s.kv.pool.num_blocks
    assert all(r.num_output_tokens == 4 for r in reqs)


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    reqs = [req(f"r{i}", 3) for i in range(5)]
    for r in reqs:
        s.add(r)
    first = s.schedule()
    assert [q.request_id for q, _ in first.entries] == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 3
    s.update_from_output(first, fake_model(first))
    assert len(step(s).entries) == 2
    run(s)
    assert all(r.num_output_tokens == 4 for r in reqs)


def test_fcfs_on_memory():
    # 16 blocks of 4 tokens. A holds 10; B needs 8 and must wait; C (1 block) would fit but
    # may not overtake B.
    s = make(kv_tokens=64)
    a, b, c = req("a", 40, max_tokens=2), req("b", 30), req("c", 4)
    s.add(a)
    step(s)
    s.add(b)
    s.add(c)
    batch = step(s)
    assert [q.request_id for q, _ in batch.entries] == ["a"]
    assert list(s.waiting) == [b, c]
    assert s.kv.refused >= 1
    run(s)
    assert b.num_output_tokens == 4 and c.num_output_tokens == 4


def test_preemption_picks_the_most_recently_admitted():
    # 12 blocks of 4 = 48 tokens; three 12-token prompts take 9 blocks, decodes need more.
    s = make(kv_tokens=48, max_num_batched_tokens=64)
    reqs = [req(f"r{i}", 12, max_tokens=12) for i in range(3)]
    for r in reqs:
        s.add(r)
    step(s)
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"]
    preempted = []
    while not preempted:
        preempted = step(s).preempted
    (victim,) = preempted
    assert victim is reqs[2]
    assert victim.status is RequestStatus.WAITING and s.waiting[0] is victim
    assert victim.num_computed_tokens == 0 and victim.block_table == []
    assert victim.num_output_tokens > 0  # it keeps its output and recomputes prompt + output
    run(s)
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert victim.num_preemptions >= 1


# ---- through the engine ----------------------------------------------------------------------


def prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 11 * i) % 500 + 4 for i in range(n)]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir))


def test_preempted_request_completes_with_the_same_greedy_output(tiny_model_dir, tiny_llm):
    prompts = [prompt(n, n) for n in (14, 22, 9, 17, 30)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    solo = [tiny_llm.generate([p], params)[0].token_ids for p in prompts]
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=64, block_size=4, max_num_batched_tokens=32)
    sched = llm.engine.scheduler
    preempted: list[str] = []
    orig = sched._preempt

    def spy(r, batch):
        assert r is sched.running[-1]  # the most recently admitted goes first
        preempted.append(r.request_id)
        orig(r, batch)

    sched._preempt = spy
    outs = llm.generate(prompts, params)
    assert preempted
    assert [o.token_ids for o in outs] == solo
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)


def test_refused_requests_do_not_disturb_the_others(tiny_model_dir, tiny_llm):
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=64, block_size=4, max_model_len=48,
              decode_steps_per_call=1)  # steps one token at a time
    eng = llm.engine
    ok = eng.add_request(prompt(10), GREEDY)
    eng.step()
    eng.step()
    with pytest.raises(RequestTooLargeError, match=r"never fit the KV cache \(64 tokens\)"):
        eng.add_request(prompt(40), SamplingParams(max_tokens=30))
    with pytest.raises(RequestTooLargeError, match="context is 48"):
        eng.add_request(prompt(48), SamplingParams(max_tokens=1))
    with pytest.raises(LoraServeError, match="empty"):
        eng.add_request("", GREEDY)
    with pytest.raises(LoraServeError, match="empty"):
        eng.add_request([], GREEDY)
    for bad in ([4, 512], [-1, 7]):  # vocab is 512
        with pytest.raises(LoraServeError, match="out of range"):
            eng.add_request(bad, GREEDY)
    assert list(eng.requests) == [ok.request_id] and len(eng.scheduler.running) == 1
    while eng.has_work:
        eng.step()
    assert ok.output_token_ids == tiny_llm.generate([prompt(10)], GREEDY)[0].token_ids
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
    # prompt + max_tokens exactly at capacity is fine.
    out = llm.generate([prompt(40)], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_generate_with_one_bad_prompt_queues_nothing(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_tokens=64, block_size=4)
    for bad in (prompt(70), [3, 9999], ""):
        with pytest.raises(LoraServeError):
            llm.generate([prompt(5), bad, prompt(6)], GREEDY)
        assert not llm.engine.has_work and not llm.engine.requests
        assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
    assert len(llm.generate([prompt(5)], GREEDY)[0].token_ids) == 8

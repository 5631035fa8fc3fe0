"""How many decode steps a decode-only batch runs in one call (scheduler/decode_runs.py),
driven without a model:

- none before a decode-only step of the batch's size was measured; then as many as fit in
  RUN_SECONDS by that measure, at most `most`;
- never past a request's max_tokens or the context;
- never while anything waits, and never for a batch with prefill or a newcomer in it;
- K/V reserved for every step of the run, all or nothing: where the pool lacks the blocks,
  a plain step and nothing allocated;
- a run charges its client's fair share what its steps one by one would.
"""

from __future__ import annotations

import pytest

from loraserve import SamplingParams
from loraserve.config import EngineConfig
from loraserve.kvcache.manager import KVCacheManager
from loraserve.request import Request
from loraserve.scheduler.batch import StepOutput
from loraserve.scheduler.decode_runs import RUN_SECONDS, DecodeRuns
from loraserve.scheduler.scheduler import Scheduler

BLOCK = 4


def make(kv_tokens: int = 256, max_model_len: int | None = None,
         context_cost: float = 0.0) -> Scheduler:
    cfg = EngineConfig(kv_cache_tokens=kv_tokens, block_size=BLOCK, enable_prefix_caching=False)
    return Scheduler(cfg, KVCacheManager(kv_tokens // BLOCK, BLOCK, False),
                     max_model_len=max_model_len, context_cost=context_cost)


def add(s: Scheduler, rid: str, prompt: int, max_tokens: int = 50) -> Request:
    r = Request(rid, list(range(4, 4 + prompt)), SamplingParams(max_tokens=max_tokens,
                                                                 temperature=0.0))
    s.add(r)
    return r


def step(s: Scheduler):
    """A plain step with a model that always says token 5; returns its batch."""
    batch = s.schedule()
    done = [r.request_id for r, n in batch.entries if r.num_computed_tokens + n == r.num_tokens]
    s.update_from_output(batch, StepOutput(done, [5] * len(done)))
    return batch


def decoding(s: Scheduler, *reqs: Request):
    """Prefill the requests (one plain step), then schedule their first decode-only batch."""
    step(s)
    batch = s.schedule()
    assert batch.num_decodes == len(batch.entries) == len(reqs)
    return batch


def test_steps_by_the_measured_step_time_and_at_most_most():
    s = make()
    a, b = add(s, "a", 6), add(s, "b", 9)
    batch = decoding(s, a, b)
    runs = DecodeRuns(8)
    assert runs.steps(s, batch) == 1  # nothing measured for two rows yet
    runs.observe(batch, RUN_SECONDS / 3)
    assert runs.steps(s, batch) == 3
    runs.step_s.clear()
    runs.observe(batch, RUN_SECONDS / 100)
    before = {r.request_id: len(r.block_table) for r in (a, b)}
    assert runs.steps(s, batch) == 8
    for r in (a, b):  # blocks for all 8 positions from the one being computed
        assert len(r.block_table) == -(-(r.num_computed_tokens + 8) // BLOCK)
        assert len(r.block_table) > before[r.request_id]
    assert DecodeRuns(1).steps(s, batch) == 1


def test_never_past_max_tokens_or_the_context():
    s = make(max_model_len=14)
    a, b = add(s, "a", 6, max_tokens=4), add(s, "b", 3)
    batch = decoding(s, a, b)
    runs = DecodeRuns(8)
    runs.observe(batch, 1e-5)
    # a has 3 tokens to go (one sampled); b may reach 14 tokens: 3 prompt + 1 + 10 more
    assert runs.steps(s, batch) == 3


def test_a_plain_step_while_anything_waits_or_with_prefill():
    s = make()
    a = add(s, "a", 6)
    batch = decoding(s, a)
    runs = DecodeRuns(8)
    runs.observe(batch, 1e-4)
    add(s, "late", 5)
    assert runs.steps(s, batch) == 1
    mixed = s.schedule()  # a's decode and late's prompt
    assert mixed.num_decodes < len(mixed.entries)
    assert runs.steps(s, mixed) == 1


def test_all_or_nothing_when_the_pool_is_short():
    s = make(kv_tokens=16)  # 4 blocks: a and b hold 2 + 1 after their first decode
    a, b = add(s, "a", 7), add(s, "b", 3)
    batch = decoding(s, a, b)
    runs = DecodeRuns(8)
    runs.observe(batch, 1e-4)
    tables = [list(r.block_table) for r in (a, b)]
    free = s.kv.pool.num_free
    assert runs.steps(s, batch) == 1
    assert [r.block_table for r in (a, b)] == tables and s.kv.pool.num_free == free



def test_a_run_charges_its_client_what_its_steps_would():
    """Fair shares charge a decode by its context: a run's later tokens by their own."""
    runs, plain = make(context_cost=0.01), make(context_cost=0.01)
    a, b = add(runs, "a", 6), add(plain, "a", 6)
    batch = decoding(runs, a)
    k = DecodeRuns(8)
    k.observe(batch, RUN_SECONDS / 4)
    assert k.steps(runs, batch) == 4
    for _ in range(5):  # the prompt, then four decodes one a step
        step(plain)
    assert b.num_output_tokens == 5
    assert runs.vtc.counter(None) == pytest.approx(plain.vtc.counter(None), rel=1e-12)

"""Adapter-aware prefix cache and copy-on-write forks.

K/V computed under one adapter's weights is wrong for any other weights: the cache's namespace
is the weights' content fingerprint, never the name. Outputs with the cache on must equal
outputs with it off; no block or refcount may leak after forks, aborts and unloads.
"""

from __future__ import annotations

import random

import pytest
from adapter_factory import make_peft_adapter
from lora_reference import LIFECYCLE_ADAPTERS, assert_idle, gen, make_adapters, run_until_done
from lora_reference import peft_greedy as ref

from loraserve import LLM, SamplingParams
from loraserve.kvcache.block_pool import BlockPool
from loraserve.kvcache.prefix_hash import BASE_NAMESPACE, adapter_namespace, block_hash
from loraserve.types import FinishReason

SYSTEM = [(7 * i) % 480 + 20 for i in range(40)]  # a shared "system prompt": 10 blocks of 4


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("prefix"),
                         {k: LIFECYCLE_ADAPTERS[k] for k in ("a", "b", "c")})


def engine_llm(model_dir, ads, **kw) -> LLM:
    kw.setdefault("block_size", 4)
    return LLM(str(model_dir), lora_paths={k: str(v) for k, v in ads.items()}, **kw)


# --- the pool and the hashes ----------------------------------------------------------------


def test_pool_refcounts_lru_eviction_and_index():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache(a[0], b"h0")
    pool.cache(a[1], b"h1")
    pool.share([a[0]])  # a second holder (a prefix hit)
    pool.free(a[::-1])
    assert pool.ref[a[0]] == 1 and pool.num_free == 3
    pool.free([a[0]])
    assert pool.num_free == 4 and pool.lookup(b"h0") == a[0]  # free but still reusable
    pool.share([a[0]])  # taken back from the free queue
    assert pool.num_free == 3
    pool.free([a[0]])
    got = pool.allocate(3)  # the never-cached blocks go first, then the LRU cached one
    assert a[1] in got and a[0] not in got and pool.lookup(b"h1") is None
    assert pool.lookup(b"h0") == a[0] and pool.num_evictions == 1
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[1], a[1], a[1]])


def test_hashes_chain_and_separate_namespaces():
    toks = [1, 2, 3, 4]
    ns_a, ns_b = adapter_namespace("aa" * 32), adapter_namespace("bb" * 32)
    assert block_hash(b"", ns_a, toks) != block_hash(b"", ns_b, toks)
    assert block_hash(b"", ns_a, toks) != block_hash(b"", BASE_NAMESPACE, toks)
    assert block_hash(b"", ns_a, toks) == block_hash(b"", ns_a, list(toks))
    assert block_hash(b"x", ns_a, toks) != block_hash(b"y", ns_a, toks)  # the whole prefix


# --- through the engine ----------------------------------------------------------------------


def test_same_prompt_shares_under_one_adapter_never_across_two(tiny_model_dir, ads):
    llm = engine_llm(tiny_model_dir, ads)
    prompt = SYSTEM + [5, 6, 7]
    first = llm.generate([prompt], greedy(), lora="a")[0]
    assert first.num_cached_tokens == 0
    other = llm.generate([prompt], greedy(), lora="b")[0]
    assert other.num_cached_tokens == 0  # same tokens, other weights: no hit
    base = llm.generate([prompt], greedy())[0]
    assert base.num_cached_tokens == 0
    again = llm.generate([prompt], greedy(), lora="a")[0]
    assert again.num_cached_tokens == 40 and again.token_ids == first.token_ids
    assert again.token_ids == ref(tiny_model_dir, ads["a"], prompt, 6)
    # Running side by side: no block is in two adapters' tables.
    eng = llm.engine
    reqs = [eng.add_request(prompt, greedy(), lora) for lora in ("a", "b", "c", None)]
    eng.step()
    tables = [set(r.block_table) for r in reqs]
    assert all(not (tables[i] & tables[j]) for i in range(4) for j in range(i + 1, 4))
    run_until_done(eng)
    assert_idle(eng)


def test_reloaded_adapter_with_new_weights_never_hits_old_blocks(tiny_model_dir, ads, tmp_path):
    llm = engine_llm(tiny_model_dir, {"a": ads["a"]})
    prompt = SYSTEM + [9, 9]
    old = gen(llm, [prompt], ["a"])[0]
    llm.unload_lora_adapter("a")
    new_dir = make_peft_adapter(tiny_model_dir, tmp_path / "a2", **{**LIFECYCLE_ADAPTERS["a"],
                                                                     "seed": 99})
    llm.load_lora_adapter("a", new_dir)
    out = llm.generate([prompt], greedy(), lora="a")[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == ref(tiny_model_dir, new_dir, prompt, 6) != old
    llm.unload_lora_adapter("a")
    llm.load_lora_adapter("a", ads["a"])  # the first files again: identical weights may hit
    back = llm.generate([prompt], greedy(), lora="a")[0]
    assert back.num_cached_tokens == 40 and back.token_ids == old
    assert_idle(llm.engine)


WORKLOADS = {  # EngineConfig knobs: plain, chunked prefill, and preemption under a small pool
    "plain": {},
    "chunked": {"max_num_batched_tokens": 12},
    "preempt": {"kv_cache_tokens": 128, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_outputs_with_the_cache_equal_outputs_without(tiny_model_dir, ads, name, monkeypatch):
    from loraserve.scheduler.scheduler import Scheduler

    preempted = []
    real = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt",
                        lambda self, req, batch: (preempted.append(req), real(self, req, batch)))
    rng = random.Random(5)
    prompts, loras = [], []
    for i in range(16):
        tail = [rng.randrange(4, 500) for _ in range(rng.randint(1, 9))]
        prompts.append(SYSTEM[: rng.choice([8, 20, 40])] + tail)
        loras.append([None, "a", "b", "a"][i % 4])
    outs = {}
    for cache in (True, False):
        llm = engine_llm(tiny_model_dir, ads, enable_prefix_caching=cache, **WORKLOADS[name])
        res = llm.generate(prompts, greedy(8), lora=loras)
        # a second wave hits what the first left (exact repeats: up to the last full block)
        res += llm.generate(prompts[::-1], greedy(8), lora=loras[::-1])
        assert all(o.error is None for o in res)
        outs[cache] = res
        assert_idle(llm.engine)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert sum(o.num_cached_tokens for o in outs[True]) > 0
    assert all(o.num_cached_tokens == 0 for o in outs[False])
    assert bool(preempted) == (name == "preempt")


def test_forks_share_the_prompt_copy_the_partial_block_and_inherit_the_adapter(
        tiny_model_dir, ads, monkeypatch):
    # no decode pace: its first step beside one decode would be that decode alone (its
    # reference), and this test counts steps
    llm = engine_llm(tiny_model_dir, ads, decode_pace_factor=0)
    eng = llm.engine
    copies = []
    real_copy = eng.runner.copy_blocks
    monkeypatch.setattr(eng.runner, "copy_blocks", lambda c: (copies.extend(c), real_copy(c)))
    prompt = SYSTEM[:22]  # 21 shared tokens: 5 full blocks and a partial one of 1
    parent = eng.add_request(prompt, greedy(), "a", request_id="p")
    forks = [eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.8, seed=s,
                                                    ignore_eos=True), "a", f"f{s}", fork_of="p")
             for s in range(3)]
    uid = parent.adapter_uid
    assert all(f.adapter_uid == uid and f.fork_parent is parent for f in forks)
    assert eng.store.entries[uid].refcount == 4  # each fork holds the adapter itself
    eng.step()  # the parent computes the prompt; the forks wait for it
    assert all(not f.block_table for f in forks)
    eng.step()  # the forks take its 5 full blocks and copy the partial one
    shared = parent.block_table[:5]
    assert all(f.block_table[:5] == shared and f.block_table[5] != parent.block_table[5]
               for f in forks)
    assert all(eng.kv.pool.ref[b] == 4 for b in shared)
    assert sorted(copies) == sorted((parent.block_table[5], f.block_table[5]) for f in forks)
    outs = run_until_done(eng)
    assert all(outs[f.request_id].num_cached_tokens == 21 for f in forks)
    assert outs["p"].token_ids == ref(tiny_model_dir, ads["a"], prompt, 6)
    # a fork samples as the same request alone (no fork, no cache) would
    alone = engine_llm(tiny_model_dir, ads, enable_prefix_caching=False)
    for f in forks:
        assert outs[f.request_id].token_ids == alone.generate([prompt], f.params, "a")[0].token_ids
    assert_idle(eng)


def test_aborting_the_parent_aborts_its_forks_and_unload_waits_for_all(tiny_model_dir, ads):
    llm = engine_llm(tiny_model_dir, ads)
    eng = llm.engine
    prompt = SYSTEM[:30]
    eng.add_request(prompt, greedy(20), "b", request_id="p")
    for j in range(3):
        eng.add_request(prompt, greedy(20), "b", request_id=f"f{j}", fork_of="p")
    eng.step()
    eng.step()
    llm.unload_lora_adapter("b")  # drains: the four still hold it
    assert eng.store.entries[eng.requests["f0"].adapter_uid].refcount == 4
    eng.abort("p")
    assert not eng.requests  # the forks went with it
    assert "b" not in eng.store.names and not any(e.name == "b" for e in eng.store.entries.values())
    assert_idle(eng)


def test_a_fork_whose_parent_ended_early_still_gets_its_answer(tiny_model_dir, ads):
    for cache in (True, False):
        llm = engine_llm(tiny_model_dir, ads, enable_prefix_caching=cache)
        eng = llm.engine
        prompt = SYSTEM[:26]
        eng.add_request(prompt, greedy(1), None, request_id="p")  # done after its prefill
        eng.add_request(prompt, greedy(5), None, request_id="f", fork_of="p")
        outs = run_until_done(eng)
        assert outs["f"].finish_reason is FinishReason.LENGTH
        assert outs["f"].token_ids == ref(tiny_model_dir, None, prompt, 5)
        assert outs["f"].num_cached_tokens == (24 if cache else 0)
        assert_idle(eng)


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_model_dir, ads):
    llm = engine_llm(tiny_model_dir, ads)
    eng = llm.engine
    tails = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    firsts = [eng.add_request(SYSTEM + t, greedy(), "a") for t in tails]
    other = eng.add_request(SYSTEM + tails[0], greedy(), "b")  # other weights: no waiting
    base = eng.add_request(SYSTEM + tails[0], greedy())
    eng.step()
    assert firsts[0].block_table and other.block_table and base.block_table
    assert not firsts[1].block_table and not firsts[2].block_table  # waiting for the prefix
    outs = run_until_done(eng)
    cached = [outs[r.request_id].num_cached_tokens for r in (*firsts, other, base)]
    assert cached == [0, 40, 40, 0, 0]
    for t, r in zip(tails, firsts, strict=True):
        assert outs[r.request_id].token_ids == ref(tiny_model_dir, ads["a"], SYSTEM + t, 6)
    assert_idle(eng)


def test_a_request_waiting_on_a_prefix_is_not_stranded_by_its_producer(tiny_model_dir, ads):
    # Chunked prefill (12 tokens a step): the producer computes the shared prompt over several
    # steps, the waiter takes each block as it is cached; then the producer is aborted midway.
    llm = engine_llm(tiny_model_dir, ads, max_num_batched_tokens=12)
    eng = llm.engine
    prod = eng.add_request(SYSTEM + [5], greedy(), "a", request_id="producer")
    wait = eng.add_request(SYSTEM + [6], greedy(), "a", request_id="waiter")
    eng.step()
    eng.step()
    assert prod.num_computed_tokens == 24 and not wait.block_table
    eng.abort("producer")
    outs = run_until_done(eng)
    assert outs["waiter"].num_cached_tokens == 24  # what was cached before the abort
    assert outs["waiter"].token_ids == ref(tiny_model_dir, ads["a"], SYSTEM + [6], 6)
    assert_idle(eng)

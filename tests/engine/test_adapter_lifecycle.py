"""Adapter lifecycle rules (docs/design.md §3) for the host tier, unload and refcounts: one test
per rule, on the tiny random Llama (slots and admission: test_adapter_slots.py).

Outputs are checked against transformers + PEFT (float32, one prompt alone) wherever a rule
could let a request run with the wrong weights; residency is read from the AdapterStore.
"""

from __future__ import annotations

import shutil

import pytest
from adapter_factory import edit_tensors, make_peft_adapter, truncate_weights
from lora_reference import (
    P1,
    P2,
    P3,
    P4,
    assert_idle,
    entry,
    gen,
    greedy,
    make_adapters,
    run_until_done,
)
from lora_reference import peft_greedy as ref

from loraserve import LLM
from loraserve.types import (
    AdapterConflictError,
    AdapterNotFoundError,
    FinishReason,
    LoraServeError,
)


@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("lifecycle"))


def tiers(llm: LLM) -> dict[str, str]:
    return {e.name: e.tier for e in llm.engine.store.registered()}


# --- host tier: LRU, pinning, implicit reload ----------------------------------------------


def test_lru_host_eviction_order(tiny_model_dir, ads):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loaded_loras=2)
    llm.load_lora_adapter("a", ads["a"])
    llm.load_lora_adapter("b", ads["b"])
    gen(llm, [P1], ["a"])  # a is now more recent than b
    llm.load_lora_adapter("c", ads["c"])
    assert tiers(llm) == {"a": "device", "b": "disk", "c": "host"}
    assert entry(llm, "b").stats.host_evictions == 1 and "b" in llm.engine.store.names
    # b comes back on demand and evicts the LRU of {a (used), c (loaded after a's use)}
    assert gen(llm, [P2], ["b"]) == [ref(tiny_model_dir, ads["b"], P2, 6)]
    assert tiers(llm) == {"a": "disk", "b": "device", "c": "host"}
    # Adapters of finished requests are not protected: after a batch using b and c, a new
    # load still finds a victim (regression: the last batch's adapters stayed protected).
    gen(llm, [P1, P2], ["b", "c"])
    llm.load_lora_adapter("x", ads["x"])
    assert sorted(tiers(llm).values()).count("disk") == 2
    assert_idle(llm.engine)


def test_pinned_never_evicted(tiny_model_dir, ads):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loras_per_batch=2, max_loaded_loras=2)
    llm.load_lora_adapter("p", ads["a"], pinned=True)
    assert gen(llm, [P1], ["p"]) == [ref(tiny_model_dir, ads["a"], P1, 6)]
    slot = entry(llm, "p").slot
    for name in "bcx":  # each load and each use evicts someone, never p
        llm.load_lora_adapter(name, ads[name])
        assert tiers(llm)["p"] == "device"
    prompts, loras = [P1, P2, P3, P4, P2, P1], ["b", "c", "x", "p", None, "b"]
    outs = gen(llm, prompts, loras)  # 2 slots, 2 host entries: everything else churns
    for p, name, out in zip(prompts, loras, outs, strict=True):
        assert out == ref(tiny_model_dir, name and ads["a" if name == "p" else name], p, 6)
    p = entry(llm, "p")
    assert p.tier == "device" and p.slot == slot
    assert p.stats.host_evictions == 0 and p.stats.slot_evictions == 0
    assert sum(entry(llm, n).stats.host_evictions for n in "bcx") > 0
    assert_idle(llm.engine)


def test_at_most_max_loras_per_batch_minus_one_pinned(tiny_model_dir, ads):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loras_per_batch=3)
    llm.load_lora_adapter("a", ads["a"], pinned=True)
    llm.load_lora_adapter("b", ads["b"], pinned=True)
    with pytest.raises(LoraServeError, match="pinned"):
        llm.load_lora_adapter("c", ads["c"], pinned=True)
    assert "c" not in llm.engine.store.names
    llm.load_lora_adapter("c", ads["c"])
    # Pinning an adapter that is already loaded obeys the same cap (regression: it did not,
    # and with every slot pinned, requests for any other adapter waited forever).
    with pytest.raises(LoraServeError, match="pinned"):
        llm.load_lora_adapter("c", ads["c"], pinned=True)
    llm.load_lora_adapter("a", ads["a"], pinned=True)  # already pinned: a no-op
    assert [e.pinned for e in llm.engine.store.registered()] == [True, True, False]
    # Two pinned adapters hold two of the three slots; the third still serves c (and base).
    outs = gen(llm, [P1, P2, P3, P4], ["a", "b", "c", None])
    assert outs[2] == ref(tiny_model_dir, ads["c"], P3, 6)
    with pytest.raises(LoraServeError, match="pinned"):
        LLM(str(tiny_model_dir), lora_memory="tiered",
            max_loras_per_batch=1).load_lora_adapter("a", ads["a"], True)


def test_implicit_reload_keeps_uid_and_outputs(tiny_model_dir, ads):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered",
              max_loaded_loras=1, lora_paths={"a": ads["a"]})
    first = gen(llm, [P1, P2], ["a", "a"])
    uid = llm.engine.store.names["a"]
    llm.load_lora_adapter("b", ads["b"])
    assert tiers(llm) == {"a": "disk", "b": "host"}
    assert gen(llm, [P1, P2], ["a", "a"]) == first  # reloaded from its path on demand
    a = entry(llm, "a")
    assert a.uid == uid and a.stats.loads == 2 and a.stats.host_evictions == 1
    assert first == [ref(tiny_model_dir, ads["a"], p, 6) for p in (P1, P2)]
    assert tiers(llm) == {"a": "device", "b": "disk"}
    assert_idle(llm.engine)


def test_implicit_reload_refuses_files_changed_on_disk(tiny_model_dir, tmp_path):
    # A uid must always mean the same weights: a reload that finds other bytes at the path
    # errors the request instead of silently serving new weights under the old uid.
    path = make_peft_adapter(tiny_model_dir, tmp_path / "a", r=4, seed=1)
    other = make_peft_adapter(tiny_model_dir, tmp_path / "b", r=4, seed=2)
    llm = LLM(str(tiny_model_dir), lora_memory="tiered",
              max_loaded_loras=1, lora_paths={"a": str(path)})
    llm.load_lora_adapter("b", str(other))  # evicts a from host memory
    shutil.copy(other / "adapter_model.safetensors", path / "adapter_model.safetensors")
    out = llm.generate([P1], greedy(4), lora=["a"])[0]
    assert out.finish_reason is FinishReason.ERROR and "changed on disk" in out.error
    assert gen(llm, [P1], ["b"], 4)  # the server goes on serving
    assert_idle(llm.engine)


def test_implicit_reload_next_to_a_resident_adapter(tiny_model_dir, ads):
    # Regression: admitting b (resident) and then a (on disk) in the same step made room for
    # a by evicting b, which the step then ran without host weights (RuntimeError).
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loaded_loras=2)
    for name in "abc":
        llm.load_lora_adapter(name, ads[name])
    assert tiers(llm) == {"a": "disk", "b": "host", "c": "host"}
    assert gen(llm, [P1, P2], ["b", "a"]) == [ref(tiny_model_dir, ads["b"], P1, 6),
                                             ref(tiny_model_dir, ads["a"], P2, 6)]
    assert tiers(llm) == {"a": "device", "b": "device", "c": "disk"}
    assert_idle(llm.engine)


def test_unload_and_load_new_weights_gets_new_uid(tiny_model_dir, ads, tmp_path):
    path = shutil.copytree(ads["a"], tmp_path / "v")
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", lora_paths={"v": path})
    old = gen(llm, [P1, P2], ["v", "v"])
    uid = llm.engine.store.names["v"]
    llm.load_lora_adapter("v", path)  # same name, same path: a no-op
    assert llm.engine.store.names["v"] == uid
    with pytest.raises(AdapterConflictError):
        llm.load_lora_adapter("v", ads["b"])
    llm.unload_lora_adapter("v")
    assert uid not in llm.engine.store.entries
    shutil.rmtree(path)
    shutil.copytree(ads["b"], path)  # new weights at the same path
    llm.load_lora_adapter("v", path)
    assert llm.engine.store.names["v"] > uid
    new = gen(llm, [P1, P2], ["v", "v"])
    assert new == [ref(tiny_model_dir, ads["b"], p, 6) for p in (P1, P2)] != old
    assert llm.engine.store.slot_owner.count(uid) == 0


# --- unload, unknown names, failed loads ---------------------------------------------------


def test_unload_while_in_flight(tiny_model_dir, ads):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_num_seqs=1, lora_paths={"a": ads["a"]})
    eng, store = llm.engine, llm.engine.store
    r1 = eng.add_request(P1, greedy(8), lora_name="a")
    r2 = eng.add_request(P2, greedy(8), lora_name="a")  # admitted, waits behind max_num_seqs
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    old = entry(llm, "a")
    assert old.slot is not None and old.refcount == 2 and not outs
    llm.unload_lora_adapter("a")
    assert "a" not in store.names and old.uid in store.entries  # draining
    with pytest.raises(AdapterNotFoundError):
        eng.add_request(P3, greedy(8), lora_name="a")
    llm.load_lora_adapter("a", ads["b"])  # the name is free again, with other weights
    r3 = eng.add_request(P3, greedy(8), lora_name="a")
    assert store.names["a"] != old.uid
    outs = run_until_done(eng, outs)
    assert outs[r1.request_id].token_ids == ref(tiny_model_dir, ads["a"], P1, 8)
    assert outs[r2.request_id].token_ids == ref(tiny_model_dir, ads["a"], P2, 8)
    assert outs[r3.request_id].token_ids == ref(tiny_model_dir, ads["b"], P3, 8)
    # drained: slot freed and host weights dropped
    assert old.uid not in store.entries and old.uid not in store.slot_owner
    assert old.weights is None and old.slot is None and old.refcount == 0
    assert_idle(llm.engine)


def test_never_loaded_name_is_not_found(tiny_model_dir, ads):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", lora_paths={"a": ads["a"]})
    with pytest.raises(AdapterNotFoundError):
        llm.generate([P1], greedy(4), lora=["nope"])
    with pytest.raises(AdapterNotFoundError):  # the valid request queued first is rolled back
        llm.generate([P1, P2], greedy(4), lora=["a", "nope"])
    with pytest.raises(AdapterNotFoundError):
        llm.unload_lora_adapter("nope")
    assert_idle(llm.engine)


def snapshot(store) -> tuple:
    entries = {u: (e.name, e.path, e.tier, e.pinned, e.refcount, e.slot, e.last_used,
                   e.stats.loads, e.stats.host_evictions) for u, e in store.entries.items()}
    return dict(store.names), entries, list(store.slot_owner), store.loader.num_pending


def test_failed_load_leaves_no_trace(tiny_model_dir, ads, tmp_path):
    def broken(name, fn):
        path = shutil.copytree(ads["a"], tmp_path / name)
        fn(path)
        return path

    def nan(tensors):
        next(iter(tensors.values()))[0, 0] = float("nan")

    big = make_peft_adapter(tiny_model_dir, tmp_path / "big", r=16, seed=9)
    bad = [("t", broken("t", truncate_weights)), ("n", broken("n", lambda p: edit_tensors(p, nan))),
           ("r", big), ("m", tmp_path / "missing"), ("x:y", ads["c"]), ("a", ads["c"])]
    # host is full (a running, b idle): a successful load would evict b; a failed one must not
    llm = LLM(str(tiny_model_dir), lora_memory="tiered",
              max_lora_rank=8, max_loaded_loras=2, max_loras_per_batch=2,
              lora_paths={"a": ads["a"], "b": ads["b"]})
    eng, store = llm.engine, llm.engine.store
    reqs = [eng.add_request(P1, greedy(10), lora_name="a"), eng.add_request(P2, greedy(10))]
    outs = {}
    for name, path in bad:
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        before = snapshot(store)
        with pytest.raises(LoraServeError):
            llm.load_lora_adapter(name, path)
        assert snapshot(store) == before, name
    llm.load_lora_adapter("p", ads["x"], pinned=True)  # pins: max_loras_per_batch - 1 = 1
    before = snapshot(store)
    with pytest.raises(LoraServeError, match="pinned"):
        llm.load_lora_adapter("q", ads["b"], pinned=True)
    assert snapshot(store) == before
    assert not outs and all(r.status.value == "running" for r in reqs)  # still decoding
    outs = run_until_done(eng, outs)
    assert outs[reqs[0].request_id].token_ids == ref(tiny_model_dir, ads["a"], P1, 10)
    assert outs[reqs[1].request_id].token_ids == ref(tiny_model_dir, None, P2, 10)
    assert_idle(llm.engine)


# --- refcounts -----------------------------------------------------------------------------


def test_refcount_released_exactly_once(tiny_model_dir, ads, tmp_path):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_num_seqs=1, max_loaded_loras=1)
    eng = llm.engine
    llm.load_lora_adapter("a", ads["a"])
    a = entry(llm, "a")
    gen(llm, [P1], ["a"])  # finished
    assert a.refcount == 0
    r1 = eng.add_request(P1, greedy(8), lora_name="a")
    r2 = eng.add_request(P2, greedy(8), lora_name="a")
    eng.step()
    eng.step()
    assert (r1.status.value, r2.status.value, a.refcount) == ("running", "waiting", 2)
    assert eng.abort(r2.request_id).finish_reason is FinishReason.ABORT  # waiting
    assert a.refcount == 1
    assert eng.abort(r1.request_id).finish_reason is FinishReason.ABORT  # running
    assert a.refcount == 0
    assert eng.abort(r1.request_id) is None and a.refcount == 0  # twice: a no-op
    r3 = eng.add_request(P3, greedy(2), lora_name="a")
    run_until_done(eng)
    assert eng.abort(r3.request_id) is None and a.refcount == 0  # abort after finish
    # error: the implicit reload of an evicted adapter fails (file broken meanwhile)
    path = shutil.copytree(ads["b"], tmp_path / "e")
    llm.load_lora_adapter("e", path)
    gen(llm, [P1], ["a"])  # evicts e from host memory
    truncate_weights(path)
    out = llm.generate([P2, P4], greedy(4), lora=["e", "e"])
    assert [o.finish_reason for o in out] == [FinishReason.ERROR] * 2
    assert "e" in out[0].error and entry(llm, "e").refcount == 0
    assert_idle(llm.engine)
    shutil.rmtree(path)
    shutil.copytree(ads["b"], path)  # repaired: the next request retries the load
    assert gen(llm, [P2], ["e"]) == [ref(tiny_model_dir, ads["b"], P2, 6)]
    assert_idle(llm.engine)

"""One adapter memory on CPU (`lora_memory="unified"`, the CPU default): an adapter is
packed into the kernel's layout once, when its weights reach host memory, and the unpacked copy
is dropped; every host-resident adapter can join any batch (max_loras_per_batch does not bind);
max_loaded_loras bounds the memory (LRU, pins and adapters in use protected); the waiting queue
drives disk -> packed-host loads. Outputs are checked against transformers + PEFT."""

from __future__ import annotations

import pytest
from adapter_factory import truncate_weights
from lora_reference import P1, P2, P3, P4, assert_idle, entry, gen, make_adapters, run_until_done
from lora_reference import greedy as greedy_params
from lora_reference import peft_greedy as ref

from loraserve import LLM
from loraserve.types import LoraServeError


@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("unified"))


def unified(model_dir, **kw) -> LLM:
    llm = LLM(str(model_dir), **kw)
    assert llm.engine.store.residency.name == "unified" and llm.engine.store.batch_cap is None
    return llm


def tier(llm: LLM, name: str) -> str:
    """The adapter's tier as /v1/models shows it (the slots are host memory here)."""
    return next(s.tier for s in llm.engine.store.snapshot() if s.name == name)


def test_packed_once_unpacked_copy_dropped_and_snapshots_say_host(tiny_model_dir, ads):
    llm = unified(tiny_model_dir, lora_paths={n: ads[n] for n in "abc"})
    for n in "abc":
        e = entry(llm, n)
        assert e.slot is not None and e.weights.layers == ()  # the slot is the one copy
    assert {s.name: s.tier for s in llm.engine.store.snapshot()} == dict.fromkeys("abc", "host")
    assert gen(llm, [P1, P2, P3], list("abc")) == [ref(tiny_model_dir, ads[n], p, 6)
                                                   for n, p in zip("abc", (P1, P2, P3),
                                                                   strict=True)]


def test_every_resident_adapter_joins_one_batch_whatever_max_loras_per_batch(tiny_model_dir,
                                                                              ads):
    llm = unified(tiny_model_dir, max_loras_per_batch=2, lora_paths=ads)
    eng = llm.engine
    names = list(ads)
    reqs = [eng.add_request(P1, greedy_params(4), n) for n in names]
    reqs.append(eng.add_request(P2, greedy_params(4)))
    eng.step()
    assert all(r.block_table for r in reqs), "someone waited for a slot"
    outs = run_until_done(eng)
    for n, r in zip(names, reqs, strict=False):
        assert outs[r.request_id].token_ids == ref(tiny_model_dir, ads[n], P1, 4)
    assert sum(e.stats.slot_evictions for e in eng.store.entries.values()) == 0
    assert_idle(eng)


def test_max_loaded_loras_bounds_the_memory_lru_and_reload_keep_uid_and_outputs(
        tiny_model_dir, ads):
    llm = unified(tiny_model_dir, max_loaded_loras=2)
    for n in "abc":
        llm.load_lora_adapter(n, ads[n])
    store = llm.engine.store
    assert tier(llm, "a") == "disk" and store.slots.num_slots == 2  # LRU went; no growth
    uid = entry(llm, "a").uid
    assert gen(llm, [P4], ["a"]) == [ref(tiny_model_dir, ads["a"], P4, 6)]  # implicit reload
    assert entry(llm, "a").uid == uid and entry(llm, "a").stats.loads == 2
    assert tier(llm, "b") == "disk"  # b was the least recently used
    assert store.slots.num_slots == 2
    assert gen(llm, [P1, P2], ["b", "c"]) == [ref(tiny_model_dir, ads["b"], P1, 6),
                                             ref(tiny_model_dir, ads["c"], P2, 6)]


def test_pins_are_kept_and_bounded_by_max_loaded_loras(tiny_model_dir, ads):
    llm = unified(tiny_model_dir, max_loaded_loras=2)
    llm.load_lora_adapter("a", ads["a"], pinned=True)
    with pytest.raises(LoraServeError, match="max_loaded_loras - 1 = 1"):
        llm.load_lora_adapter("b", ads["b"], pinned=True)
    for n in "bc":
        llm.load_lora_adapter(n, ads[n])
    assert entry(llm, "a").slot is not None and tier(llm, "b") == "disk"
    assert gen(llm, [P1, P3], ["b", "a"]) == [ref(tiny_model_dir, ads["b"], P1, 6),
                                             ref(tiny_model_dir, ads["a"], P3, 6)]
    assert entry(llm, "a").stats.host_evictions == 0


def test_the_waiting_queue_drives_loads_and_evicts_only_what_nobody_needs(tiny_model_dir, ads):
    llm = unified(tiny_model_dir, max_loaded_loras=2, max_num_seqs=1)
    for n in "abc":
        llm.load_lora_adapter(n, ads[n])  # resident now: b, c (a went to disk)
    eng = llm.engine
    first = eng.add_request(P1, greedy_params(8), "b")
    eng.step()  # b runs alone (one seat)
    waiting = eng.add_request(P2, greedy_params(4), "a")  # on disk, queued behind b
    eng.step()  # starts reading a on a worker thread
    assert eng.store.loads_started == 1
    eng.store.wait_for_loads(timeout=30)
    eng.step()  # collects and packs it
    assert not waiting.block_table
    assert tier(llm, "a") == "host", "the queue did not bring a in while b ran"
    assert tier(llm, "c") == "disk" and tier(llm, "b") == "host"  # c, not b
    outs = run_until_done(eng)
    assert outs[first.request_id].token_ids == ref(tiny_model_dir, ads["b"], P1, 8)
    assert outs[waiting.request_id].token_ids == ref(tiny_model_dir, ads["a"], P2, 4)
    assert_idle(eng)


def test_a_failed_reload_changes_no_slot(tiny_model_dir, ads, tmp_path):
    import shutil

    bad = tmp_path / "a"
    shutil.copytree(ads["a"], bad)
    llm = unified(tiny_model_dir, max_loaded_loras=1)
    llm.load_lora_adapter("a", str(bad))
    llm.load_lora_adapter("b", ads["b"])  # a goes to disk
    truncate_weights(bad)
    before = [t.clone() for t in llm.engine.slot_pool.A[0].values()]
    out = llm.generate([P1], greedy_params(4), lora="a")[0]
    assert out.error is not None and "failed to load" in out.error
    assert all((t == u).all() for t, u in zip(before, llm.engine.slot_pool.A[0].values(),
                                               strict=True))
    assert gen(llm, [P2], ["b"]) == [ref(tiny_model_dir, ads["b"], P2, 6)]


def test_without_queue_prefetch_only_the_next_adapter_is_read(tiny_model_dir, ads):
    for prefetch, started in ((True, 2), (False, 1)):
        llm = unified(tiny_model_dir, max_loaded_loras=3, max_num_seqs=1,
                      unified_prefetch=prefetch)
        for n in "xyabc":  # x and y go back to disk as a, b, c come in
            llm.load_lora_adapter(n, ads[n])
        eng = llm.engine
        eng.store.loads_started = 0
        running = eng.add_request(P1, greedy_params(6), "c")
        eng.step()
        queued = [eng.add_request(P2, greedy_params(2), n) for n in "xy"]
        eng.step()
        assert eng.store.loads_started == started
        outs = run_until_done(eng)
        assert outs[running.request_id].token_ids == ref(tiny_model_dir, ads["c"], P1, 6)
        for n, r in zip("xy", queued, strict=True):
            assert outs[r.request_id].token_ids == ref(tiny_model_dir, ads[n], P2, 2)

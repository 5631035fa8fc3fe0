"""Prefetch from the waiting queue: loads overlap decoding and never stall it;
a failing background load errors the waiting request cleanly."""

from __future__ import annotations

import pytest
from adapter_factory import truncate_weights
from lora_reference import assert_idle, greedy, make_adapters, run_until_done
from lora_reference import peft_greedy as ref

from loraserve import LLM
from loraserve.types import FinishReason

P1, P2 = [5, 77, 301, 12, 9], [400, 23, 8, 150, 66]



@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("prefetch"))


def _evict_to_disk(llm: LLM, name: str, other: str, path) -> int:
    """Load `other` into a 1-adapter host tier so that `name` goes back to disk."""
    llm.load_lora_adapter(other, path)
    store = llm.engine.store
    uid = store.names[name]
    assert store.entries[uid].tier == "disk"
    return uid


def test_slow_background_load_does_not_stall_decode(tiny_model_dir, ads):
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loras_per_batch=2, max_loaded_loras=1,
              max_loras_prefetch=1, lora_paths={"a": ads["a"]})
    eng = llm.engine
    uid_a = _evict_to_disk(llm, "a", "b", ads["b"])
    eng.store.loader.delay_s = 3.0  # slow storage
    base = eng.add_request(P1, greedy(12))
    eng.step()  # base is running
    waiting = eng.add_request(P2, greedy(4), lora_name="a")
    outs = {}
    while base.request_id not in outs:
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    # The base request produced all its tokens while a's load was still in flight:
    # no step waited for the disk read.
    assert eng.store.loader.is_loading(uid_a)
    assert outs[base.request_id].token_ids == ref(tiny_model_dir, None, P1, 12)
    eng.store.loader.delay_s = 0.0
    outs = run_until_done(eng, outs)
    assert outs[waiting.request_id].token_ids == ref(tiny_model_dir, ads["a"], P2, 4)
    assert_idle(eng)


def test_prefetch_fills_a_spare_slot_before_admission(tiny_model_dir, ads):
    # One adapter per batch besides base: b's requests wait behind a's; the prefetcher
    # brings b into host memory and a spare slot while a decodes.
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loras_per_batch=1, max_loaded_loras=2,
              max_loras_prefetch=1, lora_paths={"b": ads["b"], "a": ads["a"]})
    eng = llm.engine
    store = eng.store
    llm.load_lora_adapter("c", ads["c"])  # host holds 2: b (LRU) goes back to disk
    assert store.entries[store.names["b"]].tier == "disk"
    ra = eng.add_request(P1, greedy(10), lora_name="a")
    rb = eng.add_request(P2, greedy(4), lora_name="b")
    eng.step()
    seen_device_while_waiting = False
    outs = {}
    while eng.has_work:
        if rb.status.value == "waiting" and store.entries[rb.adapter_uid].tier == "device":
            seen_device_while_waiting = True
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        store.loader.wait_any(timeout=0.05)
    assert seen_device_while_waiting
    assert eng.store.loads_started >= 1 and eng.store.slots_prefetched >= 1
    assert outs[ra.request_id].token_ids == ref(tiny_model_dir, ads["a"], P1, 10)
    assert outs[rb.request_id].token_ids == ref(tiny_model_dir, ads["b"], P2, 4)
    assert_idle(eng)


def test_failing_background_load_errors_the_waiting_request(tiny_model_dir, ads, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ads["a"], bad)
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loaded_loras=1, max_loras_prefetch=2,
              lora_paths={"bad": str(bad)})
    _evict_to_disk(llm, "bad", "b", ads["b"])
    truncate_weights(bad)  # the file breaks while the adapter is on the disk tier
    outs = llm.generate([P1, P2, P1], greedy(4), lora=["bad", "b", None])
    assert outs[0].finish_reason is FinishReason.ERROR
    assert "bad" in outs[0].error and "failed to load" in outs[0].error
    assert outs[1].token_ids == ref(tiny_model_dir, ads["b"], P2, 4)
    assert outs[2].token_ids == ref(tiny_model_dir, None, P1, 4)
    assert_idle(llm.engine)

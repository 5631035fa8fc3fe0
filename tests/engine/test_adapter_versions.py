"""Adapter versions: every load of a name is `name@N`, requests finish on the version they
were admitted on, a replace is atomic (a failed one keeps the old version serving), old
versions retire without waiting on anyone, and adapters loaded from tensors can be evicted and
reloaded from the engine's own copy. Tokens are compared with transformers + PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest
from adapter_factory import build_peft_model
from lora_reference import P1, P2, greedy, hf_greedy, run_until_done
from peft import get_peft_model_state_dict

from loraserve import LLM
from loraserve.adapters.spill import spill_dir
from loraserve.config import ATTN_MODULES, LORA_MODULES
from loraserve.types import AdapterConflictError, AdapterFormatError, AdapterNotFoundError

N = 6
SPECS = [dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, seed=31, init_scale=1.0),
         dict(r=16, lora_alpha=16, target_modules=LORA_MODULES, seed=32, init_scale=1.0),
         dict(r=4, lora_alpha=8, target_modules=LORA_MODULES, seed=33, init_scale=1.0)]


@pytest.fixture(scope="module")
def versions(tiny_model_dir, tmp_path_factory):
    """Three trained states of one adapter: (PeftModel, its directory, its tensors, config)."""
    root = tmp_path_factory.mktemp("versions")
    out = []
    for i, spec in enumerate(SPECS):
        m = build_peft_model(tiny_model_dir, **spec).eval()
        m.save_pretrained(root / f"v{i + 1}", safe_serialization=True)
        out.append((m, root / f"v{i + 1}", get_peft_model_state_dict(m), m.peft_config["default"]))
    return out


def ref(versions, i: int, prompt: list[int]) -> list[int]:
    return hf_greedy(versions[i][0], prompt, N)


def test_a_replace_is_a_new_version_and_running_requests_finish_on_theirs(tiny_model_dir,
                                                                         versions):
    llm = LLM(tiny_model_dir, max_num_batched_tokens=4)  # a prefill spans several steps
    eng = llm.engine
    assert llm.load_lora_adapter("policy", versions[0][1]) == 1
    early = [eng.add_request(p, greedy(N), lora_name="policy") for p in (P1, P2)]
    eng.step()  # admitted on version 1, mid-prefill
    assert llm.load_lora_adapter("policy", tensors=versions[1][2], config=versions[1][3],
                                 replace=True) == 2
    late = eng.add_request(P1, greedy(N), lora_name="policy")
    pinned_old = eng.add_request(P2, greedy(N), lora_name="policy@1")
    outs = run_until_done(eng)
    assert [outs[r.request_id].token_ids for r in early] == [ref(versions, 0, P1),
                                                            ref(versions, 0, P2)]
    assert outs[late.request_id].token_ids == ref(versions, 1, P1)
    assert outs[pinned_old.request_id].token_ids == ref(versions, 0, P2)
    assert outs[late.request_id].adapter_version == 2
    assert outs[early[0].request_id].adapter_version == 1
    assert llm.generate(P2, greedy(N), lora="policy@2")[0].token_ids == ref(versions, 1, P2)


def test_old_versions_retire_beyond_the_limit_but_never_under_a_request(tiny_model_dir,
                                                                        versions):
    llm = LLM(tiny_model_dir, max_adapter_versions=2)
    eng = llm.engine
    llm.load_lora_adapter("policy", versions[0][1])
    held = eng.add_request(P1, greedy(N), lora_name="policy")  # queued on version 1
    llm.load_lora_adapter("policy", versions[1][1], replace=True)
    llm.load_lora_adapter("policy", versions[2][1], replace=True)
    # three live: version 1 is held by a queued request, so it stays until that ends; the
    # load returned at once (nothing waited on the queued request)
    assert sorted(eng.store.live_versions("policy")) == [1, 2, 3]
    outs = run_until_done(eng)
    assert outs[held.request_id].token_ids == ref(versions, 0, P1)
    assert sorted(eng.store.live_versions("policy")) == [2, 3]
    with pytest.raises(AdapterNotFoundError):
        llm.generate(P1, greedy(N), lora="policy@1")
    assert llm.generate(P1, greedy(N), lora="policy")[0].token_ids == ref(versions, 2, P1)
    eng.check_invariants().raise_if_failed()


def test_a_failed_replace_keeps_the_old_version_serving(tiny_model_dir, versions, tmp_path):
    llm = LLM(tiny_model_dir)
    llm.load_lora_adapter("policy", versions[0][1])
    bad = dict(versions[1][2])
    key = next(iter(bad))
    bad[key] = bad[key][:, :3]  # a shape the model cannot take
    copies = set(spill_dir().base.glob("*/policy-*"))
    with pytest.raises(AdapterFormatError):
        llm.load_lora_adapter("policy", tensors=bad, config=versions[1][3], replace=True)
    with pytest.raises(AdapterConflictError, match="replace"):  # a new path needs replace
        llm.load_lora_adapter("policy", versions[1][1])
    assert sorted(llm.engine.store.live_versions("policy")) == [1]
    assert llm.generate(P1, greedy(N), lora="policy")[0].token_ids == ref(versions, 0, P1)
    assert llm.load_lora_adapter("policy", versions[1][1], replace=True) == 2  # numbers go on
    assert set(spill_dir().base.glob("*/policy-*")) == copies  # the failed copy was removed


def test_replacing_a_pinned_adapter_moves_the_pin(tiny_model_dir, versions):
    # max_loaded_loras=2: one adapter may be pinned; a replace of it must not be refused
    llm = LLM(tiny_model_dir, max_loaded_loras=2)
    store = llm.engine.store
    llm.load_lora_adapter("policy", versions[0][1], pinned=True)
    assert llm.load_lora_adapter("policy", versions[1][1], replace=True) == 2
    live = store.live_versions("policy")
    assert store.entries[live[2]].pinned and not store.entries[live[1]].pinned
    assert store.num_pinned == 1
    assert llm.generate(P1, greedy(N), lora="policy")[0].token_ids == ref(versions, 1, P1)


def test_an_adapter_from_tensors_is_evicted_and_reloaded_from_its_copy(tiny_model_dir,
                                                                      versions):
    llm = LLM(tiny_model_dir, max_loaded_loras=1)
    store = llm.engine.store
    llm.load_lora_adapter("mem", tensors=versions[1][2], config=versions[1][3])
    copy = Path(store.entries[store.names["mem"]].path)
    assert copy.is_dir() and spill_dir().owns(copy)
    llm.load_lora_adapter("disk", versions[2][1])  # evicts "mem" from host memory
    assert store.entries[store.names["mem"]].tier == "disk"
    outs = llm.generate([P1, P2], greedy(N), lora=["mem", "disk"])
    assert [o.token_ids for o in outs] == [ref(versions, 1, P1), ref(versions, 2, P2)]
    llm.unload_lora_adapter("mem")
    assert not copy.exists()  # the copy goes with its last version


def test_unloading_one_version(tiny_model_dir, versions):
    llm = LLM(tiny_model_dir, max_adapter_versions=3)
    llm.load_lora_adapter("policy", versions[0][1])
    llm.load_lora_adapter("policy", versions[1][1], replace=True)
    llm.unload_lora_adapter("policy@2")  # the newest goes: `policy` means version 1 again
    assert llm.generate(P1, greedy(N), lora="policy")[0].token_ids == ref(versions, 0, P1)
    with pytest.raises(AdapterNotFoundError):
        llm.unload_lora_adapter("policy@2")
    assert llm.load_lora_adapter("policy", versions[2][1], replace=True) == 3


def test_replacing_never_waits_on_a_paused_request(tiny_model_dir, versions):
    # a request whose client stopped reading is paused out of the batch, holding version 1:
    # replaces go through at once, version 1 stays until the request ends, on its weights
    llm = LLM(tiny_model_dir, max_adapter_versions=1)
    eng = llm.engine
    llm.load_lora_adapter("policy", versions[0][1])
    held = eng.add_request(P1, greedy(N), lora_name="policy")
    eng.step()
    assert eng.pause(held.request_id)
    for i in (1, 2):
        llm.load_lora_adapter("policy", versions[i][1], replace=True)
    assert sorted(eng.store.live_versions("policy")) == [1, 3]
    for _ in range(3):
        eng.step()  # others may run; the paused one does not
    assert held.num_output_tokens <= 1
    assert eng.resume(held.request_id)
    outs = run_until_done(eng)
    assert outs[held.request_id].token_ids == ref(versions, 0, P1)
    assert sorted(eng.store.live_versions("policy")) == [3]

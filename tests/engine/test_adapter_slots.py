"""Adapter lifecycle rules (docs/design.md §3) for compute slots and admission, on the tiny
random Llama: a reassigned slot is fully overwritten, slots change hands during decode without
any request seeing another tenant's weights, the distinct-adapters cap (base counts as one) is
enforced at admission, and a waiting adapter is admitted within a bounded number of steps.
Outputs are checked against transformers + PEFT (float32, one prompt alone).
"""

from __future__ import annotations

import pytest
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


@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("slots"))


# --- compute slots -------------------------------------------------------------------------


def test_reassigned_slot_is_fully_overwritten(tiny_model_dir, ads):
    # x targets all seven modules at rank 4; y only q_proj at rank 16, so y's packed qkv rank
    # rows [0, 16) of A, and its [16, q_out] block of B, cover where x's q/k/v weights were:
    # any leftover of x would leak into y's output.
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loras_per_batch=1,
              lora_paths={"x": ads["x"], "y": ads["y"]})
    assert gen(llm, [P1], ["x"]) == [ref(tiny_model_dir, ads["x"], P1, 6)]
    slot = entry(llm, "x").slot
    assert gen(llm, [P1, P2], ["y", "y"]) == [ref(tiny_model_dir, ads["y"], p, 6)
                                            for p in (P1, P2)]
    assert entry(llm, "y").slot == slot and entry(llm, "x").tier == "host"
    pool, mc = llm.engine.slot_pool, llm.engine.model_config
    q_out = mc.module_shape("q_proj")[0]
    for layer in range(mc.num_hidden_layers):
        for g in ("o", "gate_up", "down"):
            assert not pool.A[layer][g][slot].any() and not pool.B[layer][g][slot].any()
        assert not pool.A[layer]["qkv"][slot, 16 * mc.hidden_size :].any()  # past y's A.T tile
        assert not pool.B[layer]["qkv"][slot, 16 * q_out :].any()  # past y's q block
    assert gen(llm, [P1], ["x"]) == [ref(tiny_model_dir, ads["x"], P1, 6)]  # and back again


def test_slot_eviction_during_decode(tiny_model_dir, ads):
    # 3 adapters, 2 slots: slots change hands while other requests keep decoding.
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loras_per_batch=2,
              lora_paths={n: ads[n] for n in "abc"})
    jobs = [(P1, "a", 3), (P2, "b", 12), (P3, "c", 7), (P4, "a", 9), (P2, "c", 4), (P1, "b", 5)]
    outs = llm.generate([p for p, _, _ in jobs], [greedy(n) for _, _, n in jobs],
                        lora=[name for _, name, _ in jobs])
    for (p, name, n), out in zip(jobs, outs, strict=True):
        assert out.token_ids == ref(tiny_model_dir, ads[name], p, n), (name, p)
    assert sum(entry(llm, n).stats.slot_evictions for n in "abc") > 0
    assert_idle(llm.engine)


def test_runtime_load_during_decode(tiny_model_dir, ads):
    # A load between steps evicts an idle adapter (host + slot) while a decodes; then the
    # freed slot serves the new adapter next to a, and b comes back when there is room.
    llm = LLM(str(tiny_model_dir), lora_memory="tiered", max_loras_per_batch=2, max_loaded_loras=2,
              lora_paths={"a": ads["a"], "b": ads["b"]})
    gen(llm, [P2], ["b"])
    eng = llm.engine
    ra = eng.add_request(P1, greedy(16), lora_name="a")
    outs = {o.request_id: o for o in eng.step() + eng.step() if o.finished}
    llm.load_lora_adapter("c", ads["c"])
    assert {e.name: e.tier for e in llm.engine.store.registered()} == {
        "a": "device", "b": "disk", "c": "host"}
    rc = eng.add_request(P3, greedy(8), lora_name="c")
    rb = eng.add_request(P4, greedy(6), lora_name="b")
    outs = run_until_done(eng, outs)
    assert outs[ra.request_id].token_ids == ref(tiny_model_dir, ads["a"], P1, 16)
    assert outs[rc.request_id].token_ids == ref(tiny_model_dir, ads["c"], P3, 8)
    assert outs[rb.request_id].token_ids == ref(tiny_model_dir, ads["b"], P4, 6)
    assert_idle(llm.engine)


# --- admission: the distinct-adapters cap and bounded waiting ------------------------------


@pytest.mark.parametrize("n", [1, 3])
def test_distinct_adapter_cap_enforced_at_admission(tiny_model_dir, ads, n):
    names = list("abc")[:n]
    llm = LLM(str(tiny_model_dir), lora_memory="tiered",
              max_loras_per_batch=n, lora_paths={k: ads[k] for k in names})
    sched, seen = llm.engine.scheduler, []
    orig = sched.schedule

    def schedule():
        batch = orig()
        seen.append({r.adapter_uid for r, _ in batch.entries})  # None = base, counts as one
        return batch

    sched.schedule = schedule
    jobs = [(P1, k) for k in names] + [(P2, None)] + [(P3, k) for k in names] + [(P4, None)]
    outs = gen(llm, [p for p, _ in jobs], [k for _, k in jobs])
    assert max(map(len, seen)) == n
    for (p, k), out in zip(jobs, outs, strict=True):
        assert out == ref(tiny_model_dir, k and ads[k], p, 6)
    assert_idle(llm.engine)


def test_waiting_adapter_is_not_starved(tiny_model_dir, ads):
    def first_step_running_b(starvation_steps: int, steps: int = 30) -> int | None:
        llm = LLM(str(tiny_model_dir), lora_memory="tiered",
                  max_loras_per_batch=2, starvation_steps=starvation_steps,
                  lora_paths={n: ads[n] for n in "abc"})
        eng, max_tokens = llm.engine, 5
        eng.add_request(P1, greedy(max_tokens), lora_name="a")
        eng.add_request(P2, greedy(max_tokens), lora_name="c")
        eng.step()
        rb = eng.add_request(P3, greedy(4), lora_name="b")
        outs, admitted = {}, None
        for i in range(steps):  # a steady stream of a and c arrives behind b
            eng.add_request(P4, greedy(max_tokens), lora_name="a")
            eng.add_request(P1, greedy(max_tokens), lora_name="c")
            outs.update({o.request_id: o for o in eng.step() if o.finished})
            if admitted is None and rb.num_computed_tokens > 0:
                admitted = i
        if admitted is not None:
            outs = run_until_done(eng, outs)
            assert outs[rb.request_id].token_ids == ref(tiny_model_dir, ads["b"], P3, 4)
            assert_idle(llm.engine)
        return admitted

    # bound: starvation_steps of being skipped, then the running requests' remaining tokens
    assert first_step_running_b(4) <= 4 + 5 + 1
    assert first_step_running_b(10**6) is None  # without the guard, b would wait forever

"""The engine's invariant check: it passes between any two steps of real traffic
(forks, aborts, unloads mid-flight, tiered and unified adapter memory), and each kind of
corruption it exists to catch makes it fail with a sentence that names the problem."""

from __future__ import annotations

import pytest
from lora_reference import LIFECYCLE_ADAPTERS, assert_idle, greedy, make_adapters

from loraserve import LLM, SamplingParams
from loraserve.engine.invariants import InvariantError
from loraserve.request import Request

PROMPT = [(7 * i) % 480 + 20 for i in range(22)]


@pytest.fixture(scope="module")
def ads(tiny_model_dir, tmp_path_factory):
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("inv"),
                         {k: LIFECYCLE_ADAPTERS[k] for k in ("a", "b", "c")})


def busy_engine(model_dir, ads, lora_memory):
    """An engine mid-flight: running forks of an adapter, a waiting request, a drain."""
    llm = LLM(str(model_dir), lora_paths={k: str(v) for k, v in ads.items()}, block_size=4,
              kv_cache_tokens=256, max_loras_per_batch=2, lora_memory=lora_memory)
    eng = llm.engine
    eng.add_request(PROMPT, greedy(8), "a", request_id="p")
    for s in range(2):
        eng.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.7, seed=s),
                        "a", request_id=f"f{s}", fork_of="p")
    eng.add_request(PROMPT[:9], greedy(8), "b", request_id="q")
    eng.add_request(PROMPT[3:], greedy(8), "c", request_id="r")
    eng.add_request(PROMPT[:5], greedy(8), None, request_id="base")
    for _ in range(3):
        eng.step()
        eng.check_invariants().raise_if_failed()
    return eng


@pytest.mark.parametrize("lora_memory", ["tiered", "unified"])
def test_holds_between_every_step_of_mixed_traffic(tiny_model_dir, ads, lora_memory):
    eng = busy_engine(tiny_model_dir, ads, lora_memory)
    rep = eng.check_invariants()
    assert rep.ok and rep.requests == 6 and rep.kv_blocks_held > 0 and rep.adapter_refs == 5
    eng.unload_lora_adapter("b")  # drains: still held by q
    eng.abort("f0")
    eng.abort("p")  # its remaining fork goes with it
    rep = eng.check_invariants().raise_if_failed()
    assert rep.adapters_draining == 1 and rep.requests == 3
    while eng.has_work:
        eng.step()
        eng.check_invariants().raise_if_failed()
    assert_idle(eng)
    rep = eng.check_invariants()
    assert rep.kv_blocks_held == 0 and rep.adapter_refs == 0 and rep.adapters_draining == 0


def _leak_block(eng):
    eng.kv.pool.allocate(1)


def _extra_adapter_ref(eng):
    eng.store.entries[eng.store.names["a"]].refcount += 1


def _slot_overwritten(eng):
    e = next(e for e in eng.store.entries.values() if e.slot is not None)
    eng.slot_pool.content[e.slot] = "someone-else"


def _lost_request(eng):
    eng.requests["ghost"] = Request("ghost", [1, 2], greedy(2))


def _drained_not_freed(eng):
    e = eng.store.entries[eng.store.names["c"]]
    eng.unload_lora_adapter("c")  # its request holds it: it drains
    e.refcount = 0  # the drain is over, yet the adapter is not freed
    for r in [*eng.scheduler.running, *eng.scheduler.waiting]:
        if r.lora_name == "c":  # keep refcounts equal to owners: only the drain is wrong
            eng.scheduler.finish(r, "abort")
            eng.requests.pop(r.request_id)
            r.adapter_uid = None


def _orphan_load(eng):
    eng.store.loader.start(999, "/nowhere")  # a read for an adapter uid the store never had


def _waiting_holds_blocks(eng):
    req = eng.scheduler.running.pop()  # "preempted" without giving its blocks back
    req.status = type(req.status).WAITING
    eng.scheduler.waiting.append(req)


def _double_free(eng):
    r = eng.scheduler.running[0]
    eng.kv.pool.free(r.block_table[-1:])


CORRUPTIONS = {
    "leak_block": (_leak_block, "held by 0 live requests"),
    "extra_ref": (_extra_adapter_ref, "live requests"),
    "slot": (_slot_overwritten, "holds other weights"),
    "lost_request": (_lost_request, "no queue holds"),
    "drained": (_drained_not_freed, "never freed"),
    "orphan_load": (_orphan_load, "nobody waits for"),
    "waiting_blocks": (_waiting_holds_blocks, "waiting requests hold KV blocks"),
    "double_free": (_double_free, "held by 1 live requests"),
}


@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_catches_each_kind_of_corruption(tiny_model_dir, ads, what):
    eng = busy_engine(tiny_model_dir, ads, "tiered")
    corrupt, phrase = CORRUPTIONS[what]
    corrupt(eng)
    rep = eng.check_invariants()
    assert not rep.ok and any(phrase in v for v in rep.violations), rep.violations
    with pytest.raises(InvariantError, match="invariants violated"):
        rep.raise_if_failed()

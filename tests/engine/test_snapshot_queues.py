"""The engine's snapshot counts each adapter's queued requests (and the base model's): what
/v1/models and /metrics report per adapter as waiting, beside the requests holding it."""

from __future__ import annotations

from adapter_factory import make_peft_adapter
from lora_reference import P1, P2, greedy, run_until_done

from loraserve import LLM


def test_snapshot_counts_waiting_requests_per_adapter(tiny_model_dir, tmp_path):
    llm = LLM(str(tiny_model_dir), max_num_seqs=2)
    llm.load_lora_adapter("a", make_peft_adapter(tiny_model_dir, tmp_path / "a", seed=5))
    eng = llm.engine
    for i in range(3):
        eng.add_request(P1 if i % 2 else P2, greedy(4), "a")
    for _ in range(2):
        eng.add_request(P1, greedy(4), None)

    def counts():
        snap = eng.snapshot()
        (a,) = [x for x in snap.adapters if x.name == "a"]
        return snap, a

    snap, a = counts()  # nothing admitted yet
    assert (a.refcount, a.waiting, snap.base_in_flight, snap.base_waiting) == (3, 3, 2, 2)
    eng.step()  # two requests run (max_num_seqs), three wait
    snap, a = counts()
    assert snap.running == 2 and snap.waiting == 3
    assert a.waiting + snap.base_waiting == snap.waiting
    assert a.refcount + snap.base_in_flight == snap.running + snap.waiting
    assert a.refcount == 3 and snap.base_in_flight == 2
    run_until_done(eng)
    snap, a = counts()
    assert (a.refcount, a.waiting, snap.base_in_flight, snap.base_waiting) == (0, 0, 0, 0)

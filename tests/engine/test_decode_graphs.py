"""Decode steps replayed from recorded graphs (engine/cuda_graphs.py) give PEFT's tokens.

On this CPU the graphs are `ReplayEmulator`s over the Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1, conftest.py): a step sees each batch only through the static tensors it
closed over, every replay must run the captured ops on the captured shapes, and what a CUDA
capture cannot hold (.item(), tensors made from host data) is refused. On a GPU the engine
records torch.cuda.CUDAGraphs of the same steps (benchmarks/gpu_serving.py).
"""

from __future__ import annotations

import pytest
import torch
from test_multi_lora_reference import MAX_TOKENS, tiny_setup  # noqa: F401

from loraserve import LLM, SamplingParams
from loraserve.engine.cuda_graphs import ReplayEmulator, buckets
from loraserve.ops import elementwise

# greedy: the first N tokens of the references' MAX_TOKENS (fewer steps under the interpreter)
N = 5
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def gpu_code_path():
    """The model's torch ops, as on a GPU: the fused C kernels are CPU-only (and check rope
    positions on the host, which a capture refuses)."""
    was = elementwise.fused_enabled()
    elementwise.set_enabled(False)
    yield
    elementwise.set_enabled(was)


def graph_llm(model_dir, paths, max_bs=8, **knobs) -> LLM:
    # No pace calibration: it runs decode steps at every batch size up to max_num_seqs before
    # the graphs are enabled, all under the interpreter, and none of them is replayed or
    # checked here (engine/test_pace_calibration.py tests it).
    llm = LLM(str(model_dir), lora_paths=paths, max_lora_rank=64, lora_backend="triton",
              attention_backend="triton", lora_memory="tiered", max_loras_per_batch=4,
              pace_calibration=False, **knobs)
    llm.engine.runner.enable_decode_graphs(max_bs, llm.engine.max_model_len,
                                           new_graph=ReplayEmulator, capture_now=False)
    return llm


def replays(llm: LLM) -> dict[tuple[int, bool], int]:
    return {k: g.replays for k, g in llm.engine.runner.graphs.graphs.items()}


def test_buckets():
    assert buckets(1) == (1,)
    assert buckets(8) == (1, 2, 4, 8)
    assert buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert buckets(20) == (1, 2, 4, 8, 16, 20)


@pytest.mark.slow
def test_mixed_batches_replayed_equal_peft(tiny_model_dir, tiny_setup):  # noqa: F811
    # Six adapters of different ranks and targets and the base model, up to 4 sequences a
    # step: every pure decode step replays a graph, whatever mix of adapters and slots it has.
    prompts, paths, refs = tiny_setup
    llm = graph_llm(tiny_model_dir, paths, max_bs=4, max_num_seqs=4)
    order = [(g, 0) for g in prompts]
    outs = llm.generate([prompts[g][i] for g, i in order], GREEDY, lora=[g for g, _ in order])
    got = {k: o.token_ids for k, o in zip(order, outs, strict=True)}
    assert got == {k: refs[k][:N] for k in order}
    graphs = llm.engine.runner.graphs
    used = replays(llm)
    assert sum(used.values()) >= N, used  # most decode steps were replays
    assert any(lora for _, lora in used), "no step with adapters was replayed"
    # adapter mixes and slot reassignments changed between replays: no graph was recorded
    # twice (at most one per bucket and LoRA mode)
    assert graphs.captures == len(graphs.graphs) <= 2 * len(graphs.sizes)
    assert llm.engine.check_invariants().violations == ()


@pytest.mark.slow
def test_base_only_graph_never_serves_an_adapter_batch(tiny_model_dir, tiny_setup):  # noqa: F811
    # SGLang #32703: a graph captured for base-only batches replayed for a LoRA batch drops the
    # adapter. Here the base-only graphs are recorded first, then the same bucket sizes come
    # with adapters: they get graphs of their own, and PEFT's tokens.
    prompts, paths, refs = tiny_setup
    llm = graph_llm(tiny_model_dir, paths, max_bs=2)
    base = llm.generate(prompts[None][:2], GREEDY)
    assert [o.token_ids for o in base] == [refs[(None, i)][:N] for i in range(2)]
    assert replays(llm) and not any(lora for _, lora in replays(llm))
    name = "all-r64"
    outs = llm.generate(prompts[name][:2], GREEDY, lora=[name] * 2)
    assert [o.token_ids for o in outs] == [refs[(name, i)][:N] for i in range(2)]
    used = replays(llm)
    assert any(lora and n for (b, lora), n in used.items())
    # a base-only graph's replays did not grow while adapter batches ran
    assert all(used[k] == n for k, n in replays(llm).items() if not k[1])


@pytest.mark.slow
def test_moved_slot_pool_is_recaptured(tiny_model_dir, tiny_setup):  # noqa: F811
    prompts, paths, refs = tiny_setup
    llm = graph_llm(tiny_model_dir, paths, max_bs=1)
    name = "patterns"
    run = lambda: llm.generate(prompts[name][:1], GREEDY, lora=[name])  # noqa: E731
    assert [o.token_ids for o in run()] == [refs[(name, 0)][:N]]
    graphs = llm.engine.runner.graphs
    before = graphs.captures
    llm.engine.slot_pool.grow(llm.engine.slot_pool.num_slots + 2)  # new A/B tensors
    assert [o.token_ids for o in run()] == [refs[(name, 0)][:N]]
    assert graphs.captures > before


def test_emulator_refuses_what_a_capture_cannot_hold():
    x = torch.zeros(4)
    for bad in (lambda: x.sum().item(), lambda: torch.nonzero(x),
                lambda: x.add_(torch.tensor([1.0, 2.0, 3.0, 4.0]))):
        with pytest.raises(RuntimeError, match="captured step"):
            ReplayEmulator().capture(bad)
    # a replay that runs other shapes than the capture (a step reading per-batch Python state)
    state = {"n": 4}
    g = ReplayEmulator()
    g.capture(lambda: torch.ones(state["n"]).mul_(2))
    g.replay()
    state["n"] = 3
    with pytest.raises(RuntimeError, match="other ops than the capture"):
        g.replay()


def test_graphs_need_the_triton_backends(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), lora_backend="torch", attention_backend="cpu")
    with pytest.raises(ValueError, match="triton attention backend"):
        llm.engine.runner.enable_decode_graphs(4, 64, new_graph=ReplayEmulator)

"""The native decode loop (model/native_decode.py): a decode-only step's layers in one C
call over float32 panels or quantized weights, adapters' LoRA kernel included.

- it computes what the model's Python loop computes, bit for bit (token ids and logprobs of
  a batch decoded with it and without it are equal), with and without sliding windows;
- it runs exactly on the steps it fits (decodes only; adapters only over quantized weights
  and plain LoRA) and leaves the others to the Python loop;
- with adapters it adds the same deltas as the Python loop, bit for bit, rows of several
  adapters of different ranks and targets and base rows in one step, float32 and bf16
  adapter weights;
- a step of few rows over float32 or quantized panels runs in one OpenMP team, and gives the
  same bits as with a team per kernel;
- models it cannot run (oneDNN's float weights, extra norms) do not get it;
- the same holds on an AVX2 build of every kernel (the quantized GEMM is then the dot-order
  one), in a process of its own (a process builds its kernels for one ISA).
"""

from __future__ import annotations

import pytest
import torch
from adapter_factory import build_peft_model, tiny_llama_with_adapter
from avx2_build import assert_passes_on_avx2
from model_factory import make_tiny_family

from loraserve import LLM, SamplingParams
from loraserve.model.native_decode import NativeDecode
from loraserve.ops.qgemm import load_qgemm

pytestmark = pytest.mark.skipif(load_qgemm() is None,
                                reason="no quantized GEMM kernel on this host (gcc, AVX2)")

PROMPTS = [[5, 9, 13, 200, 17, 3, 44], [7, 8], [300, 301, 302, 303, 304, 305, 306, 307, 308,
                                               309, 310, 311, 312, 313, 314, 315, 316, 317]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_with_adapter(tmp_path_factory.mktemp("native"))


def _generate(llm: LLM, lora=None, prompts=PROMPTS):
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp, lora=lora)
    assert all(o.error is None for o in outs)
    return [(o.token_ids, o.logprobs) for o in outs]


def _counting(model, monkeypatch) -> list[int]:
    calls: list[int] = []
    run = NativeDecode.run

    def counted(self, h, *args):
        calls.append(h.shape[0])
        return run(self, h, *args)

    monkeypatch.setattr(NativeDecode, "run", counted)
    return calls


@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_native_loop_equals_the_python_loop(llama, scheme, monkeypatch):
    hf, _ = llama
    llm = LLM(str(hf), quantization=scheme, enable_prefix_caching=False)
    model = llm.engine.model
    assert model.native is not None
    calls = _counting(model, monkeypatch)
    native = _generate(llm)
    # one prefill step (Python), then 11 decode-only steps of all three rows (native)
    assert calls == [3] * 11
    model.native = None
    assert _generate(llm) == native


@pytest.mark.parametrize("team", [2, 3])  # 3: a thread past the second's buffers and work
@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_one_team_per_step_equals_a_team_per_kernel(llama, scheme, team):
    hf, _ = llama
    threads = torch.get_num_threads()
    torch.set_num_threads(team)  # a team needs two threads (CI hosts have two cores)
    try:
        llm = LLM(str(hf), quantization=scheme, enable_prefix_caching=False)
        native = llm.engine.model.native
        assert native.in_team(3) and native.in_team(1)
        # one row: every thread computes the element-wise kernels itself; three: shares
        in_team = _generate(llm), _generate(llm, prompts=PROMPTS[:1])
        native.use_team(False)
        assert not native.in_team(3)
        assert (_generate(llm), _generate(llm, prompts=PROMPTS[:1])) == in_team
    finally:
        torch.set_num_threads(threads)


def test_wide_steps_and_one_thread_take_a_team_per_kernel(llama):
    hf, _ = llama
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native = LLM(str(hf), quantization="int8", enable_prefix_caching=False).engine.model.native
        # 256 MLP columns a row: from 256 rows the element-wise kernels share out their rows
        assert native.in_team(255) and not native.in_team(256)
        torch.set_num_threads(1)
        assert not native.in_team(1)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    """Two more adapters of other ranks and targets (every projection; the MLP only, DoRA)."""
    hf, first = llama
    root = tmp_path_factory.mktemp("native_adapters")
    wide = build_peft_model(hf, r=16, target_modules="all-linear", seed=4, init_scale=0.5)
    wide.save_pretrained(root / "wide", safe_serialization=True)
    dora = build_peft_model(hf, r=4, target_modules=["gate_proj", "down_proj"], seed=5,
                            init_scale=0.5, use_dora=True)
    dora.save_pretrained(root / "dora", safe_serialization=True)
    return {"a": str(first), "wide": str(root / "wide"), "dora": str(root / "dora")}


@pytest.mark.parametrize("scheme,lora_dtype", [("int8", "float32"), ("int4", "float32"),
                                               ("int8", "bfloat16")])
def test_adapter_steps_over_quantized_weights_run_natively(llama, adapters, scheme, lora_dtype,
                                                           monkeypatch):
    hf, _ = llama
    llm = LLM(str(hf), quantization=scheme, lora_paths=adapters, lora_dtype=lora_dtype,
              enable_prefix_caching=False)
    model = llm.engine.model
    assert model.native.takes_lora
    calls = _counting(model, monkeypatch)
    mixed = ["wide", None, "a"]
    native = _generate(llm, lora=mixed)
    assert calls == [3] * 11  # adapter rows, a base row between them
    base = _generate(llm)
    assert native[1] == base[1]  # the base row's answer, whichever rows shared its step
    assert native[0] != base[0] and native[2] != base[2]
    model.native = None
    assert _generate(llm, lora=mixed) == native


def test_adapter_steps_after_the_slot_pool_grew_read_its_new_tensors(llama, adapters,
                                                                      monkeypatch):
    """The pool grows between steps (more adapters resident than it had slots) and its A/B
    tensors are replaced: the C loop must read the new ones. The old ones are kept here and
    filled with NaN, so a step that still read them would answer differently (in a server they
    are freed, and reading them crashed the process)."""
    hf, _ = llama
    llm = LLM(str(hf), quantization="int8", lora_paths=adapters, enable_prefix_caching=False)
    mixed = ["wide", None, "a"]
    before = _generate(llm, lora=mixed)
    pool = llm.engine.slot_pool
    old = [t for per_layer in (pool.A, pool.B) for d in per_layer for t in d.values()]
    pool.grow(pool.num_slots + 2)
    for t in old:
        t.fill_(float("nan"))
    calls = _counting(llm.engine.model, monkeypatch)
    assert _generate(llm, lora=mixed) == before
    assert calls == [3] * 11  # the adapter steps ran in the C loop


def test_adapter_steps_the_c_loop_cannot_run_take_the_python_loop(llama, adapters,
                                                                  monkeypatch):
    hf, _ = llama
    llm = LLM(str(hf), quantization="int8", lora_paths=adapters, enable_prefix_caching=False)
    calls = _counting(llm.engine.model, monkeypatch)
    with_dora = _generate(llm, lora=["a", "dora", None])
    assert calls == []  # DoRA's column scale is applied after the projection, in Python
    llm.engine.model.native = None
    assert _generate(llm, lora=["a", "dora", None]) == with_dora
    # float32 panels: the Python loop's backend fuses the LoRA op into the GEMM
    llm = LLM(str(hf), lora_paths=adapters, enable_prefix_caching=False)
    assert not llm.engine.model.native.takes_lora
    calls = _counting(llm.engine.model, monkeypatch)
    _generate(llm, lora=["a", None, "a"])
    assert calls == []
    _generate(llm)
    assert len(calls) == 11


def test_sliding_windows_are_run_natively(tmp_path, monkeypatch):
    hf = make_tiny_family(tmp_path / "m", "mistral", hidden_size=128, intermediate_size=256,
                          sliding_window=6)
    llm = LLM(str(hf), quantization="int8", enable_prefix_caching=False)
    model = llm.engine.model
    assert model.native is not None and {w.window for w in model.layers} == {6}
    calls = _counting(model, monkeypatch)
    native = _generate(llm)
    assert len(calls) == 11
    model.native = None
    assert _generate(llm) == native


def test_models_it_cannot_run_do_not_get_it(llama, tmp_path, monkeypatch):
    hf, _ = llama
    monkeypatch.setenv("LORASERVE_GEMM", "onednn")  # float32 weights in oneDNN's layout
    assert LLM(str(hf), enable_prefix_caching=False).engine.model.native is None
    monkeypatch.delenv("LORASERVE_GEMM")
    qwen3 = make_tiny_family(tmp_path / "q3", "qwen3", hidden_size=128, intermediate_size=256,
                             head_dim=32)
    llm = LLM(str(qwen3), quantization="int8", enable_prefix_caching=False)
    assert llm.engine.model.native is None  # per-head q/k norms


AVX2_CHECK = """
import sys
from loraserve import LLM, SamplingParams
from loraserve.ops.qgemm import qgemm_isa
assert qgemm_isa() == "avx2"
llm = LLM(sys.argv[1], quantization="int4", lora_paths={"a": sys.argv[2]},
          enable_prefix_caching=False)
model = llm.engine.model
assert model.native is not None and model.native.takes_lora
sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
prompts = [[5, 9, 13, 200, 17, 3, 44], [7, 8]]
def run(lora):
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, sp, lora=lora)]
native = run(None), run(["a", None])
model.native = None
assert (run(None), run(["a", None])) == native
print("equal")
"""


def test_native_loop_on_an_avx2_build(llama):
    hf, adapter = llama
    assert_passes_on_avx2(AVX2_CHECK, hf, adapter, passed="equal")

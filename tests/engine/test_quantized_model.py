"""Quantized base weights in the engine (--quantization int8|int4|gguf):

- the LoRA part stays exact: in a real engine run with an adapter, what the LoRA backend adds
  on top of each quantized projection equals PEFT's own delta (lora_B(lora_A(x)) * scaling)
  on the same input, for every targeted module of every layer;
- a GGUF model's Q8_0 / Q4_0 / Q4_1 / Q4_K tensors are served in their own format (the loader checks
  each decodes exactly to the converted checkpoint, q/k rows un-permuted), lm_head included;
- what cannot be served quantized is refused with a clear error.
"""

from __future__ import annotations

import pytest
import torch
from adapter_factory import build_peft_model
from gguf_factory import write_llama_gguf
from model_factory import make_tiny_llama

from loraserve import LLM, SamplingParams
from loraserve.config import EngineConfig
from loraserve.lora.backends.base import LoraStep
from loraserve.model.projections import weight_format
from loraserve.model.quant_linear import QuantLinear

MODULES = {"qkv": ("self_attn", ["q_proj", "k_proj", "v_proj"]), "o": ("self_attn", ["o_proj"]),
           "gate_up": ("mlp", ["gate_proj", "up_proj"]), "down": ("mlp", ["down_proj"])}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    hf = make_tiny_llama(root / "hf", initializer_range=0.3)
    peft = build_peft_model(hf, r=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj",
                                                     "down_proj"], seed=4, init_scale=0.5)
    peft.save_pretrained(root / "a", safe_serialization=True)
    return root, hf, peft


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_lora_delta_on_a_quantized_base_is_peft_delta(tiny, scheme, monkeypatch):
    root, hf, peft = tiny
    llm = LLM(str(hf), quantization=scheme, lora_paths={"a": str(root / "a")},
              enable_prefix_caching=False)
    model = llm.engine.model
    assert {weight_format(getattr(layer, g)) for layer in model.layers for g in MODULES} == {
        scheme}
    assert weight_format(model.lm_head) == "int8"
    # every step through the Python loop, whose projections this records (the C decode loop
    # computes the same bits: test_native_decode.py)
    model.native = None
    calls = []
    project = LoraStep.project

    def recording(self, layer, group, x, linear):
        """each LoRA projection's input, its base output alone and its result, as computed
        (later steps of the layer modify the result in place: copies)"""
        y = project(self, layer, group, x, linear)
        assert isinstance(linear, QuantLinear)
        calls.append((layer, group, x.clone(), linear(x), y.clone()))
        return y

    monkeypatch.setattr(LoraStep, "project", recording)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [out] = llm.generate([[5, 9, 13, 200, 17, 3, 44]], sp, lora=["a"])
    assert out.error is None and len(out.token_ids) == 4
    peft_layers = peft.base_model.model.model.layers
    checked = 0
    assert len(calls) == 4 * len(model.layers) * len(MODULES)  # a prefill, 3 decode steps
    for i, group, x, base, final in calls:
        block, names = MODULES[group]
        want = []
        for name in names:
            mod = getattr(getattr(peft_layers[i], block), name)
            if hasattr(mod, "lora_A"):
                with torch.no_grad():
                    d = mod.lora_B["default"](mod.lora_A["default"](x))
                want.append(d * mod.scaling["default"])
                checked += 1
            else:
                want.append(torch.zeros(x.shape[0], mod.out_features))
        # exact up to the rounding of base + delta and of its difference from base
        ulps = 4 * torch.finfo(torch.float32).eps * float(final.abs().max())
        torch.testing.assert_close(final - base, torch.cat(want, dim=1), rtol=1e-5, atol=ulps)
    assert checked == 4 * 2 * 5  # steps x layers x targeted modules


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_tensors_are_served_in_their_own_format(tiny, tmp_path, monkeypatch, qtype):
    root, hf, _ = tiny
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))
    path = write_llama_gguf(hf, tmp_path / f"tiny-{qtype}.gguf", qtype)
    quant = LLM(str(path), quantization="gguf", lora_paths={"a": str(root / "a")})
    plain = LLM(str(path))
    model = quant.engine.model
    lins = [getattr(layer, g) for layer in model.layers for g in MODULES] + [model.lm_head]
    assert {weight_format(lin) for lin in lins} == {qtype}
    assert {weight_format(getattr(layer, g)) for layer in plain.engine.model.layers
            for g in MODULES} == {"float32"}
    # the same values as the float32 model: the projections decode to its weights exactly
    for ours, theirs in zip(model.layers, plain.engine.model.layers, strict=True):
        for g in MODULES:
            assert torch.equal(getattr(ours, g).weight, getattr(theirs, g).weight)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = quant.generate([[5, 9, 13, 200], [7, 7, 30]], sp, lora=[None, "a"])
    assert all(o.error is None and len(o.token_ids) == 6 for o in outs)


def test_gguf_q4k_is_served_in_its_own_format(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_CACHE", str(tmp_path / "cache"))
    hf = make_tiny_llama(tmp_path / "hf", hidden_size=256, intermediate_size=512)
    path = write_llama_gguf(hf, tmp_path / "tiny-Q4_K.gguf", "Q4_K")
    quant, plain = LLM(str(path), quantization="gguf"), LLM(str(path))
    model = quant.engine.model
    assert {weight_format(getattr(layer, g)) for layer in model.layers for g in MODULES} | {
        weight_format(model.lm_head)} == {"Q4_K"}
    for ours, theirs in zip(model.layers, plain.engine.model.layers, strict=True):
        assert torch.equal(ours.gate_up.weight, theirs.gate_up.weight)
    [out] = quant.generate([[5, 9, 13]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.error is None and len(out.token_ids) == 4


def test_what_cannot_be_served_quantized_is_refused(tiny):
    _, hf, _ = tiny
    with pytest.raises(ValueError, match="must be a .gguf file"):
        LLM(str(hf), quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")

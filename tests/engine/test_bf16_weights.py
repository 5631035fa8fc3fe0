"""bfloat16 weights on CPU (`dtype="bfloat16"`): the projections read bf16 weights, the rest of
the model and the adapters compute in float32.

- The LoRA part is exact: in a mixed batch, what each projection's output gains over the bf16
  base projection is PEFT's delta (scaling * B @ A) applied to the same float32 input, and
  exactly zero on base rows.
- The whole model is what it claims to compute: prompt logprobs equal transformers + PEFT on a
  base whose linear layers round their weights, inputs and outputs to bf16 (the adapters'
  layers untouched): within the rare one-ulp differences of bf16 sums, ten times closer
  than to the float32 model on average.
- Where the CPU computes bf16 slowly, bf16 weights are refused before anything is read.
"""

from __future__ import annotations

import pytest
import torch
from adapter_factory import build_peft_model, load_base_model, peft_deltas
from lora_reference import entry
from lora_reference import prompt_logprobs as reference

from loraserve import LLM, SamplingParams
from loraserve.config import ATTN_MODULES, LORA_MODULES, MLP_MODULES
from loraserve.lora.backends.base import LoraStep
from loraserve.model.bf16_linear import Bf16Linear
from loraserve.ops import bf16_gemm

ADAPTERS = {
    "all-r16": dict(r=16, lora_alpha=8, target_modules=LORA_MODULES, seed=31, init_scale=1.0),
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, seed=32, init_scale=1.0),
    "mlp-r4": dict(r=4, lora_alpha=8, target_modules=MLP_MODULES, seed=33, init_scale=1.0),
}
PROMPTS = [[5, 77, 301, 12, 9, 44, 18, 250, 3], [400, 23, 8, 150, 66, 42, 7, 310, 99, 11, 2],
           [260, 31, 17]]
GROUP_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                 "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_adapters")
    models = {}
    for name, spec in ADAPTERS.items():
        m = build_peft_model(tiny_model_dir, **spec)
        m.save_pretrained(root / name, safe_serialization=True)
        models[name] = m.eval()
    return root, models


@pytest.fixture(scope="module")
def llm(tiny_model_dir, adapters):
    root, _ = adapters
    return LLM(model=tiny_model_dir, dtype="bfloat16",
               lora_paths={n: str(root / n) for n in ADAPTERS})


def _round_to_bf16(model) -> torch.nn.Module:
    """The model's base linear layers (not PEFT's lora_A/lora_B) computing as loraserve's bf16
    projections do: weights, inputs and outputs rounded to bf16, sums in float32."""
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".lora_" in name:
            continue
        with torch.no_grad():
            module.weight.copy_(module.weight.to(torch.bfloat16).float())
        module.register_forward_pre_hook(
            lambda _m, args: (args[0].to(torch.bfloat16).float(), *args[1:]))
        module.register_forward_hook(lambda _m, _a, out: out.to(torch.bfloat16).float())
    return model


def test_the_engine_holds_bf16_projections_and_float32_everything_else(llm):
    eng = llm.engine
    assert eng.config.dtype == "bfloat16" and eng.config.lora_dtype == "float32"
    layer = eng.model.layers[0]
    assert all(isinstance(getattr(layer, g), Bf16Linear) for g in GROUP_MODULES)
    assert isinstance(eng.model.lm_head, Bf16Linear)
    assert layer.qkv.weight.dtype == torch.bfloat16
    assert eng.model.embed.dtype == torch.float32 and layer.post_norm.dtype == torch.float32
    assert eng.runner.kv_caches[0][0].dtype == torch.float32
    assert eng.slot_pool.dtype == torch.float32


def test_the_lora_part_is_peft_delta_on_the_same_input(llm, adapters, monkeypatch):
    """Per layer and group, in one mixed batch: project(x) - bf16_linear(x) is PEFT's
    scaling * B @ A on x for adapter rows (0 where the adapter lacks the module), and 0 on
    base rows, bit for bit."""
    _, models = adapters
    seen = []
    original = LoraStep.project

    def recording(self, layer, group, x, linear):
        y = original(self, layer, group, x, linear)
        seen.append((layer, group, x.clone(), (y - linear(x)).clone(), self.plan.batch))
        return y

    monkeypatch.setattr(LoraStep, "project", recording)
    names = [None, *ADAPTERS]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 lora=loras)
    assert seen
    deltas = {n: peft_deltas(m) for n, m in models.items()}
    slot_names = {entry(llm, n).slot: n for n in ADAPTERS}  # one adapter memory: kept
    checked = 0
    for layer, group, x, delta, batch in seen:
        base_rows = torch.ones(x.shape[0], dtype=torch.bool)
        for slot, start, end in batch.segments:
            rows = slice(start, end)
            base_rows[rows] = False
            per_module = deltas[slot_names[slot]]
            parts = []
            for module in GROUP_MODULES[group]:
                kind = "self_attn" if group in ("qkv", "o") else "mlp"
                d = per_module.get(f"model.layers.{layer}.{kind}.{module}")
                width = _module_width(llm.engine.model, layer, group, module)
                parts.append(torch.zeros(width, x.shape[1], dtype=torch.float64) if d is None
                             else d[0].double())
            want = x[rows].double() @ torch.cat(parts).T
            torch.testing.assert_close(delta[rows].double(), want, rtol=1e-4, atol=1e-5)
            checked += 1
        assert torch.equal(delta[base_rows], torch.zeros_like(delta[base_rows]))
    assert checked > 0


def _module_width(model, layer: int, group: str, module: str) -> int:
    if group == "qkv":
        return model.q_size if module == "q_proj" else model.kv_size
    if group == "gate_up":
        return model.inter
    return getattr(model.layers[layer], group).out_features


def test_prompt_logprobs_equal_peft_on_the_bf16_rounded_base(tiny_model_dir, llm, adapters):
    _, models = adapters
    names = [None, *ADAPTERS]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [n for _ in PROMPTS for n in names]
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=1), lora=loras)
    fp32 = {None: load_base_model(tiny_model_dir), **models}
    emulated = {None: _round_to_bf16(load_base_model(tiny_model_dir))}
    for name, spec in ADAPTERS.items():
        emulated[name] = _round_to_bf16(build_peft_model(tiny_model_dir, **spec))
    err_bf16, err_fp32 = [], []
    for out, prompt, name in zip(outs, prompts, loras, strict=True):
        got = [p.logprob for p in out.prompt_logprobs[1:]]
        want = [lp for lp, _, _ in reference(emulated[name], prompt, 1)]
        full = [lp for lp, _, _ in reference(fp32[name], prompt, 1)]
        err_bf16 += [abs(a - b) for a, b in zip(got, want, strict=True)]
        err_fp32 += [abs(a - b) for a, b in zip(got, full, strict=True)]
    # rare one-ulp differences of the bf16 outputs (summation order) are all that is left
    mean_bf16, mean_fp32 = sum(err_bf16) / len(err_bf16), sum(err_fp32) / len(err_fp32)
    assert max(err_bf16) < 3e-2
    assert mean_bf16 < mean_fp32 / 10, (mean_bf16, mean_fp32)


def test_bf16_weights_are_refused_where_the_cpu_computes_them_slowly(tiny_model_dir,
                                                                    monkeypatch):
    monkeypatch.setattr(bf16_gemm, "bf16_speed", lambda: 0.2)
    with pytest.raises(ValueError, match=r"0\.20x the float32 rate.*--dtype float32"):
        LLM(model=tiny_model_dir, dtype="bfloat16")
    monkeypatch.setattr(bf16_gemm, "bf16_speed", lambda: 0.0)
    with pytest.raises(ValueError, match="has no bf16 matmul; serve with --dtype float32"):
        LLM(model=tiny_model_dir, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype float16 needs a GPU"):
        LLM(model=tiny_model_dir, dtype="float16", device="cpu")

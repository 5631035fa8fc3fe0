"""Mixture-of-experts families compute what transformers + PEFT compute on the same weights.

Each family saves a tiny random checkpoint with transformers' own config class (8 experts,
top-2; the router random, so routing is decided by the weights), PEFT adapters over it (LoRA
on every expert through target_parameters, on attention, and on Qwen2-MoE's shared expert),
and serves base and adapter prompts mixed in ONE `generate` call with chunked prefill, on
both CPU LoRA backends (and the triton one, interpreted). The reference is a
plain argmax loop over the HF model (a PeftModel for adapter rows; PEFT's ParamWrapper cannot
mix adapters in a batch, so one at a time).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from adapter_factory import build_peft_model, load_base_model
from lora_reference import argmax_loop, assert_interleaved_batch_matches
from model_factory import make_tiny_family
from moe_factory import MOE_FAMILIES

from loraserve import LLM, SamplingParams

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# and Mixtral with a window shorter than the prompts (binding on every layer)
FAMILIES = {**MOE_FAMILIES,
            "mixtral-window": ("mixtral", {**MOE_FAMILIES["mixtral"][1], "sliding_window": 8})}
ADAPTERS = {
    # every expert's gate_up and down, plus q_proj: rows mix attention and expert LoRA
    "experts": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS,
                    seed=1, init_scale=0.5),
    # one expert weight only, by its full-path suffix, no target_modules at all
    "down-only": dict(r=2, lora_alpha=8, target_modules=[],
                      target_parameters=["mlp.experts.down_proj"], seed=2, init_scale=0.8),
}
SHARED = dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj",
                                                 "o_proj"], seed=3, init_scale=0.5)
LENGTHS = [3, 17, 40]  # 40: several chunks of 16
MAX_TOKENS = 8


_CASES: dict[str, tuple] = {}


def build_family(root: Path, family: str):
    """Checkpoint, adapter paths, prompts per group (None = base) and reference tokens; built
    once per family and shared by the backends."""
    if family in _CASES:
        return _CASES[family]
    model_type, fields = FAMILIES[family]
    base_dir = make_tiny_family(root / family / "base", model_type, **fields)
    specs = dict(ADAPTERS, **({"shared": SHARED} if family == "qwen2_moe" else {}))
    rng = random.Random(len(family))
    prompts = {g: [[rng.randrange(4, 512) for _ in range(n)] for n in LENGTHS]
               for g in [None, *specs]}
    base = load_base_model(base_dir)
    refs = {(None, i): argmax_loop(base, p, MAX_TOKENS) for i, p in enumerate(prompts[None])}
    paths = {}
    for name, spec in specs.items():
        model = build_peft_model(base_dir, **spec)
        paths[name] = str(root / family / name)
        model.save_pretrained(paths[name], safe_serialization=True)
        for i, p in enumerate(prompts[name]):
            refs[(name, i)] = argmax_loop(model, p, MAX_TOKENS)
        assert any(refs[(name, i)] != argmax_loop(base, p, MAX_TOKENS)
                   for i, p in enumerate(prompts[name])), f"{name} changes nothing"
    _CASES[family] = (base_dir, paths, prompts, refs)
    return _CASES[family]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_mixed_batch_equals_transformers_and_peft(family, backend, tmp_path_factory):
    _check(tmp_path_factory, family, backend)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_moe_triton_backend_interpreted(family, tmp_path_factory):
    # Triton's interpreter is slow: the shortest prompt of each group; attention's and the
    # shared expert's LoRA run in the triton kernels, the experts' in torch beside them
    _check(tmp_path_factory, family, "triton", first_only=True)


def test_moe_adapters_taking_turns_in_one_slot(tmp_path_factory):
    # tiered memory, two slots for three adapters (one per batch beside base rows): each
    # adapter's expert LoRA replaces the one before it in its slot
    _check(tmp_path_factory, "qwen2_moe", "cpu", lora_memory="tiered", max_loras_per_batch=2)


def _check(tmp_path_factory, family: str, backend: str, first_only: bool = False,
           **knobs) -> None:
    base_dir, paths, prompts, refs = build_family(tmp_path_factory.getbasetemp() / "moe",
                                                  family)
    if first_only:
        prompts = {g: ps[:1] for g, ps in prompts.items()}
    llm = LLM(str(base_dir), lora_paths=paths, max_num_batched_tokens=16,
              lora_backend=backend, **knobs)
    assert llm.engine.info.lora_backend == backend
    assert_interleaved_batch_matches(llm, prompts, refs, MAX_TOKENS, (family, backend))


def test_expert_lora_counts_in_adapter_memory(tmp_path_factory):
    from loraserve.adapters.format import read_adapter
    from loraserve.model.families import read_model_config

    base_dir, paths, _, _ = build_family(tmp_path_factory.getbasetemp() / "moe", "mixtral")
    mc = read_model_config(base_dir)
    w = read_adapter(paths["experts"], mc, max_lora_rank=64)
    e, r, d, i = mc.num_experts, 4, mc.hidden_size, mc.moe_intermediate_size
    expert_bytes = 4 * mc.num_hidden_layers * e * r * ((d + 2 * i) + (i + d))
    q_bytes = 4 * mc.num_hidden_layers * r * (d + mc.num_attention_heads * mc.head_dim)
    assert w.nbytes == expert_bytes + q_bytes
    assert sum(x.nbytes for x in w.experts) == expert_bytes
    # and in the slot that holds it, beside the packed q_proj rows
    llm = LLM(str(base_dir), lora_paths={"experts": paths["experts"]})
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), lora=["experts"])
    pool = llm.engine.slot_pool
    assert [e.nbytes for e in pool.extras if e is not None] == [expert_bytes]
    # no dense MLP in Mixtral: its slots hold nothing for gate/up/down
    assert all(layer[g].numel() == 0 for layer in pool.A + pool.B for g in ("gate_up", "down"))

"""Adapters trained when each expert was its own nn.Linear (transformers v4: PEFT's
target_modules on `experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`) give the
tokens of the model with every delta merged into its weights, in mixed batches on both CPU
LoRA backends, with chunked prefill. Where PEFT converts such adapters on load, its tokens are
the same (asserted here). The installed PEFT's conversion keeps only the shared expert's LoRA
on Qwen2-MoE, and cannot load an adapter on some of the experts: the merged model is the
reference there."""

from __future__ import annotations

import random

import pytest
from adapter_factory import load_base_model
from lora_reference import argmax_loop, assert_interleaved_batch_matches
from model_factory import make_tiny_family
from moe_factory import MOE_FAMILIES, per_expert_adapter

from loraserve import LLM

MAX_TOKENS = 8


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_per_expert_adapters_equal_their_merged_weights(family, tmp_path):
    from peft import PeftModel

    model_type, fields = MOE_FAMILIES[family]
    base_dir = make_tiny_family(tmp_path / "base", model_type, **fields)
    merged = {"all": per_expert_adapter(base_dir, tmp_path / "all", seed=1),
              # some experts only, another rank: the others' blocks stay zero
              "some": per_expert_adapter(base_dir, tmp_path / "some", r=3, alpha=6.0, seed=2,
                                         experts=[0, 5, 6])}
    base = load_base_model(base_dir)
    rng = random.Random(3)
    prompts = {g: [[rng.randrange(4, 512) for _ in range(n)] for n in (3, 17, 40)]
               for g in (None, *merged)}
    refs = {(g, i): argmax_loop(base if g is None else merged[g], p, MAX_TOKENS)
            for g, ps in prompts.items() for i, p in enumerate(ps)}
    for g in merged:
        assert any(refs[(g, i)] != argmax_loop(base, p, MAX_TOKENS)
                   for i, p in enumerate(prompts[g])), f"{g} changes nothing"
        if family != "qwen2_moe" and g == "all":
            peft = PeftModel.from_pretrained(load_base_model(base_dir), tmp_path / g).eval()
            assert all(argmax_loop(peft, p, MAX_TOKENS) == refs[(g, i)]
                       for i, p in enumerate(prompts[g]))
    for backend in ("torch", "cpu"):
        llm = LLM(str(base_dir), lora_paths={g: str(tmp_path / g) for g in merged},
                  max_num_batched_tokens=16, lora_backend=backend)
        assert_interleaved_batch_matches(llm, prompts, refs, MAX_TOKENS, (family, backend))

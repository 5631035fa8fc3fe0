"""Every served family computes what transformers + PEFT compute on the same weights.

Each case saves a tiny random checkpoint with transformers' own config class (biases and norm
weights randomised too), two PEFT adapters over it, and serves base and adapter prompts mixed
in ONE `generate` call with chunked prefill. The reference is a plain argmax loop over the HF
model (a PeftModel for adapter rows) that recomputes the whole sequence every token.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from adapter_factory import build_peft_model, load_base_model
from lora_reference import argmax_loop, assert_interleaved_batch_matches
from model_factory import make_tiny_family

from loraserve import LLM
from loraserve.config import ATTN_MODULES, LORA_MODULES

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32, rope_theta=10000.0)
# name -> (model_type, config fields)
CASES: dict[str, tuple[str, dict]] = {
    # prompts run past original_max_position_embeddings (32): every llama3 band is used
    "llama3-rope": ("llama", dict(max_position_embeddings=256, rope_parameters=LLAMA3_ROPE)),
    "linear-rope": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=4.0,
                                                       rope_theta=10000.0))),
    # equals default rope up to max_position_embeddings, the longest context served
    "dynamic-rope": ("llama", dict(max_position_embeddings=128,
                                   rope_parameters=dict(rope_type="dynamic", factor=2.0,
                                                        rope_theta=10000.0))),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral-window-not-binding": ("mistral", dict(sliding_window=512,
                                                   max_position_embeddings=512)),
    "qwen2": ("qwen2", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen3": ("qwen3", dict(head_dim=32)),  # head_dim independent of hidden / heads (16)
    # yarn: interpolated, ramped and kept pairs, and its attention factor on cos/sin
    "qwen3-yarn": ("qwen3", dict(head_dim=32, max_position_embeddings=256,
                                 rope_parameters=dict(rope_type="yarn", factor=4.0,
                                                      original_max_position_embeddings=32,
                                                      rope_theta=10000.0))),
    # layer 1 skips RoPE (NoPE); tied embeddings as SmolLM3 ships them
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0], tie_word_embeddings=True)),
    # windows on some layers, none binding (as long as the longest context served)
    "qwen2-window-not-binding": ("qwen2", dict(use_sliding_window=True, sliding_window=512,
                                               max_window_layers=1)),
}
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, seed=1, init_scale=0.5),
    "all": dict(r=4, lora_alpha=8, target_modules=LORA_MODULES, seed=2, init_scale=0.5),
}
LENGTHS = [3, 17, 45, 90]  # 45 and 90: past llama3's original context and several chunks
MAX_TOKENS = 8


def prompts_for(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(n)] for n in LENGTHS]


def build_case(tmp: Path, model_type: str, fields: dict):
    """The checkpoint, adapter paths, prompts per group (None = base) and reference tokens."""
    base_dir = make_tiny_family(tmp / "base", model_type, **fields)
    groups: list[str | None] = [None, *ADAPTERS]
    prompts = {g: prompts_for(i) for i, g in enumerate(groups)}
    base = load_base_model(base_dir)
    refs = {(None, i): argmax_loop(base, p, MAX_TOKENS) for i, p in enumerate(prompts[None])}
    paths = {}
    for name, spec in ADAPTERS.items():
        model = build_peft_model(base_dir, **spec)
        paths[name] = str(tmp / name)
        model.save_pretrained(paths[name], safe_serialization=True)
        for i, p in enumerate(prompts[name]):
            refs[(name, i)] = argmax_loop(model, p, MAX_TOKENS)
        # an adapter that was silently skipped must not pass
        assert any(refs[(name, i)] != argmax_loop(base, p, MAX_TOKENS)
                   for i, p in enumerate(prompts[name])), f"{name} changes nothing"
    return base_dir, paths, prompts, refs


@pytest.mark.parametrize("case", list(CASES))
def test_family_mixed_batch_equals_transformers_and_peft(case, tmp_path):
    model_type, fields = CASES[case]
    base_dir, paths, prompts, refs = build_case(tmp_path, model_type, fields)
    llm = LLM(str(base_dir), lora_paths=paths, max_num_batched_tokens=16)
    assert_interleaved_batch_matches(llm, prompts, refs, MAX_TOKENS, (case,))


@pytest.mark.parametrize("case", ["llama3-rope", "linear-rope", "qwen3-yarn"])
def test_rope_scaling_changes_the_tokens(case, tmp_path):
    # Guards the test above: the same weights with plain rope give other tokens, so a model
    # that ignored the scaling could not pass it.
    from transformers import AutoModelForCausalLM

    model_type, fields = CASES[case]
    base_dir = make_tiny_family(tmp_path / "base", model_type, **fields)
    scaled = load_base_model(base_dir)
    plain = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)).eval()
    prompts = prompts_for(7)
    assert any(argmax_loop(scaled, p, MAX_TOKENS) != argmax_loop(plain, p, MAX_TOKENS)
               for p in prompts)


@pytest.mark.parametrize("targets, named", [
    (["qkv_proj"], "'qkv_proj'"),  # Phi-3's fused module: not in a Qwen3 model
    (["q_norm"], "'q_norm'"),  # in the model, but not a LoRA-targetable linear
    (r".*\.c_attn", "targets no module"),  # a regex matching nothing
])
def test_adapter_whose_targets_match_nothing_is_refused(targets, named, tmp_path):
    from adapter_factory import edit_config, make_peft_adapter

    from loraserve.types import LoraServeError

    base_dir = make_tiny_family(tmp_path / "base", "qwen3")
    adapter = make_peft_adapter(base_dir, tmp_path / "a", target_modules=["q_proj"])
    edit_config(adapter, target_modules=targets)
    llm = LLM(str(base_dir))
    with pytest.raises(LoraServeError, match=named):
        llm.load_lora_adapter("a", str(adapter))

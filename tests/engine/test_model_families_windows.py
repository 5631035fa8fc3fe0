"""More families and sliding windows against transformers + PEFT, as in
test_model_families.py: a tiny random checkpoint, two PEFT adapters, base and adapter rows
mixed in one `generate` call with chunked prefill (16 tokens a step, so later chunks attend to
cached context), greedy tokens equal to a plain argmax loop over the HF model.

Windows (8) are shorter than most prompts (17, 45, 90 tokens) and than the generated tails,
so prefill, chunks with cached context and decodes all cut the context. Each case runs under
the CPU backend's C decode kernel, its gather + SDPA path, or the triton kernel (interpreted).
"""

from __future__ import annotations

import pytest
from lora_reference import assert_interleaved_batch_matches
from test_model_families import MAX_TOKENS, argmax_loop, prompts_for

from loraserve import LLM, SamplingParams
from loraserve.config import ATTN_MODULES, LORA_MODULES

PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=128,
                short_factor=[1.0 + 0.25 * i for i in range(8)], long_factor=[4.0] * 8)
GEMMA3_ROPE = dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                   sliding_attention=dict(rope_type="default", rope_theta=1000.0))
SLIDING_FULL = ["sliding_attention", "full_attention"]
# name -> (model_type, config fields, adapter targets, attention path)
CASES: dict[str, tuple[str, dict, tuple[str, ...], str]] = {
    "mistral-window": ("mistral", dict(sliding_window=8), ATTN_MODULES, "kernel"),
    "qwen2-sliding-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                           max_window_layers=1), ATTN_MODULES, "gather"),
    "qwen3-sliding-layers": ("qwen3", dict(use_sliding_window=True, sliding_window=8,
                                           max_window_layers=1, head_dim=32), ATTN_MODULES,
                             "kernel"),
    # layer 1 is NoPE and slides (SmolLM3 slides its NoPE layers)
    "smollm3-sliding": ("smollm3", dict(use_sliding_window=True, sliding_window=8,
                                        no_rope_layers=[1, 0]), ATTN_MODULES, "kernel"),
    "gemma": ("gemma", dict(head_dim=16), LORA_MODULES, "kernel"),
    # soft-capped scores that bind, alternating windows, query_pre_attn_scalar != head_dim
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                              layer_types=SLIDING_FULL), LORA_MODULES, "kernel"),
    "gemma2-gather": ("gemma2", dict(head_dim=16, sliding_window=8, attn_logit_softcapping=3.0,
                                     layer_types=SLIDING_FULL), ATTN_MODULES, "gather"),
    "gemma2-triton": ("gemma2", dict(head_dim=16, sliding_window=8, attn_logit_softcapping=3.0,
                                     layer_types=SLIDING_FULL), ATTN_MODULES, "triton"),
    # q/k norms, a local rope base on the sliding layer, scaled rope on the full one
    "gemma3": ("gemma3_text", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=SLIDING_FULL, rope_parameters=GEMMA3_ROPE),
               LORA_MODULES, "kernel"),
    "phi3": ("phi3", dict(), PHI3_MODULES, "kernel"),
    # longrope's short factors and its attention factor (context 512 over 128: capped at
    # 128), a window on every layer
    "phi3-longrope-window": ("phi3", dict(max_position_embeddings=512, sliding_window=8,
                                          original_max_position_embeddings=128,
                                          rope_parameters=LONGROPE), ("qkv_proj",), "gather"),
    "granite": ("granite", dict(embedding_multiplier=3.0, attention_multiplier=0.05,
                                residual_multiplier=0.6, logits_scaling=4.0),
                LORA_MODULES, "kernel"),
    "olmo2": ("olmo2", dict(), LORA_MODULES, "kernel"),
}
ADAPTERS = {"a": dict(r=8, lora_alpha=16, seed=1, init_scale=0.5),
            "b": dict(r=4, lora_alpha=8, seed=2, init_scale=0.5)}


def build(tmp, model_type: str, fields: dict, targets: tuple[str, ...]):
    from adapter_factory import build_peft_model, load_base_model
    from model_factory import make_tiny_family

    base_dir = make_tiny_family(tmp / "base", model_type, **fields)
    groups = [None, *ADAPTERS]
    prompts = {g: prompts_for(10 + i) for i, g in enumerate(groups)}
    base = load_base_model(base_dir)
    refs = {(None, i): argmax_loop(base, p, MAX_TOKENS) for i, p in enumerate(prompts[None])}
    paths = {}
    # adapter "b" targets only the first module (qkv_proj alone for Phi-3)
    for (name, spec), mods in zip(ADAPTERS.items(), (targets, targets[:1]), strict=True):
        model = build_peft_model(base_dir, target_modules=mods, **spec)
        paths[name] = str(tmp / name)
        model.save_pretrained(paths[name], safe_serialization=True)
        for i, p in enumerate(prompts[name]):
            refs[(name, i)] = argmax_loop(model, p, MAX_TOKENS)
        assert any(refs[(name, i)] != argmax_loop(base, p, MAX_TOKENS)
                   for i, p in enumerate(prompts[name])), f"{name} changes nothing"
    return base_dir, paths, prompts, refs


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if CASES[c][3] == "triton"
                                  else c for c in CASES])
def test_family_equals_transformers_and_peft(case, tmp_path, monkeypatch):
    model_type, fields, targets, path = CASES[case]
    base_dir, paths, prompts, refs = build(tmp_path, model_type, fields, targets)
    monkeypatch.setenv("LORASERVE_PAGED_DECODE", "0" if path == "gather" else "1")
    backend = "triton" if path == "triton" else "cpu"
    llm = LLM(str(base_dir), lora_paths=paths, max_num_batched_tokens=16,
              attention_backend=backend)
    assert_interleaved_batch_matches(llm, prompts, refs, MAX_TOKENS, (case,))


@pytest.mark.parametrize("case", ["mistral-window", "gemma2", "gemma3", "granite"])
def test_the_window_or_the_multipliers_change_the_tokens(case, tmp_path):
    # Guards the test above: without the window (or the family's multipliers/soft-caps) the
    # same weights give other tokens, so a model that ignored them could not pass it.
    from adapter_factory import load_base_model
    from model_factory import make_tiny_family

    model_type, fields, _, _ = CASES[case]
    plain_fields = {"mistral-window": dict(sliding_window=None),
                    "gemma2": dict(sliding_window=4096, attn_logit_softcapping=None),
                    # one rope for all layers: the sliding layer's local base is what differs
                    "gemma3": dict(rope_parameters=dict(
                        full_attention=GEMMA3_ROPE["full_attention"],
                        sliding_attention=GEMMA3_ROPE["full_attention"])),
                    "granite": dict(embedding_multiplier=1.0, attention_multiplier=0.25,
                                    residual_multiplier=1.0, logits_scaling=1.0)}[case]
    real = load_base_model(make_tiny_family(tmp_path / "a", model_type, **fields))
    plain = load_base_model(make_tiny_family(tmp_path / "b", model_type,
                                             **{**fields, **plain_fields}))
    prompts = prompts_for(10)
    assert any(argmax_loop(real, p, MAX_TOKENS) != argmax_loop(plain, p, MAX_TOKENS)
               for p in prompts)


@pytest.mark.parametrize("targets, named", [
    (["q_proj"], "'q_proj'"),  # Phi-3 has no q_proj: its attention input is qkv_proj
    (["gate_proj", "up_proj"], "'gate_proj'"),
    (r".*\.k_proj", "targets no module"),
])
def test_phi3_adapter_whose_targets_match_nothing_is_refused(targets, named, tmp_path):
    from adapter_factory import edit_config, make_peft_adapter
    from model_factory import make_tiny_family

    from loraserve.types import LoraServeError

    base_dir = make_tiny_family(tmp_path / "base", "phi3")
    adapter = make_peft_adapter(base_dir, tmp_path / "a", target_modules=["qkv_proj"])
    edit_config(adapter, target_modules=targets)
    llm = LLM(str(base_dir))
    with pytest.raises(LoraServeError, match=named):
        llm.load_lora_adapter("a", str(adapter))


@pytest.mark.parametrize("case", ["gemma2", "granite"])
def test_logprobs_follow_the_final_softcap_and_logits_scaling(case, tmp_path):
    # Greedy tokens cannot see a monotone map of the logits (Gemma 2's final soft-cap,
    # Granite's logits_scaling): the logprobs can.
    import torch
    from adapter_factory import load_base_model
    from model_factory import make_tiny_family

    model_type, fields, _, _ = CASES[case]
    base_dir = make_tiny_family(tmp_path / "base", model_type, **fields)
    hf = load_base_model(base_dir)
    prompt = prompts_for(3)[1]
    out = LLM(str(base_dir)).generate([prompt], SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5))[0]
    with torch.inference_mode():
        want = torch.log_softmax(hf(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
    top = torch.topk(want, 5)
    assert out.top_logprobs[0] == pytest.approx(
        dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)), abs=1e-4)


@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_prefix_cache_under_a_window(path, tmp_path, monkeypatch):
    # A prompt's K/V does not depend on the window: a later prompt that extends it reuses the
    # cached blocks (far longer than the window) and still computes the HF tokens.
    from adapter_factory import load_base_model
    from model_factory import make_tiny_family

    monkeypatch.setenv("LORASERVE_PAGED_DECODE", "0" if path == "gather" else "1")
    model_type, fields, _, _ = CASES["gemma2"]
    base_dir = make_tiny_family(tmp_path / "base", model_type, **fields)
    hf = load_base_model(base_dir)
    first, extra = prompts_for(5)[3][:64], prompts_for(6)[1]
    llm = LLM(str(base_dir), max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert llm.generate([first], params)[0].token_ids == argmax_loop(hf, first, MAX_TOKENS)
    out = llm.generate([first + extra], params)[0]
    assert out.num_cached_tokens >= 48
    assert out.token_ids == argmax_loop(hf, first + extra, MAX_TOKENS)

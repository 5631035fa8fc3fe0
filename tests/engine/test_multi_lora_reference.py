"""Multi-LoRA greedy outputs equal transformers + PEFT, per adapter, in one mixed batch.

Six PEFT adapters that differ in rank (4..64), alpha, rslora, target modules (attention only,
MLP only, all seven, a single module, a partial mix) and rank/alpha patterns share ONE
`generate` call with base-model prompts, several prompts of different lengths each. The
reference runs each prompt alone through a float32 `PeftModel` holding only that adapter (or
the plain base model). Sharing the batch must not change any request's tokens, whatever the
slot count (adapters queued behind `max_loras_per_batch`), chunked prefill, preemption or host
evictions with implicit reloads.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from adapter_factory import build_peft_model, load_base_model
from lora_reference import hf_greedy as greedy
from safetensors.torch import load_file

from loraserve import LLM, SamplingParams
from loraserve.config import ATTN_MODULES, LORA_MODULES, MLP_MODULES

# name -> build_peft_model keywords (r / alpha / rslora / targets / patterns all differ)
ADAPTERS: dict[str, dict] = {
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=ATTN_MODULES, seed=11),
    "mlp-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=MLP_MODULES,
                           seed=12),
    "all-r64": dict(r=64, lora_alpha=32, target_modules=LORA_MODULES, seed=13),
    "v-only-r8": dict(r=8, lora_alpha=32, target_modules=["v_proj"], seed=14),
    "patterns": dict(r=8, lora_alpha=16, target_modules=LORA_MODULES, seed=15,
                     rank_pattern={"q_proj": 32, "k_proj": 12, r"layers\.1\.mlp\.down_proj": 2},
                     alpha_pattern={"o_proj": 64, r"layers\.0\.self_attn\.v_proj": 3}),
    "qo-up-r48-rslora": dict(r=48, lora_alpha=24, use_rslora=True, seed=16,
                             target_modules=["q_proj", "o_proj", "up_proj"]),
}
GROUPS: list[str | None] = [*ADAPTERS, None]  # None = the base model
PER_GROUP = 3
MAX_TOKENS = 10
LENGTHS = [1, 2, 3, 5, 7, 9, 11, 13, 16, 19, 22, 25, 28, 31, 35, 39, 43, 47, 52, 57, 60]

# EngineConfig knobs for the same mixed batch.
CONFIGS = {
    "default": {},
    # tiered memory (the GPU layout): 6 adapters + base queued behind 2 per batch, slots
    # reassigned mid-run
    "cap2": {"max_loras_per_batch": 2, "lora_memory": "tiered"},
    "chunked": {"max_num_batched_tokens": 16},
    # everything at once: slot churn, host evictions + implicit reloads, chunks, preemption
    "churn": {"max_loras_per_batch": 3, "max_loaded_loras": 3, "max_num_batched_tokens": 24,
              "kv_cache_tokens": 160, "block_size": 4, "lora_memory": "tiered"},
    # one adapter memory (the CPU default) under pressure: 3 packed adapters at a time, host
    # evictions + implicit reloads, chunks, preemption; max_loras_per_batch=2 does not bind
    "unified-churn": {"max_loras_per_batch": 2, "max_loaded_loras": 3,
                      "max_num_batched_tokens": 24, "kv_cache_tokens": 160, "block_size": 4},
}



def build_references(base_dir: Path, out_dir: Path, adapters: dict[str, dict],
                     prompts: dict[str | None, list[list[int]]], max_new: int):
    """Save every adapter under out_dir; return ({name: path}, {(group, i): PEFT tokens}).
    One PEFT model alive at a time (the bundled model is ~0.5 GB per copy)."""
    paths, refs = {}, {}
    for name, spec in adapters.items():
        model = build_peft_model(base_dir, **spec)
        paths[name] = str(out_dir / name)
        model.save_pretrained(paths[name], safe_serialization=True)
        for i, p in enumerate(prompts[name]):
            refs[(name, i)] = greedy(model, p, max_new)
        del model
    base = load_base_model(base_dir)
    for i, p in enumerate(prompts[None]):
        refs[(None, i)] = greedy(base, p, max_new)
    # Every adapter must change something, or a LoRA that is silently skipped would pass.
    for name in adapters:
        assert any(refs[(name, i)] != greedy(base, p, max_new)
                   for i, p in enumerate(prompts[name])), f"{name} never changes the output"
    return paths, refs


class CapTrace:
    """Wraps scheduler.schedule to record, per step, the distinct adapters (base included)."""

    def __init__(self, llm: LLM):
        self.distinct: list[int] = []
        self.chunks = 0
        self.preempted = 0
        sched = llm.engine.scheduler
        orig = sched.schedule

        def schedule():
            batch = orig()
            if batch.entries:
                self.distinct.append(len({r.adapter_uid for r, _ in batch.entries}))
            self.chunks += sum(r.num_computed_tokens + n < r.num_tokens
                               for r, n in batch.entries)
            self.preempted += len(batch.preempted)
            return batch

        sched.schedule = schedule


def run_mixed(model_dir: Path, paths: dict[str, str], prompts, max_new: int, **knobs):
    # no decode pace unless asked: its measuring steps (decodes alone) would split the mix
    knobs.setdefault("decode_pace_factor", 0)
    llm = LLM(str(model_dir), lora_paths=paths, max_lora_rank=64, **knobs)
    trace = CapTrace(llm)
    order = [(g, i) for i in range(max(map(len, prompts.values())))
             for g in prompts if i < len(prompts[g])]  # interleaved: adapters share every step
    outs = llm.generate([prompts[g][i] for g, i in order],
                        SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True),
                        lora=[g for g, _ in order])
    eng = llm.engine
    assert not eng.has_work
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks, "KV blocks leaked"
    assert all(e.refcount == 0 for e in eng.store.entries.values()), "refcount leaked"
    return dict(zip(order, outs, strict=True)), trace, llm


# --- tiny random Llama ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_setup(tiny_model_dir, tmp_path_factory):
    rng = random.Random(7)
    lengths = iter(LENGTHS)
    prompts = {g: [[rng.randrange(4, 512) for _ in range(next(lengths))]
                   for _ in range(PER_GROUP)] for g in GROUPS}
    paths, refs = build_references(tiny_model_dir, tmp_path_factory.mktemp("mlref"), ADAPTERS,
                                   prompts, MAX_TOKENS)
    return prompts, paths, refs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_mixed_batch_equals_peft(tiny_model_dir, tiny_setup, name):
    prompts, paths, refs = tiny_setup
    knobs = CONFIGS[name]
    outs, trace, llm = run_mixed(tiny_model_dir, paths, prompts, MAX_TOKENS, **knobs)
    if knobs.get("lora_memory") == "tiered":
        assert max(trace.distinct) <= knobs.get("max_loras_per_batch", 8)  # base counts as one
    assert all(e.slot is not None for e in llm.engine.store.entries.values()
               if e.weights is not None) or knobs.get("lora_memory") == "tiered"
    for key, out in outs.items():
        assert out.error is None and out.finish_reason.value == "length", (key, out.error)
        assert out.lora_name == key[0]
        assert out.token_ids == refs[key], key
    entries = llm.engine.store.entries.values()
    if name == "default":
        assert max(trace.distinct) == len(GROUPS), "the adapters never shared a step"
    if name == "cap2":
        assert sum(e.stats.slot_evictions for e in entries) > 0, "no slot was reassigned"
    if "max_num_batched_tokens" in knobs:
        assert trace.chunks > 0, "no chunked prefill"
    if name == "unified-churn":
        assert max(trace.distinct) > 2, "max_loras_per_batch bound a unified memory"
        assert sum(e.stats.host_evictions for e in entries) > 0
        assert sum(e.stats.loads for e in entries) > len(ADAPTERS), "no implicit reload"
        assert sum(e.stats.slot_evictions for e in entries) == 0
    if name == "churn":
        assert trace.preempted > 0, "the small KV pool never preempted anything"
        assert sum(e.stats.host_evictions for e in entries) > 0
        assert sum(e.stats.loads for e in entries) > len(ADAPTERS), "no implicit reload"


@pytest.mark.parametrize("backend,attention", [
    ("torch", "cpu"), pytest.param("triton", "triton", marks=pytest.mark.slow)])
def test_tiny_mixed_batch_equals_peft_on_other_backends(tiny_model_dir, tiny_setup,
                                                        monkeypatch, backend, attention):
    # torch: the LoRA path without the C kernel (no compiler); triton: the GPU kernels, LoRA
    # and paged attention, here under Triton's interpreter (TRITON_INTERPRET=1,
    # tests/conftest.py), chunked prefill included. Same tokens as PEFT's.
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", backend)
    prompts, paths, refs = tiny_setup
    if backend == "triton":  # the interpreter is slow: each group's longest prompt (chunked)
        refs = {(g, 0): refs[(g, len(ps) - 1)] for g, ps in prompts.items()}
        prompts = {g: ps[-1:] for g, ps in prompts.items()}
    outs, trace, llm = run_mixed(tiny_model_dir, paths, prompts, MAX_TOKENS,
                                 attention_backend=attention, max_num_batched_tokens=24)
    assert trace.chunks > 0
    assert llm.engine.info.lora_backend == backend
    assert type(llm.engine.runner.attention).__name__.lower().startswith(attention)
    assert {key: out.token_ids for key, out in outs.items()} == refs


# --- bundled SmolLM2-135M-Instruct ---------------------------------------------------------

BUNDLED_TEXTS = {
    "attn-r4": ["The capital of France is", "def add(a, b):\n    return"],
    "mlp-r16-rslora": ["Water boils at", "Once upon a time, in a small village by the sea,"],
    "all-r64": ["SELECT * FROM users WHERE", "My favourite colour is"],
    "v-only-r8": ["1, 2, 3, 4,", "Translate to French: good morning"],
    "patterns": ["Q: What is 2+2?\nA:", "The quick brown fox jumps over the lazy dog. The"],
    "qo-up-r48-rslora": ["Hi", "import torch\nimport numpy as np\n"],
    None: ["The sun rises in the", "Dear team, thank you for"],
}


@pytest.mark.slow
def test_bundled_mixed_batch_equals_peft(bundled_model_dir, tmp_path):
    from transformers import AutoTokenizer

    max_new = 4
    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir))
    prompts = {g: [tok.encode(t) for t in texts] for g, texts in BUNDLED_TEXTS.items()}
    # init_scale 0.5: at the default 0.2 a trained model shrugs some adapters off entirely.
    adapters = {n: {**spec, "init_scale": 0.5} for n, spec in ADAPTERS.items()}
    paths, refs = build_references(bundled_model_dir, tmp_path, adapters, prompts, max_new)
    outs, trace, _ = run_mixed(bundled_model_dir, paths, prompts, max_new,
                               kv_cache_tokens=1024)
    assert max(trace.distinct) == len(GROUPS)  # all seven shared a step
    for key, out in outs.items():
        assert out.prompt_token_ids == prompts[key[0]][key[1]]
        assert out.token_ids == refs[key], (key, BUNDLED_TEXTS[key[0]][key[1]])
    # Two per batch, the rest queued, prompts in 8-token chunks: the same tokens.
    outs, trace, _ = run_mixed(bundled_model_dir, paths, prompts, max_new, kv_cache_tokens=1024,
                               max_loras_per_batch=2, max_num_batched_tokens=8,
                               lora_memory="tiered")
    assert max(trace.distinct) <= 2 and trace.chunks > 0
    assert {k: o.token_ids for k, o in outs.items()} == refs


def test_tiny_bf16_adapters_are_exact_with_bf16_lora_dtype(tiny_model_dir, tmp_path):
    # Adapters trained in bf16 ship bf16 weights; lora_dtype="bfloat16" stores them as they
    # are (scales alpha/r and alpha/sqrt(r) here are powers of two, so B * scale is exact
    # too): the same tokens as PEFT, and as our float32 pool.
    specs = {"bf-all-r8": dict(r=8, lora_alpha=16, target_modules=LORA_MODULES, seed=21),
             "bf-mlp-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True,
                                       target_modules=MLP_MODULES, seed=22)}
    rng = random.Random(3)
    prompts = {g: [[rng.randrange(4, 512) for _ in range(n)] for n in (5, 17)]
               for g in (*specs, None)}
    paths, refs = {}, {}
    for name, spec in specs.items():
        model = build_peft_model(tiny_model_dir, **spec)
        lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
        for p in lora_params:
            p.data = p.data.to(torch.bfloat16).float()  # bf16-representable, computed in fp32
        for i, p in enumerate(prompts[name]):
            refs[(name, i)] = greedy(model, p, MAX_TOKENS)
        for p in lora_params:
            p.data = p.data.to(torch.bfloat16)  # saved as bf16, as bf16 training leaves them
        paths[name] = str(tmp_path / name)
        model.save_pretrained(paths[name], safe_serialization=True)
        saved = load_file(Path(paths[name]) / "adapter_model.safetensors")
        assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    base = load_base_model(tiny_model_dir)
    for i, p in enumerate(prompts[None]):
        refs[(None, i)] = greedy(base, p, MAX_TOKENS)
    for lora_dtype in ("bfloat16", "auto"):
        outs, _, llm = run_mixed(tiny_model_dir, paths, prompts, MAX_TOKENS,
                                 lora_dtype=lora_dtype)
        assert llm.engine.slot_pool.dtype == (torch.bfloat16 if lora_dtype == "bfloat16"
                                              else torch.float32)
        assert {key: out.token_ids for key, out in outs.items()} == refs, lora_dtype

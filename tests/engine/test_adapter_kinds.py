"""Every LoRA variant users train, served exactly as transformers + PEFT compute it, per row of
one mixed batch: lora_bias, DoRA (with and without rsLoRA, on a model with q/k/v biases too),
LoRA on embed_tokens and lm_head, modules_to_save copies of both, trainable tokens; untied and
tied embeddings. Each adapter shares one `generate` call with plain LoRA and base rows; the
reference runs each prompt alone through a float32 PeftModel (tests/lora_reference.py) and
every adapter must change some tokens, so a part that was silently skipped cannot pass.
Backends: the C kernel (`cpu`, with chunked prefill), `torch`, and `triton` (interpreted).
"""

from __future__ import annotations

import random

import pytest
from test_multi_lora_reference import build_references, run_mixed

from loraserve import SamplingParams
from loraserve.config import ATTN_MODULES, LORA_MODULES, MLP_MODULES

MAX_TOKENS = 8
# trainable tokens: ids the prompts below contain (prompts are drawn from 4..511)
TOKENS = [7, 40, 41, 42, 43, 44, 45, 46, 47, 48]

# name -> build_peft_model keywords
UNTIED = {
    "plain": dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, seed=31),
    "lora-bias": dict(r=8, lora_alpha=16, target_modules=LORA_MODULES, lora_bias=True,
                      seed=32),
    "dora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                 use_dora=True, seed=33, init_scale=1.0),
    "dora-rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=LORA_MODULES,
                        use_dora=True, seed=34, init_scale=1.0),
    "embed-head": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head",
                                                           "q_proj"], seed=35, init_scale=1.0),
    "saved-copies": dict(r=4, lora_alpha=8, target_modules=MLP_MODULES, seed=36,
                         modules_to_save=["lm_head", "embed_tokens"]),
    "tokens": dict(r=4, lora_alpha=8, target_modules=["v_proj"], seed=37,
                   trainable_token_indices=TOKENS),
    "tokens-both-ends": dict(r=4, lora_alpha=8, target_modules=["v_proj"], seed=38,
                             trainable_token_indices={"embed_tokens": TOKENS[:5],
                                                      "lm_head": TOKENS[3:]}),
}
TIED = {
    "plain": UNTIED["plain"],
    "embed-head": UNTIED["embed-head"],
    # PEFT ties lm_head's LoRA to the embedding's (lora_A = emb_B.T, lora_B = emb_A.T)
    "embed-tied-head": dict(r=8, lora_alpha=16, target_modules=["embed_tokens"], seed=39,
                            init_scale=1.0, ensure_weight_tying=True),
    "saved-copies": UNTIED["saved-copies"],
    "saved-embed-only": dict(r=4, lora_alpha=8, target_modules=["q_proj"], seed=40,
                             modules_to_save=["embed_tokens"]),
    # the embedding's new rows are lm_head's too (PEFT ties them)
    "tokens": UNTIED["tokens"],
    "dora": UNTIED["dora"],
}


def _prompts(names, seed: int, lengths=(3, 9, 21)) -> dict:
    rng = random.Random(seed)
    out = {}
    for g in [*names, None]:
        out[g] = [[rng.randrange(4, 512) for _ in range(n)] for n in lengths]
        out[g][0][1:2] = [TOKENS[rng.randrange(len(TOKENS))]]  # a trainable token in each
    return out


@pytest.fixture(scope="module")
def untied(tiny_model_dir, tmp_path_factory):
    prompts = _prompts(UNTIED, 5)
    paths, refs = build_references(tiny_model_dir, tmp_path_factory.mktemp("kinds"), UNTIED,
                                   prompts, MAX_TOKENS)
    return tiny_model_dir, prompts, paths, refs


@pytest.fixture(scope="module")
def tied(tiny_tied_model_dir, tmp_path_factory):
    prompts = _prompts(TIED, 6)
    paths, refs = build_references(tiny_tied_model_dir, tmp_path_factory.mktemp("kinds_tied"),
                                   TIED, prompts, MAX_TOKENS)
    return tiny_tied_model_dir, prompts, paths, refs


def _check(setup, monkeypatch, backend: str, **knobs):
    model_dir, prompts, paths, refs = setup
    monkeypatch.setenv("LORASERVE_LORA_BACKEND", backend)
    if backend == "triton":  # the interpreter is slow: each group's longest prompt
        refs = {(g, 0): refs[(g, len(ps) - 1)] for g, ps in prompts.items()}
        prompts = {g: ps[-1:] for g, ps in prompts.items()}
    outs, trace, llm = run_mixed(model_dir, paths, prompts, MAX_TOKENS, **knobs)
    assert llm.engine.info.lora_backend == backend
    # all share a step (interpreted triton, with one prompt each in 16-token steps: several)
    assert max(trace.distinct) >= (5 if backend == "triton" else len(prompts))
    got = {key: out.token_ids for key, out in outs.items()}
    assert got == refs, [k for k in refs if got[k] != refs[k]]
    return trace


@pytest.mark.parametrize("backend",
                         ["cpu", "torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_untied_kinds_in_one_mixed_batch_equal_peft(untied, monkeypatch, backend):
    trace = _check(untied, monkeypatch, backend, max_num_batched_tokens=16)
    assert trace.chunks > 0


def test_untied_kinds_unchunked(untied, monkeypatch):
    _check(untied, monkeypatch, "cpu")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_tied_kinds_in_one_mixed_batch_equal_peft(tied, monkeypatch, backend):
    _check(tied, monkeypatch, backend, max_num_batched_tokens=16)


# Families where the epilogue meets other data: Qwen2's q/k/v biases (DoRA scales W x + s B A x,
# not the base bias) and Phi-3's fused projections (DoRA's norm per row of the fused weight).
FAMILY_CASES = {
    "qwen2": ("qwen2", {
        "dora": dict(r=8, lora_alpha=16, target_modules=ATTN_MODULES, use_dora=True, seed=41,
                     init_scale=1.0),
        "dora-rslora": dict(r=4, lora_alpha=8, use_rslora=True, use_dora=True, seed=42,
                            target_modules=LORA_MODULES, init_scale=1.0),
        "lora-bias": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "down_proj"],
                          lora_bias=True, seed=43),
    }),
    "phi3": ("phi3", {
        "dora": dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "gate_up_proj"],
                     use_dora=True, seed=44, init_scale=1.0),
        "lora-bias": dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj"],
                          lora_bias=True, seed=45),
    }),
}


@pytest.mark.parametrize("case", list(FAMILY_CASES))
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_family_kinds_equal_peft(case, backend, tmp_path, monkeypatch):
    from model_factory import make_tiny_family

    model_type, adapters = FAMILY_CASES[case]
    base_dir = make_tiny_family(tmp_path / "base", model_type)
    prompts = _prompts(adapters, 8)
    paths, refs = build_references(base_dir, tmp_path, adapters, prompts, MAX_TOKENS)
    _check((base_dir, prompts, paths, refs), monkeypatch, backend, max_num_batched_tokens=16)


@pytest.mark.slow
def test_decode_graphs_leave_steps_with_extra_parts_eager(untied):
    # A recorded decode graph holds the B @ A deltas only: a step with a DoRA, lora_bias or
    # vocabulary-part adapter runs eagerly, the others replay; every row keeps PEFT's tokens.
    from test_decode_graphs import GREEDY, N, graph_llm

    from loraserve.ops import elementwise

    model_dir, prompts, paths, refs = untied
    was = elementwise.fused_enabled()
    elementwise.set_enabled(False)  # the GPU code path (test_decode_graphs.py)
    try:
        llm = graph_llm(model_dir, paths, max_bs=4, max_num_seqs=4)
        order = [(g, 0) for g in prompts]
        outs = llm.generate([prompts[g][0] for g, _ in order], GREEDY,
                            lora=[g for g, _ in order])
    finally:
        elementwise.set_enabled(was)
    assert {k: o.token_ids for k, o in zip(order, outs, strict=True)} == {
        k: refs[k][:N] for k in order}
    assert sum(g.replays for g in llm.engine.runner.graphs.graphs.values()) > 0


def test_dora_scale_is_computed_once_at_load_as_peft_does(tiny_model_dir, tmp_path):
    # m / ||W + s B A||_c per output row, from the engine's own (packed) base weights, equal to
    # PEFT's DoraLinearLayer.get_weight_norm on the HF weights; the step never recomputes it.
    import torch
    from adapter_factory import build_peft_model

    from loraserve import LLM

    spec = dict(UNTIED["dora-rslora"], target_modules=["q_proj", "gate_proj", "down_proj"])
    model = build_peft_model(tiny_model_dir, **spec)
    model.save_pretrained(tmp_path / "d")
    w = LLM(str(tiny_model_dir)).engine.read_adapter(tmp_path / "d")
    for layer in range(2):
        for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
            mod = model.base_model.model.model.layers[layer].get_submodule(name)
            dora = mod.lora_magnitude_vector["default"]
            with torch.no_grad():
                norm = dora.get_weight_norm(mod.base_layer.weight, mod.get_delta_weight(
                    "default") / mod.scaling["default"], mod.scaling["default"])
            want = dora.weight.detach() / norm
            got = w.layers[layer][name.split(".")[1]].col_scale
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_full_copies_count_in_the_adapter_memory(tiny_model_dir, untied):
    # modules_to_save holds a [V, d] copy of lm_head and of embed_tokens: the adapter's bytes
    # and the adapter memory (the slot pool) count both; the host entry keeps no second copy.
    from loraserve import LLM

    _, _, paths, _ = untied
    llm = LLM(str(tiny_model_dir), lora_paths={"p": paths["plain"]})
    pool = llm.engine.slot_pool
    before = pool.nbytes
    copies = 2 * 512 * 64 * 4
    w = llm.engine.read_adapter(paths["saved-copies"])
    assert w.nbytes >= copies
    llm.load_lora_adapter("s", paths["saved-copies"])
    llm.generate([[5, 6]], SamplingParams(max_tokens=1), lora=["s"])
    assert pool.nbytes >= before + copies
    entry = llm.engine.store.entries[llm.engine.store.names["s"]]
    assert entry.weights.vocab is None and entry.weights.nbytes == w.nbytes
    llm.unload_lora_adapter("s")
    llm.generate([[5, 6]], SamplingParams(max_tokens=1))
    assert pool.nbytes == before


@pytest.mark.slow
def test_bundled_kinds_equal_peft(bundled_model_dir, tmp_path):
    # SmolLM2-135M-Instruct (tied embeddings, 49152 tokens): DoRA, LoRA on embed_tokens and
    # lm_head, and trainable tokens, with base rows, in one batch.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bundled_model_dir))
    texts = {"dora": ["The capital of France is", "def add(a, b):\n    return"],
             "vocab": ["Water boils at", "SELECT * FROM users WHERE"],
             "tokens": ["The quick brown fox", "My favourite colour is"],
             None: ["The sun rises in the", "Dear team, thank you for"]}
    prompts = {g: [tok.encode(t) for t in ts] for g, ts in texts.items()}
    specs = {"dora": dict(r=8, lora_alpha=16, target_modules=LORA_MODULES, use_dora=True,
                          seed=51, init_scale=0.5),
             "vocab": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head",
                                                               "q_proj"], seed=52),
             "tokens": dict(r=4, lora_alpha=8, target_modules=["v_proj"], seed=53,
                            trainable_token_indices=sorted({p[1] for p in prompts["tokens"]}))}
    paths, refs = build_references(bundled_model_dir, tmp_path, specs, prompts, 4)
    outs, trace, _ = run_mixed(bundled_model_dir, paths, prompts, 4, kv_cache_tokens=1024,
                               max_num_batched_tokens=8)
    assert max(trace.distinct) == len(prompts) and trace.chunks > 0
    assert {k: o.token_ids for k, o in outs.items()} == refs

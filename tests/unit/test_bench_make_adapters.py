"""Synthetic PEFT adapters: files, config, shapes, and (if peft is there) a real PEFT load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from loraserve.bench.make_adapters import ALL_MODULES, main, make_synthetic_adapters

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}


@pytest.fixture()
def model_dir(tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    return d


def test_files_config_and_shapes(model_dir, tmp_path):
    paths = make_synthetic_adapters(model_dir, tmp_path / "out", 5, seed=1)
    assert [p.name for p in paths] == [f"lora{i}" for i in range(5)]
    for i, p in enumerate(paths):
        conf = json.loads((p / "adapter_config.json").read_text())
        r = (8, 16, 32, 64)[i % 4]
        assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM"
        assert conf["r"] == r and conf["lora_alpha"] == 2 * r
        assert sorted(conf["target_modules"]) == sorted(ALL_MODULES)
        assert conf["base_model_name_or_path"] == str(model_dir.resolve())
        t = load_file(p / "adapter_model.safetensors")
        assert len(t) == 2 * 2 * 7  # layers x modules x {A, B}
        pre = "base_model.model.model.layers.1"
        # q: 64 -> 4*16, k/v: 64 -> 2*16, o: 64 -> 64, gate/up: 64 -> 96, down: 96 -> 64
        for key, d_in, d_out in [("self_attn.q_proj", 64, 64), ("self_attn.k_proj", 64, 32),
                                 ("self_attn.v_proj", 64, 32), ("self_attn.o_proj", 64, 64),
                                 ("mlp.gate_proj", 64, 96), ("mlp.up_proj", 64, 96),
                                 ("mlp.down_proj", 96, 64)]:
            assert t[f"{pre}.{key}.lora_A.weight"].shape == (r, d_in)
            assert t[f"{pre}.{key}.lora_B.weight"].shape == (d_out, r)
            assert t[f"{pre}.{key}.lora_B.weight"].abs().max() > 0  # not a no-op adapter
    # different adapters get different weights; same seed reproduces them
    k = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    a0 = load_file(paths[0] / "adapter_model.safetensors")[k]
    a4 = load_file(paths[4] / "adapter_model.safetensors")[k]
    assert a0.shape == a4.shape and not torch.equal(a0, a4)
    again = make_synthetic_adapters(model_dir, tmp_path / "again", 1, seed=1)[0]
    assert torch.equal(load_file(again / "adapter_model.safetensors")[k], a0)


def test_head_dim_ranks_modules_and_cli(model_dir, tmp_path):
    cfg = dict(TINY, head_dim=8)  # explicit head_dim != hidden/heads
    p = make_synthetic_adapters(cfg, tmp_path / "hd", 1, ranks=[4],
                                target_modules=["q_proj", "down_proj"], dtype="bfloat16")[0]
    t = load_file(p / "adapter_model.safetensors")
    assert set(k.split(".")[-3] for k in t) == {"q_proj", "down_proj"}
    q_b = t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert q_b.shape == (32, 4) and q_b.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        make_synthetic_adapters(cfg, tmp_path / "bad", 1, target_modules=["embed"])
    out = main(["--model-dir", str(model_dir), "--out", str(tmp_path / "cli"), "--num", "3",
                "--ranks", "2,4"])
    assert [json.loads((q / "adapter_config.json").read_text())["r"] for q in out] == [2, 4, 2]


def test_peft_loads_them(model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.save_pretrained(model_dir)
    path = make_synthetic_adapters(model_dir, tmp_path / "out", 2, ranks=[8], seed=2)[1]
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        base_logits = model(ids).logits
    pm = peft.PeftModel.from_pretrained(model, str(path)).eval()
    # every tensor we wrote landed in the model, and nothing the model expects is missing
    ours = load_file(path / "adapter_model.safetensors")
    loaded = peft.get_peft_model_state_dict(pm)
    assert set(loaded) == set(ours)
    assert all(torch.equal(loaded[k], ours[k]) for k in ours)
    with torch.no_grad():
        lora_logits = pm(ids).logits
    assert torch.isfinite(lora_logits).all()
    assert not torch.allclose(lora_logits, base_logits)  # the adapter does something...
    rel = (lora_logits - base_logits).norm() / base_logits.norm()
    assert rel < 1.0  # ...but stays a perturbation


@pytest.mark.parametrize("model_type, fields", [
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_mixture_of_experts_adapters_load(model_type, fields, tmp_path):
    # attention, the shared expert where there is one, and every expert by target_parameters
    from transformers import AutoConfig

    from loraserve.adapters.format import read_adapter
    from loraserve.model.families import model_config_from_hf

    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=40,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=64, **fields).to_dict()
    mc = model_config_from_hf(cfg)
    (path,) = make_synthetic_adapters(cfg, tmp_path, 1, ranks=[4])
    conf = json.loads((path / "adapter_config.json").read_text())
    assert conf["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"]
    w = read_adapter(path, mc, max_lora_rank=8)
    assert all(e is not None and set(e.parts) == {"gate_up", "down"} for e in w.experts)
    shared = {"gate_proj", "up_proj", "down_proj"} if mc.shared_expert else set()
    assert w.target_modules == {"q_proj", "k_proj", "v_proj", "o_proj"} | shared

"""What of mixture-of-experts configs and adapters is not computed exactly is refused, named
in one line: dense layers between expert layers, gpt-oss, OLMoE's qkv clipping, LoRA on the
router, expert tensors the config does not target, target_parameters on a dense model, and
the PEFT options its ParamWrapper refuses too."""

from __future__ import annotations

import pytest
import torch
from adapter_factory import edit_config, edit_tensors, make_peft_adapter
from model_factory import make_tiny_family

from loraserve.adapters.format import read_adapter
from loraserve.model.families import model_config_from_hf, read_model_config
from loraserve.types import AdapterFormatError

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)


def _hf(model_type: str, **fields) -> dict:
    from transformers import AutoConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    return AutoConfig.for_model(model_type, **{**base, **fields}).to_dict()


@pytest.mark.parametrize("model_type, fields, named", [
    ("qwen2_moe", dict(MOE, mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen2_moe", dict(MOE, decoder_sparse_step=2), "decoder_sparse_step"),
    ("olmoe", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=8.0), "clip_qkv"),
    ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2), "attention sinks"),
])
def test_moe_configs_not_computed_exactly_are_refused(model_type, fields, named):
    with pytest.raises(ValueError, match=named):
        model_config_from_hf(_hf(model_type, **fields))


def test_moe_config_fields_read_as_transformers_does():
    c = model_config_from_hf(_hf("qwen2_moe", **MOE))
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (4, 2, 16)
    assert c.shared_expert and c.intermediate_size == 24 and not c.norm_topk_prob
    m = model_config_from_hf(_hf("mixtral", num_local_experts=4, num_experts_per_tok=2))
    assert m.norm_topk_prob and not m.shared_expert and not m.dense_mlp


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return make_tiny_family(tmp_path_factory.mktemp("q2moe"), "qwen2_moe", hidden_size=32,
                            num_attention_heads=4, **MOE)


def _read(path, base_dir):
    return read_adapter(path, read_model_config(base_dir), max_lora_rank=16)


@pytest.mark.parametrize("config, named", [
    (dict(target_parameters=["mlp.gate.weight"]), "not an expert weight"),
    (dict(target_parameters=["shared_expert_gate.weight"]), "not an expert weight"),
    (dict(target_modules="all-linear"), "all-linear"),
    (dict(target_modules=["shared_expert_gate"]), "shared_expert_gate"),
])
def test_moe_adapter_targets_we_cannot_serve_are_refused(config, named, qwen2_moe, tmp_path):
    a = make_peft_adapter(qwen2_moe, tmp_path / "a", target_modules=["q_proj"],
                          target_parameters=["experts.down_proj"])
    edit_config(a, **config)
    with pytest.raises(AdapterFormatError, match=named):
        _read(a, qwen2_moe)


def test_dora_with_target_parameters_is_refused(qwen2_moe, tmp_path):
    a = make_peft_adapter(qwen2_moe, tmp_path / "a", target_modules=["q_proj"],
                          target_parameters=["experts.down_proj"])
    edit_config(a, use_dora=True)
    with pytest.raises(AdapterFormatError, match="use_dora with target_parameters"):
        _read(a, qwen2_moe)


@pytest.mark.parametrize("module, named", [
    ("mlp.experts.3.gate_proj", "does not target it"),  # config targets q_proj only
    ("mlp.experts.9.gate_proj", "does not target it"),  # 4 experts
    ("block_sparse_moe.experts.3.w1", "expert module this model does not have"),
])
def test_per_expert_tensors_we_cannot_place_are_refused(module, named, qwen2_moe, tmp_path):
    a = make_peft_adapter(qwen2_moe, tmp_path / "a", target_modules=["q_proj"])

    def add_expert(t: dict) -> None:  # transformers v4's per-expert nn.Linear naming
        pre = f"base_model.model.model.layers.0.{module}"
        t[f"{pre}.lora_A.weight"] = torch.zeros(8, 32)
        t[f"{pre}.lora_B.weight"] = torch.zeros(16, 8)

    edit_tensors(a, add_expert)
    with pytest.raises(AdapterFormatError, match=named):
        _read(a, qwen2_moe)


def test_both_expert_forms_in_one_layer_are_refused(qwen2_moe, tmp_path):
    a = make_peft_adapter(qwen2_moe, tmp_path / "a", target_modules=["q_proj"],
                          target_parameters=["experts.down_proj"])
    edit_config(a, target_modules=["q_proj", "gate_proj"])

    def add_expert(t: dict) -> None:
        pre = "base_model.model.model.layers.0.mlp.experts.1.gate_proj"
        t[f"{pre}.lora_A.weight"] = torch.zeros(8, 32)
        t[f"{pre}.lora_B.weight"] = torch.zeros(16, 8)

    edit_tensors(a, add_expert)
    with pytest.raises(AdapterFormatError, match="both per expert module and through"):
        _read(a, qwen2_moe)


def test_target_parameters_on_a_dense_model_is_refused(tmp_path):
    base = make_tiny_family(tmp_path / "llama", "llama")
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["q_proj"])
    edit_config(a, target_parameters=["mlp.down_proj.weight"])
    with pytest.raises(AdapterFormatError, match="mixture-of-experts"):
        _read(a, base)


def test_expert_tensors_of_the_wrong_shape_are_refused(qwen2_moe, tmp_path):
    a = make_peft_adapter(qwen2_moe, tmp_path / "a", target_modules=["q_proj"],
                          target_parameters=["experts.down_proj"])
    edit_config(a, r=4)  # the tensors hold 4 experts x rank 8
    with pytest.raises(AdapterFormatError, match="has shape"):
        _read(a, qwen2_moe)

"""PEFT adapter reading, plain LoRA's refusals: a missing path, config or weights file; a config
that is not LoRA or not one we read (the rank, alpha, target modules, layers, bias, variant
flags); tensors that disagree with the config or the model (shapes, A/B ranks, layers out of
range, unexpected keys); NaN or inf, truncated or garbage weights. Each refusal names the
adapter's path and what is wrong. The round trips against real peft: test_adapter_format.py."""

from __future__ import annotations

import json

import pytest
import test_adapter_format as plain_lora
import torch
from adapter_factory import edit_config, edit_tensors, lora_key, truncate_weights

# the same tiny model and adapters as the round trips (pytest fixtures, shared)
base_dir, mc, good_dir, bad = (plain_lora.base_dir, plain_lora.mc, plain_lora.good_dir,
                               plain_lora.bad)
refuse = plain_lora.refuse


def test_refuse_missing_path_and_file(tmp_path, mc):
    refuse(tmp_path / "nope", mc, "does not exist")
    (tmp_path / "f").write_text("x")
    refuse(tmp_path / "f", mc, "not a directory")


def test_refuse_missing_config(bad, mc):
    (bad / "adapter_config.json").unlink()
    refuse(bad, mc, "missing adapter_config.json")


def test_refuse_missing_weights(bad, mc):
    (bad / "adapter_model.safetensors").unlink()
    refuse(bad, mc, "missing weights")


def test_refuse_invalid_json(bad, mc):
    (bad / "adapter_config.json").write_text('{"r": 8,')
    refuse(bad, mc, "invalid JSON")


@pytest.mark.parametrize("peft_type", ["PREFIX_TUNING", "IA3", ...])
def test_refuse_non_lora(bad, mc, peft_type):
    edit_config(bad, peft_type=peft_type)
    refuse(bad, mc, "peft_type", "only LORA")


def test_refuse_rank_above_max(bad, mc):
    refuse(bad, mc, "rank 8", "max_lora_rank=4", max_lora_rank=4)


@pytest.mark.parametrize("r", [0, -8, 8.5, 8.0, "8", None, True])
def test_refuse_bad_r(bad, mc, r):
    edit_config(bad, r=r)
    refuse(bad, mc, "r must be a positive integer")


@pytest.mark.parametrize("alpha", ["16", None, [16], float("nan"), float("inf")])
def test_refuse_bad_alpha(bad, mc, alpha):
    edit_config(bad, lora_alpha=alpha)
    refuse(bad, mc, "lora_alpha must be a finite number")


@pytest.mark.parametrize("target", ["mlp.fc1", "self_attn", "norm"])
def test_refuse_unknown_target_module(bad, mc, target):
    edit_config(bad, target_modules=["q_proj", target])
    refuse(bad, mc, f"target module {target!r}")


def test_refuse_regex_matching_unsupported_module(bad, mc):
    edit_config(bad, target_modules=r".*(q_proj|norm)")
    refuse(bad, mc, "'model.norm'")


def test_refuse_regex_matching_nothing(bad, mc):
    edit_config(bad, target_modules=r".*\.fc1")
    refuse(bad, mc, "targets no module")


def test_refuse_shape_mismatch(bad, mc):
    key = lora_key(0, "q_proj", "lora_A")
    edit_tensors(bad, lambda t: t.update({key: torch.ones(8, 32)}))
    refuse(bad, mc, key, "[8, 32]", "expected [?, 64]")
    key = lora_key(1, "down_proj", "lora_B")
    edit_tensors(bad, lambda t: t.update({lora_key(0, "q_proj"): torch.ones(8, 64),
                                          key: torch.ones(128, 8)}))
    refuse(bad, mc, key, "[128, 8]", "expected [64, ?]")


def test_refuse_ab_rank_mismatch(bad, mc):
    edit_tensors(bad, lambda t: t.update({lora_key(0, "v_proj", "lora_B"): torch.ones(32, 4)}))
    refuse(bad, mc, "A/B rank mismatch", "model.layers.0.self_attn.v_proj")


def test_refuse_config_rank_disagrees_with_tensors(bad, mc):
    edit_config(bad, r=4)
    refuse(bad, mc, "rank 8 in its tensors but rank 4 in adapter_config")


def test_refuse_layer_out_of_range(bad, mc):
    edit_tensors(bad, lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()})
    refuse(bad, mc, "layer 7", "out of range")
    edit_config(bad, layers_to_transform=[0, 9])
    refuse(bad, mc, "layers_to_transform", "layer 9")


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_refuse_bias(bad, mc, bias):
    edit_config(bad, bias=bias)
    refuse(bad, mc, f"bias={bias!r}", "not supported yet")


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_refuse_non_finite(bad, mc, bad_value):
    key = lora_key(1, "down_proj", "lora_B")  # the last module read: nothing partial escapes

    def poison(t):
        t[key][3, 1] = bad_value

    edit_tensors(bad, poison)
    refuse(bad, mc, key, "NaN or inf")


def test_refuse_truncated_or_garbage_weights(bad, mc):
    truncate_weights(bad, 0.6)
    refuse(bad, mc, "corrupt or truncated")
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 7 + b"not a safetensors file")
    refuse(bad, mc, "corrupt or truncated")


def test_refuse_no_lora_tensors(bad, mc):
    edit_tensors(bad, lambda t: {})
    refuse(bad, mc, "no LoRA tensors")


def test_refuse_unexpected_and_untargeted_tensors(bad, mc):
    edit_tensors(bad, lambda t: t.update({"base_model.model.model.norm.weight": torch.ones(64)}))
    refuse(bad, mc, "unexpected tensor", "model.norm.weight")
    edit_tensors(bad, lambda t: t.pop("base_model.model.model.norm.weight"))
    edit_config(bad, target_modules=["q_proj", "v_proj"])
    refuse(bad, mc, "adapter_config does not target it", "model.layers.0.")


def test_refuse_unsupported_variant_flags(bad, mc):
    edit_config(bad, use_qalora=True)
    refuse(bad, mc, "QALoRA", "not supported yet")


def test_config_file_is_json_object(bad, mc):
    (bad / "adapter_config.json").write_text(json.dumps([1, 2]))
    refuse(bad, mc, "JSON object")


"""PEFT adapter reading, the kinds beyond plain LoRA on the linears (DoRA, lora_bias, the
embedding and lm_head: LoRA there, modules_to_save, trainable tokens): what each refuses, by
name, and what a full copy costs. The round trips against real PEFT are in
tests/engine/test_adapter_kinds.py; plain LoRA's reading in test_adapter_format.py and
test_adapter_format_refusals.py."""

from __future__ import annotations

import pytest
import test_adapter_format as plain_lora
import torch
from adapter_factory import edit_config, edit_tensors, load_base_model, lora_key, make_peft_adapter

# the same tiny model and adapters as the plain LoRA tests (pytest fixtures, shared)
base_dir, mc, good_dir, bad = (plain_lora.base_dir, plain_lora.mc, plain_lora.good_dir,
                               plain_lora.bad)
read, refuse = plain_lora.read, plain_lora.refuse


def test_refuse_dora_without_the_base_weights_or_its_magnitude(base_dir, mc, tmp_path):
    make_peft_adapter(base_dir, tmp_path, use_dora=True)
    refuse(tmp_path, mc, "DoRA adapters need the base model's weights")
    edit_tensors(tmp_path, lambda t: {k: v for k, v in t.items() if "magnitude" not in k})
    refuse(tmp_path, mc, "use_dora", "has no magnitude vector")


def test_refuse_dora_on_the_embedding(base_dir, mc, tmp_path):
    make_peft_adapter(base_dir, tmp_path, use_dora=True,
                      target_modules=["q_proj", "embed_tokens"])
    refuse(tmp_path, mc, "DoRA on embed_tokens is not supported yet")


@pytest.mark.parametrize("module", ["score", "model.norm", "q_proj"])
def test_refuse_modules_to_save_other_than_the_vocabulary_ends(bad, mc, module):
    edit_config(bad, modules_to_save=[module])
    refuse(bad, mc, f"modules_to_save names {module!r}", "only embed_tokens and lm_head")


def test_refuse_adapters_that_change_the_vocabulary_size(base_dir, mc, tmp_path):
    make_peft_adapter(base_dir, tmp_path / "a", modules_to_save=["lm_head"])
    edit_tensors(tmp_path / "a", lambda t: t.update(
        {"base_model.model.lm_head.weight": torch.ones(130, 64)}))
    refuse(tmp_path / "a", mc, "spans 130 tokens", "vocabulary size are not supported")
    make_peft_adapter(base_dir, tmp_path / "b", trainable_token_indices=[3, 127])
    edit_config(tmp_path / "b", trainable_token_indices=[3, 128])
    refuse(tmp_path / "b", mc, "trainable_token_indices", "outside the model's vocabulary")
    make_peft_adapter(base_dir, tmp_path / "c", target_modules=["embed_tokens"])
    edit_tensors(tmp_path / "c", lambda t: t.update({
        "base_model.model.model.embed_tokens.base_layer.weight": torch.ones(140, 64)}))
    refuse(tmp_path / "c", mc, "spans 140 tokens")


@pytest.mark.parametrize("kind", [
    dict(trainable_token_indices=[5, 7]), dict(modules_to_save=["embed_tokens", "lm_head"]),
    dict(target_modules=["q_proj", "embed_tokens"])])
def test_refuse_adapters_peft_saved_from_a_resized_vocabulary(base_dir, mc, tmp_path, kind):
    import peft

    model = load_base_model(base_dir)
    model.resize_token_embeddings(136, mean_resizing=False)
    config = peft.LoraConfig(r=4, **{"target_modules": ["q_proj"], **kind})
    peft.get_peft_model(model, config).save_pretrained(tmp_path)
    refuse(tmp_path, mc, "spans 136 tokens", "vocabulary size are not supported")


def test_full_copies_count_in_the_adapters_memory(base_dir, mc, tmp_path):
    plain = read(make_peft_adapter(base_dir, tmp_path / "a"), mc)
    saved = read(make_peft_adapter(base_dir, tmp_path / "b",
                                   modules_to_save=["lm_head", "embed_tokens"]), mc)
    assert saved.nbytes == plain.nbytes + 2 * 128 * 64 * 4
    assert saved.vocab.head_table.shape == saved.vocab.embed_table.shape == (128, 64)


def test_refuse_lora_bias_tensor_the_config_does_not_declare(bad, mc):
    key = lora_key(0, "q_proj", "lora_B").replace(".weight", ".bias")
    edit_tensors(bad, lambda t: t.update({key: torch.zeros(64)}))
    refuse(bad, mc, "has a lora_B bias but adapter_config has no lora_bias")
    edit_tensors(bad, lambda t: t.pop(key))
    edit_config(bad, lora_bias=True)
    refuse(bad, mc, "adapter_config sets lora_bias but", "has no lora_B bias")


def test_refuse_lora_embedding_keys_the_config_does_not_declare(bad, mc):
    key = "base_model.model.model.embed_tokens.lora_embedding_A"
    edit_tensors(bad, lambda t: t.update({key: torch.zeros(8, 128)}))
    refuse(bad, mc, key, "is not what adapter_config declares for embed_tokens")


def test_refuse_magnitude_vector_keys_the_config_does_not_declare(bad, mc):
    key = lora_key(0, "q_proj", "lora_A").replace("lora_A.weight", "lora_magnitude_vector")
    edit_tensors(bad, lambda t: t.update({key: torch.ones(64)}))
    refuse(bad, mc, "has a DoRA magnitude but adapter_config has no use_dora")


def test_refuse_lm_head_tensors_the_config_does_not_declare(bad, mc):
    edit_tensors(bad, lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": torch.ones(8, 64),
        "base_model.model.lm_head.lora_B.weight": torch.ones(128, 8)}))
    refuse(bad, mc, "of lm_head) is not what adapter_config declares for lm_head")
    edit_tensors(bad, lambda t: {k: v for k, v in t.items() if "lm_head" not in k})
    edit_tensors(bad, lambda t: t.update({"base_model.model.lm_head.weight": torch.ones(128, 64)}))
    refuse(bad, mc, "lm_head.weight", "is not what adapter_config declares for lm_head")

"""An adapter's files are checked before they are parsed (adapters/peft/files.py): the weights
file's size and header before its tensors are read, and the identity covers the config too."""

from __future__ import annotations

import json
import shutil

import pytest
from adapter_factory import build_peft_model

from loraserve.adapters.format import read_adapter
from loraserve.config import ModelConfig
from loraserve.types import AdapterFormatError


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def mc(tiny_model_dir):
    return ModelConfig.from_dir(tiny_model_dir)


def read(path, mc):
    return read_adapter(path, mc, max_lora_rank=64)


def test_weights_file_checked_before_it_is_read(base_dir, mc, tmp_path):
    pm = build_peft_model(base_dir, r=4, target_modules=["q_proj"], seed=8)
    pm.save_pretrained(tmp_path / "ok")
    huge = shutil.copytree(tmp_path / "ok", tmp_path / "huge")
    with open(huge / "adapter_model.safetensors", "r+b") as f:
        f.truncate(512 << 20)  # sparse: costs no disk, and must cost no memory either
    with pytest.raises(AdapterFormatError, match="more than an adapter of this model"):
        read(huge, mc)
    lying = shutil.copytree(tmp_path / "ok", tmp_path / "lying")
    data = (lying / "adapter_model.safetensors").read_bytes()
    (lying / "adapter_model.safetensors").write_bytes(data + b"\0" * 64)  # trailing bytes
    with pytest.raises(AdapterFormatError, match="header describes"):
        read(lying, mc)
    bad_len = shutil.copytree(tmp_path / "ok", tmp_path / "bad_len")
    (bad_len / "adapter_model.safetensors").write_bytes((10**9).to_bytes(8, "little") + data)
    with pytest.raises(AdapterFormatError, match="bad header length"):
        read(bad_len, mc)


def test_config_is_part_of_the_identity(base_dir, mc, tmp_path):
    pm = build_peft_model(base_dir, r=4, lora_alpha=8, target_modules=["q_proj"], seed=8)
    pm.save_pretrained(tmp_path / "a")
    b = shutil.copytree(tmp_path / "a", tmp_path / "b")
    cfg = json.loads((b / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 32  # same weights file, another scale: another adapter
    (b / "adapter_config.json").write_text(json.dumps(cfg))
    assert read(tmp_path / "a", mc).fingerprint != read(b, mc).fingerprint

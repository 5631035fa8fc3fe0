"""PEFT adapter reading: round trips against real peft and pattern semantics, and the tiny model,
adapters and helpers the other adapter-format tests import from here. Plain LoRA's refusals:
test_adapter_format_refusals.py."""

from __future__ import annotations

import hashlib
import math
import shutil

import pytest
import torch
from adapter_factory import (
    build_peft_model,
    edit_config,
    edit_tensors,
    load_base_model,
    make_peft_adapter,
    peft_deltas,
    to_pickle,
)

from loraserve.adapters.format import read_adapter, read_adapter_config
from loraserve.config import LORA_MODULES, ModelConfig
from loraserve.types import AdapterFormatError

ALL = list(LORA_MODULES)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mc(base_dir):
    return ModelConfig.from_dir(base_dir)


@pytest.fixture(scope="module")
def good_dir(base_dir, tmp_path_factory):
    return make_peft_adapter(base_dir, tmp_path_factory.mktemp("good"), target_modules=ALL)


@pytest.fixture
def bad(good_dir, tmp_path):
    """A private copy of a valid all-modules adapter (r=8) for a test to break."""
    return shutil.copytree(good_dir, tmp_path / "adapter")


def read(path, mc, **kw):
    kw.setdefault("max_lora_rank", 64)
    return read_adapter(path, mc, **kw)


def refuse(path, mc, *patterns, **kw):
    with pytest.raises(AdapterFormatError) as ei:
        read(path, mc, **kw)
    msg = str(ei.value)
    assert str(path) in msg, msg
    for p in patterns:
        assert p in msg, msg
    return msg


def assert_matches_peft(adapter, peft_model, mc):
    deltas = peft_deltas(peft_model)
    seen = set()
    for i, layer in enumerate(adapter.layers):
        for module, w in layer.items():
            name = f"model.layers.{i}.{'self_attn' if module in ALL[:4] else 'mlp'}.{module}"
            delta, r, scaling = deltas[name]
            assert w.A.dtype == w.B.dtype == torch.float32
            assert w.A.is_contiguous() and w.B.is_contiguous()
            assert (w.rank, w.A.shape, w.B.shape) == (r, (r, mc.module_shape(module)[1]),
                                                     (mc.module_shape(module)[0], r))
            assert w.scale == pytest.approx(scaling, rel=1e-12)
            torch.testing.assert_close(w.B @ w.A, delta, rtol=1e-5, atol=1e-6)
            seen.add(name)
    assert seen == set(deltas)  # every module PEFT adapted, and nothing more


# --- round trips --------------------------------------------------------------------------


def test_roundtrip_all_modules(base_dir, mc, tmp_path):
    pm = build_peft_model(base_dir, r=8, lora_alpha=16, target_modules=ALL, seed=3)
    pm.save_pretrained(tmp_path)
    ad = read(tmp_path, mc)
    assert_matches_peft(ad, pm, mc)
    assert (ad.rank, ad.target_modules, len(ad.layers)) == (8, frozenset(ALL), 2)
    assert all(w.scale == 2.0 for layer in ad.layers for w in layer.values())
    raw = (tmp_path / "adapter_model.safetensors").read_bytes()
    config = hashlib.sha256((tmp_path / "adapter_config.json").read_bytes()).digest()
    assert ad.fingerprint == hashlib.sha256(config + raw).hexdigest()  # identity: both files
    assert ad.nbytes == sum(w.A.nbytes + w.B.nbytes for la in ad.layers for w in la.values())
    assert ad.path == str(tmp_path)


def test_factory_adapter_changes_greedy_output(base_dir):
    pm = build_peft_model(base_dir)  # defaults: q_proj, v_proj, r=8
    base = load_base_model(base_dir)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lb, la = base(ids).logits, pm(input_ids=ids).logits
    assert torch.isfinite(la).all() and la.abs().max() < 10 * lb.abs().max()
    assert (lb.argmax(-1) != la.argmax(-1)).float().mean() > 0.2


def test_rslora_scale(base_dir, mc, tmp_path):
    pm = build_peft_model(base_dir, r=16, lora_alpha=8, use_rslora=True)
    pm.save_pretrained(tmp_path)
    ad = read(tmp_path, mc)
    assert_matches_peft(ad, pm, mc)
    assert ad.layers[0]["q_proj"].scale == pytest.approx(8 / math.sqrt(16))


def test_rank_and_alpha_patterns_match_peft(base_dir, mc, tmp_path):
    rank_pattern = {"q_proj": 4, r"layers\.1\.mlp\..*_proj": 2, "model.layers.0.mlp.down_proj": 16}
    alpha_pattern = {"v_proj": 32, "self_attn.o_proj": 3.5, "layers.1.self_attn.q_proj": 1}
    pm = build_peft_model(base_dir, r=8, lora_alpha=16, target_modules=ALL,
                          rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    pm.save_pretrained(tmp_path)
    ad = read(tmp_path, mc)
    assert_matches_peft(ad, pm, mc)
    layers = pm.base_model.model.model.layers
    for i in range(2):
        for module in ALL:
            peft_mod = getattr(layers[i].self_attn if module in ALL[:4] else layers[i].mlp, module)
            ours = ad.layers[i][module]
            assert ours.rank == peft_mod.r["default"]
            assert ours.scale == pytest.approx(peft_mod.scaling["default"])
    # spot-check the intended semantics, not only agreement with peft
    assert [ad.layers[i]["q_proj"].rank for i in range(2)] == [4, 4]
    assert ad.layers[1]["q_proj"].scale == pytest.approx(1 / 4)
    assert ad.layers[1]["up_proj"].rank == 2 and ad.layers[0]["up_proj"].rank == 8
    assert ad.layers[0]["down_proj"].rank == 16 and ad.rank == 16
    assert ad.layers[0]["o_proj"].scale == pytest.approx(3.5 / 8)


def test_regex_target_modules(base_dir, mc, tmp_path):
    regex = r"model\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.up_proj)"
    pm = build_peft_model(base_dir, target_modules=regex)
    pm.save_pretrained(tmp_path)
    ad = read(tmp_path, mc)
    assert_matches_peft(ad, pm, mc)
    assert ad.layers[0] == {} and set(ad.layers[1]) == {"q_proj", "k_proj", "up_proj"}
    assert read_adapter_config(tmp_path)["target_modules"] == regex


def test_layers_to_transform(base_dir, mc, tmp_path):
    pm = build_peft_model(base_dir, target_modules=["q_proj", "down_proj"], layers_to_transform=[1])
    pm.save_pretrained(tmp_path)
    ad = read(tmp_path, mc)
    assert_matches_peft(ad, pm, mc)
    assert ad.layers[0] == {} and set(ad.layers[1]) == {"q_proj", "down_proj"}
    assert ad.target_modules == frozenset({"q_proj", "down_proj"})


def test_exclude_modules_and_layers_pattern(base_dir, mc, tmp_path):
    pm = build_peft_model(base_dir, target_modules=ALL, exclude_modules=["layers.0.mlp.up_proj",
                          "k_proj"], layers_to_transform=0, layers_pattern="layers")
    pm.save_pretrained(tmp_path)
    ad = read(tmp_path, mc)
    assert_matches_peft(ad, pm, mc)
    assert ad.layers[1] == {} and set(ad.layers[0]) == set(ALL) - {"up_proj", "k_proj"}


def test_half_precision_file_is_read_as_float32(bad, mc):
    ref = read(bad, mc)
    edit_tensors(bad, lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    ad = read(bad, mc)
    w, r = ad.layers[1]["up_proj"], ref.layers[1]["up_proj"]
    assert w.A.dtype == torch.float32
    torch.testing.assert_close(w.B @ w.A, r.B @ r.A, rtol=0.05, atol=1e-3)
    assert ad.fingerprint != ref.fingerprint


def test_keys_with_adapter_name(bad, mc):
    ref = read(bad, mc)
    edit_tensors(bad, lambda t: {k.replace(".weight", ".default.weight"): v for k, v in t.items()})
    ad = read(bad, mc)
    assert torch.equal(ad.layers[0]["k_proj"].B, ref.layers[0]["k_proj"].B)


def test_pickle_only_when_allowed(bad, mc):
    ref = read(bad, mc)
    to_pickle(bad)
    with pytest.raises(AdapterFormatError, match="pickle"):
        read(bad, mc)
    ad = read(bad, mc, allow_pickle=True)
    assert torch.equal(ad.layers[1]["v_proj"].A, ref.layers[1]["v_proj"].A)


def test_pickle_with_code_is_refused_even_when_allowed(bad, mc):
    import pickle

    (bad / "adapter_model.safetensors").unlink()
    (bad / "adapter_model.bin").write_bytes(pickle.dumps({"x": shutil.copytree}))
    refuse(bad, mc, "cannot read adapter_model.bin", allow_pickle=True)


def test_all_linear_shorthand(bad, mc):
    edit_config(bad, target_modules="all-linear")
    assert read(bad, mc).target_modules == frozenset(ALL)


def test_read_adapter_config_is_cheap_and_validates(bad, mc):
    cfg = read_adapter_config(bad)
    assert cfg["r"] == 8 and cfg["peft_type"] == "LORA"
    with pytest.raises(AdapterFormatError, match="max_lora_rank=4"):
        read_adapter_config(bad, mc, max_lora_rank=4)

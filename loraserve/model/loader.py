"""Load a Hugging Face Llama-family checkpoint (config.json + safetensors, sharded too)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loraserve.config import ModelConfig
from loraserve.model.linear import Linear
from loraserve.model.llama import LayerWeights, LlamaModel


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                tensors[key] = st.get_tensor(key).to(torch.float32)
    return tensors


def load_model(path: str | Path) -> LlamaModel:
    path = Path(path)
    config = ModelConfig.from_dir(path)
    sd = read_state_dict(path)

    def take(name: str) -> torch.Tensor:
        try:
            return sd.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint {path} lacks tensor {name!r}") from None

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = torch.cat([take(a + f"{n}.weight") for n in ("q_proj", "k_proj", "v_proj")])
        gate_up = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight").contiguous(),
                qkv=Linear(qkv),
                o=Linear(take(a + "o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight").contiguous(),
                gate_up=Linear(gate_up),
                down=Linear(take(m + "down_proj.weight")),
            )
        )
    embed = take("model.embed_tokens.weight").contiguous()
    if config.tie_word_embeddings or "lm_head.weight" not in sd:
        lm_head = Linear(embed)  # its own packed copy: embedding rows vs GEMM layout
        sd.pop("lm_head.weight", None)
    else:
        lm_head = Linear(take("lm_head.weight"))
    final_norm = take("model.norm.weight").contiguous()
    leftovers = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"checkpoint {path} has tensors this model does not use: {leftovers[:5]}")
    return LlamaModel(config, embed, layers, final_norm, lm_head)

"""Load a Hugging Face checkpoint of a supported family (config.json + safetensors, sharded
too); model/families.py decides whether and how it is computed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loraserve.model.families import read_model_config
from loraserve.model.linear import BiasedLinear, Linear
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


def read_state_dict(path: Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                tensors[key] = st.get_tensor(key).to(device=device, dtype=dtype)
    return tensors


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LlamaModel:
    path = Path(path)
    config = read_model_config(path)  # refuses what we do not compute exactly, before reading
    sd = read_state_dict(path, dtype, device)

    def take(name: str) -> torch.Tensor:
        try:
            return sd.pop(name)
        except KeyError:
            raise ValueError(f"checkpoint {path} lacks tensor {name!r}") from None

    def linear(names: list[str], bias: bool) -> Linear:
        """The fused projection of `names` (prefixes of .weight/.bias), stacked on d_out."""
        weight = torch.cat([take(n + ".weight") for n in names])
        if not bias:
            return Linear(weight)
        return BiasedLinear(weight, torch.cat([take(n + ".bias") for n in names]))

    c = config
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qk_norm = None
        if c.qk_norm:  # one weight row per head: q heads first, then kv heads (see llama.py)
            qk_norm = torch.cat([take(a + "q_norm.weight").expand(c.num_attention_heads, -1),
                                 take(a + "k_norm.weight").expand(c.num_key_value_heads, -1)])
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight").contiguous(),
                qkv=linear([a + n for n in ("q_proj", "k_proj", "v_proj")], c.qkv_bias),
                o=linear([a + "o_proj"], c.o_bias),
                post_norm=take(p + "post_attention_layernorm.weight").contiguous(),
                gate_up=linear([m + "gate_proj", m + "up_proj"], c.mlp_bias),
                down=linear([m + "down_proj"], c.mlp_bias),
                qk_norm=qk_norm,
                rope=i not in c.nope_layers,
            )
        )
    embed = take("model.embed_tokens.weight").contiguous()
    if c.tie_word_embeddings or "lm_head.weight" not in sd:
        lm_head = Linear(embed)  # its own packed copy: embedding rows vs GEMM layout
        sd.pop("lm_head.weight", None)
    else:
        lm_head = Linear(take("lm_head.weight"))
    final_norm = take("model.norm.weight").contiguous()
    leftovers = [k for k in sd if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ValueError(f"checkpoint {path} has tensors this model does not use: {leftovers[:5]}")
    return LlamaModel(config, embed, layers, final_norm, lm_head)

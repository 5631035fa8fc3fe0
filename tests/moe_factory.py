"""Test helper: tiny mixture-of-experts families, and adapters in transformers v4's form (one
LoRA per expert module, as PEFT saved them when each expert was an nn.Linear) with the model
that computes them exactly: the same checkpoint with every delta merged into its weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from adapter_factory import load_base_model

# name -> (model_type, config fields): 8 experts, top 2, random routers
MOE_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True,
                                    head_dim=32)),
    "olmoe": ("olmoe", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=32)),
}


def per_expert_adapter(base_dir: Path, out: Path, *, r: int = 2, alpha: float = 4.0,
                       seed: int = 0, experts: list[int] | None = None):
    """Write a v4-form adapter on every layer's experts (`experts`: which; all by default) and
    Qwen2-MoE's shared expert; return the HF model with those deltas merged."""
    from safetensors.torch import save_file

    model = load_base_model(base_dir)
    c = model.config
    num = getattr(c, "num_experts", None) or c.num_local_experts
    hidden = c.hidden_size
    inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    mixtral = c.model_type == "mixtral"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if mixtral else "mlp"
    g = torch.Generator().manual_seed(seed)
    scale = alpha / r
    tensors = {}

    def lora(prefix: str, d_in: int, d_out: int) -> torch.Tensor:
        a = torch.randn(r, d_in, generator=g) / d_in**0.5
        b = torch.randn(d_out, r, generator=g) * 0.8 / r**0.5
        tensors[f"base_model.model.{prefix}.lora_A.weight"] = a
        tensors[f"base_model.model.{prefix}.lora_B.weight"] = b
        return scale * b @ a

    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for e in experts if experts is not None else range(num):
                pre = f"model.layers.{li}.{block}.experts.{e}"
                gate, up = (lora(f"{pre}.{n}", hidden, inter) for n in names[:2])
                ex.gate_up_proj[e] += torch.cat([gate, up])
                ex.down_proj[e] += lora(f"{pre}.{names[2]}", inter, hidden)
            if c.model_type == "qwen2_moe":
                se, s = layer.mlp.shared_expert, c.shared_expert_intermediate_size
                for n in names:
                    d_in, d_out = (s, hidden) if n == "down_proj" else (hidden, s)
                    getattr(se, n).weight += lora(f"model.layers.{li}.mlp.shared_expert.{n}",
                                                  d_in, d_out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=r, lora_alpha=alpha, target_modules=list(names),
        lora_dropout=0.0, task_type="CAUSAL_LM", base_model_name_or_path=str(base_dir))))
    return model.eval()

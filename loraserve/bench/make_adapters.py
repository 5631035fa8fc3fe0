"""Synthetic LoRA adapters in PEFT format, written with safetensors + json only (no peft).

Shapes come from the base model's config.json. B is non-zero (unlike PEFT's init) so each
adapter really changes the outputs, but small: the update is about `init_scale` times the
input's RMS, a mild perturbation that keeps generations sane.

On a mixture-of-experts model, gate/up/down are Qwen2-MoE's shared expert (other MoE
families have no such modules), and `experts.gate_up_proj` / `experts.down_proj` put LoRA on
every expert as PEFT's target_parameters saves it (one ParamWrapper each, nested in that
order: A [E * r, d_in], B [d_out, E * r]); those two are the default targets there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")  # PEFT's nesting order
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_config(model_dir_or_config: str | Path | dict) -> dict:
    """A config dict, a config.json path, or a model directory holding config.json."""
    if isinstance(model_dir_or_config, dict):
        return model_dir_or_config
    path = Path(model_dir_or_config)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text())


def num_experts(cfg: dict) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def default_targets(cfg: dict) -> tuple[str, ...]:
    """Every linear of a dense model; attention and the experts of a mixture of experts."""
    if not num_experts(cfg):
        return ALL_MODULES
    shared = ALL_MODULES[4:] if cfg.get("shared_expert_intermediate_size") else ()
    return ALL_MODULES[:4] + shared + EXPERT_PARAMS


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each Llama-family linear layer (gate/up/down: the shared expert of a
    Qwen2-MoE), and of one expert's fused weights on a mixture of experts."""
    hidden = cfg["hidden_size"]
    inter = cfg.get("shared_expert_intermediate_size") or cfg["intermediate_size"]
    expert_inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
        "experts.gate_up_proj": (hidden, 2 * expert_inter),
        "experts.down_proj": (expert_inter, hidden),
    }


def peft_key(layer: int, module: str, ab: str, cfg: dict | None = None,
             targets: Sequence[str] = ()) -> str:
    pre = f"base_model.model.model.layers.{layer}"
    if module in EXPERT_PARAMS:  # the first targeted is wrapped innermost
        nested = [p for p in EXPERT_PARAMS if p in targets][::-1]
        return f"{pre}.mlp.experts.{'base_layer.' * nested.index(module)}lora_{ab}.weight"
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    if block == "mlp" and cfg is not None and num_experts(cfg):
        block = "mlp.shared_expert"
    return f"{pre}.{block}.{module}.lora_{ab}.weight"


def make_adapter_tensors(
    cfg: dict, rank: int, target_modules: Sequence[str], alpha: float, seed: int,
    init_scale: float = 0.05, dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    scaling = alpha / rank
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in target_modules:
            d_in, d_out = shapes[m]
            r = rank * (num_experts(cfg) if m in EXPERT_PARAMS else 1)  # every expert's
            # std(A) = 1/sqrt(d_in), std(B) = s/(scaling*sqrt(r)) => |scaling*B@A@x| ~ s*rms(x)
            a = torch.randn(r, d_in, generator=gen) / d_in**0.5
            b = torch.randn(d_out, r, generator=gen) * (init_scale / (scaling * rank**0.5))
            key = peft_key(layer, m, "A", cfg, target_modules)
            tensors[key] = a.to(dtype).contiguous()  # [r, d_in]
            tensors[key[:-len("A.weight")] + "B.weight"] = b.to(dtype).contiguous()
    return tensors


def adapter_config(base: str, rank: int, alpha: float, target_modules: Sequence[str]) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(m for m in target_modules if m not in EXPERT_PARAMS),
        "target_parameters": [m for m in EXPERT_PARAMS if m in target_modules] or None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def make_synthetic_adapters(
    model_dir_or_config: str | Path | dict,
    out_dir: str | Path,
    n: int,
    ranks: Sequence[int] = (8, 16, 32, 64),
    target_modules: Sequence[str] | None = None,
    seed: int = 0,
    prefix: str = "lora",
    alpha_over_rank: float = 2.0,
    init_scale: float = 0.05,
    dtype: str = "float32",
) -> list[Path]:
    """Write n adapters as out_dir/{prefix}{i}; ranks cycle through `ranks`; targets default
    to `default_targets`.

    The names match `loraserve bench --adapter-prefix lora --num-adapters n`.
    """
    cfg = read_model_config(model_dir_or_config)
    target_modules = tuple(target_modules or default_targets(cfg))
    known = default_targets(cfg) if num_experts(cfg) else ALL_MODULES
    unknown = set(target_modules) - set(known)
    if unknown:
        raise ValueError(f"unknown target modules {sorted(unknown)}; known: {known}")
    base = (str(Path(model_dir_or_config).resolve())
            if not isinstance(model_dir_or_config, dict) else cfg.get("_name_or_path", ""))
    out_dir = Path(out_dir)
    paths = []
    for i in range(n):
        rank = int(ranks[i % len(ranks)])
        alpha = alpha_over_rank * rank
        path = out_dir / f"{prefix}{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = make_adapter_tensors(cfg, rank, target_modules, alpha, seed * 100003 + i,
                                       init_scale, _DTYPES[dtype])
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        conf = adapter_config(base, rank, alpha, target_modules)
        (path / "adapter_config.json").write_text(json.dumps(conf, indent=2))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(prog="python -m loraserve.bench.make_adapters",
                                description="Write synthetic PEFT LoRA adapters for a base model")
    p.add_argument("--model-dir", default=None,
                   help="base model dir (or its config.json); default: the bundled "
                        "SmolLM2-135M-Instruct (converted once into the cache)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--num", type=int, default=32)
    p.add_argument("--ranks", default="8,16,32,64", help="comma-separated, cycled")
    p.add_argument("--target-modules", default=None,
                   help="comma-separated (experts.gate_up_proj, experts.down_proj: every "
                        "expert of a mixture of experts); default: every linear, and on a "
                        "mixture of experts attention and the experts")
    p.add_argument("--prefix", default="lora")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-scale", type=float, default=0.05)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    a = p.parse_args(argv)
    if a.model_dir is None:
        from loraserve.model.bundled import default_model_dir

        a.model_dir = default_model_dir()
    paths = make_synthetic_adapters(
        a.model_dir, a.out, a.num, ranks=[int(r) for r in a.ranks.split(",")],
        target_modules=[m.strip() for m in (a.target_modules or "").split(",") if m.strip()],
        seed=a.seed, prefix=a.prefix, init_scale=a.init_scale, dtype=a.dtype,
    )
    print(f"wrote {len(paths)} adapters under {Path(a.out).resolve()}")
    return paths


if __name__ == "__main__":
    main()

"""Test helper: real PEFT LoRA adapters with random non-zero weights, and ways to break them.

PEFT initialises lora_B to zero (a no-op adapter), so we overwrite A and B with seeded random
values sized so that the adapter clearly changes a small model's greedy output without
blowing up: entries of B @ A have std ~ init_scale / sqrt(d_in), before the LoRA scale.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from model_factory import make_tiny_llama

_BASE_CACHE: dict[str, torch.nn.Module] = {}


def load_base_model(base_model_dir: str | Path) -> torch.nn.Module:
    """The HF model in float32, loaded once per directory per process; callers get a copy
    because get_peft_model mutates the model it wraps."""
    from transformers import AutoModelForCausalLM

    key = str(Path(base_model_dir).resolve())
    if key not in _BASE_CACHE:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        _BASE_CACHE[key] = model.eval()
    return copy.deepcopy(_BASE_CACHE[key])


def build_peft_model(
    base_model_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    use_rslora: bool = False,
    target_modules: Iterable[str] | str = ("q_proj", "v_proj"),
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    seed: int = 0,
    init_scale: float = 0.2,
    **lora_kwargs,
):
    """A PeftModel (adapter 'default') over a fresh copy of the base model, random A and B."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=use_rslora,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        **lora_kwargs,
    )
    model = get_peft_model(load_base_model(base_model_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Sorted names: the same seed gives the same weights whatever the module order.
        for _, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
            randomize_extra_parts(module, gen, init_scale)
            if not hasattr(module, "lora_A") or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            rank, d_in = a.shape
            a.copy_(torch.randn(a.shape, generator=gen) / d_in**0.5)
            b.copy_(torch.randn(b.shape, generator=gen) * init_scale / rank**0.5)
            if module.lora_B["default"].bias is not None:  # lora_bias (PEFT starts it at 0)
                bias = module.lora_B["default"].bias
                bias.copy_(torch.randn(bias.shape, generator=gen) * init_scale)
            mags = getattr(module, "lora_magnitude_vector", None)
            if mags is not None and "default" in mags:  # DoRA: PEFT starts it at ||W||_c
                m = mags["default"].weight
                m.mul_(1 + 0.5 * torch.rand(m.shape, generator=gen))
    return model.eval()


def randomize_extra_parts(module, gen: torch.Generator, init_scale: float) -> None:
    """Random values for what PEFT starts as a no-op beyond lora_A/B: embedding LoRA (B = 0),
    trainable tokens (the rows as they were) and modules_to_save copies (the module as it
    was)."""
    emb_a = getattr(module, "lora_embedding_A", None)
    if emb_a is not None and "default" in emb_a:
        a, b = emb_a["default"], module.lora_embedding_B["default"]
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(torch.randn(b.shape, generator=gen) * init_scale / a.shape[0] ** 0.5)
    delta = getattr(module, "trainable_tokens_delta", None)
    if delta is not None and "default" in delta:
        d = delta["default"]
        d.copy_(torch.randn(d.shape, generator=gen) * d.std())
    saved = getattr(module, "modules_to_save", None)
    if saved is not None and "default" in saved and hasattr(saved["default"], "weight"):
        w = saved["default"].weight
        w.add_(torch.randn(w.shape, generator=gen) * w.std() * 0.5)


def make_peft_adapter(base_model_dir: str | Path, out_dir: str | Path, **kwargs) -> Path:
    """Build (see build_peft_model for the keywords) and save_pretrained as safetensors."""
    out = Path(out_dir)
    build_peft_model(base_model_dir, **kwargs).save_pretrained(out, safe_serialization=True)
    return out


def tiny_llama_with_adapter(root: Path) -> tuple[Path, Path]:
    """A tiny Llama whose weights move its logits (initializer 0.3) and a rank-8 q/v adapter
    strong enough to change its greedy tokens: (model dir, adapter dir)."""
    hf = make_tiny_llama(root / "hf", hidden_size=128, intermediate_size=256,
                         initializer_range=0.3)
    peft = build_peft_model(hf, r=8, target_modules=["q_proj", "v_proj"], seed=3,
                            init_scale=0.5)
    peft.save_pretrained(root / "a", safe_serialization=True)
    return hf, root / "a"


def peft_deltas(peft_model) -> dict[str, tuple[torch.Tensor, int, float]]:
    """Full module name (model.layers.i....) -> (scale * lora_B @ lora_A, r, scaling) as PEFT
    applies them."""
    out = {}
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a = module.lora_A["default"].weight.detach()
            b = module.lora_B["default"].weight.detach()
            scaling = module.scaling["default"]
            out[name] = (scaling * (b @ a), module.r["default"], scaling)
    return out


# --- corruption helpers for error tests -----------------------------------------------------


def edit_config(adapter_dir: str | Path, **updates) -> None:
    """Overwrite keys of adapter_config.json (a value of ... deletes the key)."""
    path = Path(adapter_dir) / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for k, v in updates.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


def edit_tensors(adapter_dir: str | Path, fn: Callable[[dict], object]) -> None:
    """Rewrite adapter_model.safetensors through fn(tensors) (in place or returning a dict)."""
    from safetensors.torch import load_file, save_file

    path = Path(adapter_dir) / "adapter_model.safetensors"
    tensors = load_file(path)
    new = fn(tensors)
    tensors = new if isinstance(new, dict) else tensors  # in-place edits may return anything
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)


def truncate_weights(adapter_dir: str | Path, keep_fraction: float = 0.5) -> None:
    path = Path(adapter_dir) / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])


def to_pickle(adapter_dir: str | Path) -> None:
    """Replace the safetensors file with a torch.save'd adapter_model.bin."""
    from safetensors.torch import load_file

    st = Path(adapter_dir) / "adapter_model.safetensors"
    torch.save(load_file(st), Path(adapter_dir) / "adapter_model.bin")
    st.unlink()


def lora_key(layer: int, module: str, kind: str = "lora_A") -> str:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.{kind}.weight"

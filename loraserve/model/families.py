"""The one place that maps a Hugging Face config.json onto our decoder, or refuses it.

A checkpoint is served only when every config field that changes its computation in
transformers is one we compute exactly; anything else is a one-line ValueError naming the
architecture or the field, never an approximation. Fields the file leaves out mean what
transformers' own config class for that model_type says (Qwen3's head_dim is 128, not
hidden/heads), so absent fields are filled by that class before anything is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.config import ModelConfig
from loraserve.model.rope import rope_scaling_from_hf


@dataclass(frozen=True)
class Family:
    architectures: tuple[str, ...]  # the *ForCausalLM class names transformers builds
    # config dict -> ModelConfig computation fields (biases, norms); refusals raise inside
    computation: Callable[[dict, str], dict] = field(default=lambda c, where: {})


def _llama(c: dict, where: str) -> dict:
    bias = bool(c.get("attention_bias"))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias")))


def _no_binding_window(c: dict, where: str, sliding: bool) -> None:
    """Refuse a sliding window that masks something. One at least as long as any context we
    serve (max_model_len <= max_position_embeddings) is plain causal attention."""
    window = c.get("sliding_window")
    if sliding and window is not None and window < c["max_position_embeddings"]:
        raise ValueError(f"{where}: sliding_window={window} shorter than "
                         f"max_position_embeddings={c['max_position_embeddings']} is not "
                         "supported yet")


def _sliding_layers(c: dict) -> bool:
    return "sliding_attention" in (c.get("layer_types") or [])


def _mistral(c: dict, where: str) -> dict:
    _no_binding_window(c, where, sliding=True)  # Mistral's window covers every layer
    return {}


def _qwen2(c: dict, where: str) -> dict:
    _no_binding_window(c, where, _sliding_layers(c))
    return dict(qkv_bias=True)  # always on in Qwen2, whatever attention_bias says


def _qwen3(c: dict, where: str) -> dict:
    _no_binding_window(c, where, _sliding_layers(c))
    bias = bool(c.get("attention_bias"))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _smollm3(c: dict, where: str) -> dict:
    _no_binding_window(c, where, bool(c.get("use_sliding_window")) and _sliding_layers(c))
    use_rope = c.get("no_rope_layers")  # 1 = the layer applies RoPE, 0 = NoPE
    if not isinstance(use_rope, list) or len(use_rope) != c["num_hidden_layers"]:
        raise ValueError(f"{where}: no_rope_layers must list one 0/1 per layer, got {use_rope!r}")
    nope = tuple(i for i, r in enumerate(use_rope) if not r)
    return {**_llama(c, where), "nope_layers": nope}


FAMILIES: dict[str, Family] = {
    "llama": Family(("LlamaForCausalLM",), _llama),
    "mistral": Family(("MistralForCausalLM",), _mistral),
    "qwen2": Family(("Qwen2ForCausalLM",), _qwen2),
    "qwen3": Family(("Qwen3ForCausalLM",), _qwen3),
    "smollm3": Family(("SmolLM3ForCausalLM",), _smollm3),
}
SUPPORTED = "Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM3 (and Llama-shaped ones: SmolLM2, ...)"

# Families users ask for that we know we do not compute, with the reason.
_REFUSED = {
    "gemma": "norm offsets and scaled embeddings",
    "gemma2": "soft-capping, extra norms and sliding windows",
    "gemma3": "soft-capping, extra norms and sliding windows",
    "gemma3_text": "soft-capping, extra norms and sliding windows",
    "granite": "its embedding/attention/residual/logit multipliers",
    "phi3": "fused qkv_proj/gate_up_proj tensors",
    "olmo2": "its norm placement",
    "mixtral": "mixture of experts",
    "qwen2_moe": "mixture of experts",
    "qwen3_moe": "mixture of experts",
    "gpt2": "not a Llama-family decoder",
}
_ACTIVATION = "silu"  # the MLP's activation in every family above


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint at `path`, or a one-line ValueError."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path / 'config.json'} does not hold a JSON object")
    return model_config_from_hf(raw, name=path.name)


def model_config_from_hf(raw: dict, name: str = "model") -> ModelConfig:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json architectures must be a list of names, got {archs!r}")
    where = f"{archs[0] if archs else 'model'} (model_type {model_type!r})"
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        why = _REFUSED.get(model_type, "not one of the supported families")
        raise ValueError(f"{where} is not supported: {why}; loraserve serves {SUPPORTED}")
    for arch in archs:
        if arch not in family.architectures:
            raise ValueError(f"architecture {arch} (model_type {model_type!r}) is not "
                             f"supported; for {model_type} only {', '.join(family.architectures)}")
    c = _with_hf_defaults(raw, where)
    if c.get("hidden_act", _ACTIVATION) != _ACTIVATION:
        raise ValueError(f"{where}: hidden_act {c['hidden_act']!r} is not supported "
                         f"(only {_ACTIVATION!r})")
    rope = c.get("rope_parameters") or c.get("rope_scaling")
    if rope and any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{where}: per-layer rope_parameters are not supported")
    computation = family.computation(c, where)
    return ModelConfig.from_hf_dict(
        c, name, architecture=family.architectures[0],
        rope_scaling=rope_scaling_from_hf(rope, where), **computation)


def _with_hf_defaults(raw: dict, where: str) -> dict:
    """`raw` as transformers reads it: absent fields get the config class's defaults, legacy
    rope_scaling becomes rope_parameters. Its validation errors become one line."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    # Its advice on legacy fields is noise here; a refusal must stay one line on stderr.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoConfig.for_model(**raw).to_dict()
    except Exception as e:  # transformers raises several types, some over several lines
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise ValueError(f"{where}: invalid config.json: {lines[-1] if lines else e!r}") from None
    finally:
        hf_logging.set_verbosity(verbosity)

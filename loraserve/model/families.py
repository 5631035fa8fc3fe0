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

from loraserve.config import ModelConfig, RopeScaling
from loraserve.model.families_moe import moe_fields, olmoe_checks
from loraserve.model.rope import rope_scaling_from_hf


@dataclass(frozen=True)
class Family:
    architectures: tuple[str, ...]  # the *ForCausalLM class names transformers builds
    # config dict -> ModelConfig computation fields (biases, norms); refusals raise inside
    computation: Callable[[dict, str], dict] = field(default=lambda c, where: {})


def _llama(c: dict, where: str) -> dict:
    bias = bool(c.get("attention_bias"))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias")))


def _windows(c: dict, where: str, sliding: list[bool]) -> dict:
    """Per-layer sliding windows (transformers: position p sees positions > p - window). One at
    least as long as any context we serve (max_model_len <= max_position_embeddings) masks
    nothing and is left out, so those layers keep plain causal attention."""
    window = c.get("sliding_window")
    if window is None or not any(sliding):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"{where}: sliding_window must be a positive integer, got {window!r}")
    if window >= c["max_position_embeddings"]:
        return {}
    return dict(layer_windows=tuple(window if s else 0 for s in sliding))


def _sliding_layers(c: dict, where: str) -> list[bool]:
    types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    kinds = {"full_attention", "sliding_attention"}
    if len(types) != c["num_hidden_layers"] or not set(types) <= kinds:
        raise ValueError(f"{where}: layer_types must list full_attention or "
                         f"sliding_attention once per layer, got {types!r}")
    return [t == "sliding_attention" for t in types]


def _every_layer(c: dict) -> list[bool]:  # Mistral and Phi-3: one window for all layers
    return [True] * c["num_hidden_layers"]


def _mistral(c: dict, where: str) -> dict:
    return _windows(c, where, _every_layer(c))


def _qwen2(c: dict, where: str) -> dict:
    # always on in Qwen2, whatever attention_bias says
    return dict(qkv_bias=True, **_windows(c, where, _sliding_layers(c, where)))


def _qwen3(c: dict, where: str) -> dict:
    bias = bool(c.get("attention_bias"))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True,
                **_windows(c, where, _sliding_layers(c, where)))


def _smollm3(c: dict, where: str) -> dict:
    use_rope = c.get("no_rope_layers")  # 1 = the layer applies RoPE, 0 = NoPE
    if not isinstance(use_rope, list) or len(use_rope) != c["num_hidden_layers"]:
        raise ValueError(f"{where}: no_rope_layers must list one 0/1 per layer, got {use_rope!r}")
    nope = tuple(i for i, r in enumerate(use_rope) if not r)
    sliding = [s and bool(c.get("use_sliding_window")) for s in _sliding_layers(c, where)]
    return {**_llama(c, where), "nope_layers": nope, **_windows(c, where, sliding)}


def _phi3(c: dict, where: str) -> dict:
    return dict(fused_modules=True, **_windows(c, where, _every_layer(c)))


def _granite(c: dict, where: str) -> dict:
    return dict(_llama(c, where), embed_scale=_positive(c, "embedding_multiplier", where),
                attn_scale=_positive(c, "attention_multiplier", where),  # not 1/sqrt(hd)
                residual_multiplier=_positive(c, "residual_multiplier", where),
                logits_scaling=_positive(c, "logits_scaling", where))


def _olmo2(c: dict, where: str) -> dict:
    bias = bool(c.get("attention_bias"))
    # norms on the attention and MLP outputs, none before them; q/k norms over all heads
    return dict(qkv_bias=bias, o_bias=bias, pre_norms=False, output_norms=True,
                qk_norm_full=True)


def _qwen2_moe(c: dict, where: str) -> dict:
    return dict(qkv_bias=bool(c.get("qkv_bias", True)),
                **_windows(c, where, _sliding_layers(c, where)),
                **moe_fields(c, where, experts_key="num_experts",
                             inter_key="moe_intermediate_size", shared=True))


def _qwen3_moe(c: dict, where: str) -> dict:
    bias = bool(c.get("attention_bias"))
    # one window on every layer whenever sliding_window is set, as its attention masks
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, **_windows(c, where, _every_layer(c)),
                **moe_fields(c, where, experts_key="num_experts",
                             inter_key="moe_intermediate_size"))


def _olmoe(c: dict, where: str) -> dict:
    olmoe_checks(c, where)
    bias = bool(c.get("attention_bias"))
    # q/k norms over all heads (as OLMo 2), but the usual pre-norms
    return dict(qkv_bias=bias, o_bias=bias, qk_norm_full=True,
                **moe_fields(c, where, experts_key="num_experts",
                             inter_key="intermediate_size"))


def _mixtral(c: dict, where: str) -> dict:
    return dict(**_windows(c, where, _every_layer(c)), routing_fp32=True,
                **moe_fields(c, where, experts_key="num_local_experts",
                             inter_key="intermediate_size", always_norm=True))


def _positive(c: dict, key: str, where: str, optional: bool = False) -> float:
    v = c.get(key)
    if optional and v is None:
        return 0.0
    if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
        raise ValueError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def _gemma(c: dict, where: str) -> dict:
    """Gemma 1-3: RMSNorms scale by (1 + w), embeddings times sqrt(hidden); Gemma 2/3 add
    norms on the block outputs, query_pre_attn_scalar, soft-capping and sliding layers;
    Gemma 3 q/k norms and a local rope base on its sliding layers."""
    if c.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: use_bidirectional_attention is not supported (causal "
                         "decoders only)")
    bias = bool(c.get("attention_bias"))
    out = dict(qkv_bias=bias, o_bias=bias, norm_offset=1.0,
               embed_scale=c["hidden_size"] ** 0.5)
    if c["model_type"] == "gemma":
        return out
    sliding = _sliding_layers(c, where)
    out.update(attn_scale=_positive(c, "query_pre_attn_scalar", where) ** -0.5,
               output_norms=True, **_windows(c, where, sliding),
               attn_softcap=_positive(c, "attn_logit_softcapping", where, optional=True),
               final_softcap=_positive(c, "final_logit_softcapping", where, optional=True))
    if c["model_type"] == "gemma3_text":
        rope = c["rope_parameters"]
        head_dim = c["head_dim"]
        full, local = rope["full_attention"], rope["sliding_attention"]
        if rope_scaling_from_hf(local, where, head_dim) != RopeScaling():
            raise ValueError(f"{where}: rope_parameters.sliding_attention must be default "
                             f"rope, got {local!r}")
        out.update(qk_norm=True, rope_theta=full["rope_theta"],
                   rope_scaling=rope_scaling_from_hf(full, where, head_dim,
                                                     c["max_position_embeddings"]),
                   local_rope_theta=float(local["rope_theta"]),
                   local_rope_layers=tuple(i for i, s in enumerate(sliding) if s))
    return out


FAMILIES: dict[str, Family] = {
    "llama": Family(("LlamaForCausalLM",), _llama),
    "mistral": Family(("MistralForCausalLM",), _mistral),
    "qwen2": Family(("Qwen2ForCausalLM",), _qwen2),
    "qwen3": Family(("Qwen3ForCausalLM",), _qwen3),
    "smollm3": Family(("SmolLM3ForCausalLM",), _smollm3),
    "gemma": Family(("GemmaForCausalLM",), _gemma),
    "gemma2": Family(("Gemma2ForCausalLM",), _gemma),
    "gemma3_text": Family(("Gemma3ForCausalLM",), _gemma),
    "phi3": Family(("Phi3ForCausalLM",), _phi3),
    "granite": Family(("GraniteForCausalLM",), _granite),
    "olmo2": Family(("Olmo2ForCausalLM",), _olmo2),
    "qwen2_moe": Family(("Qwen2MoeForCausalLM",), _qwen2_moe),
    "qwen3_moe": Family(("Qwen3MoeForCausalLM",), _qwen3_moe),
    "olmoe": Family(("OlmoeForCausalLM",), _olmoe),
    "mixtral": Family(("MixtralForCausalLM",), _mixtral),
}
SUPPORTED = ("Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM3, Gemma 1-3 (text), Phi-3, Granite, "
             "OLMo 2, and the mixture-of-experts Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral (and "
             "Llama-shaped ones: SmolLM2, ...)")

# Families users ask for that we know we do not compute, with the reason.
_REFUSED = {
    "gemma3": "the multimodal Gemma 3 (serve a text-only Gemma3ForCausalLM checkpoint)",
    "phi": "not a Llama-family decoder",
    "olmo": "its non-parametric layer norms and qkv clipping",
    "gpt_oss": "gpt-oss's attention sinks, router bias and clamped SwiGLU experts",
    "gpt2": "not a Llama-family decoder",
}
# The gated MLP's activations we compute (llama.py), by transformers' name.
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    computation = family.computation(c, where)
    act_field = "hidden_activation" if "hidden_activation" in c else "hidden_act"
    act = computation.setdefault("hidden_act", c.get(act_field, "silu"))
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: {act_field} {act!r} is not supported "
                         f"(only {', '.join(_ACTIVATIONS)})")
    if "rope_scaling" not in computation:  # per-layer-type rope: the family reads it
        rope = c.get("rope_parameters") or c.get("rope_scaling")
        if rope and any(isinstance(v, dict) for v in rope.values()):
            raise ValueError(f"{where}: per-layer rope_parameters are not supported")
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        computation["rope_scaling"] = rope_scaling_from_hf(rope, where, head_dim,
                                                           c["max_position_embeddings"])
    rs = computation["rope_scaling"]
    if rs.rope_type == "longrope":  # short factors only: cap the context where they end
        computation["max_position_embeddings"] = min(c["max_position_embeddings"],
                                                     rs.original_max_position_embeddings)
    return ModelConfig.from_hf_dict(c, name, architecture=family.architectures[0],
                                    **computation)


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

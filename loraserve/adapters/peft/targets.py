"""Which modules of a model an adapter config targets: PEFT 0.21's matching
(`check_target_module_exists`, `get_pattern_key`) over the module names of our decoders, Phi-3's
fused ones (`qkv_proj`, `gate_up_proj`) included for a model whose checkpoint fuses them; and
per targeted module its rank and scale. A target that names no module of the model, or one we
cannot apply, is refused (a silent no-op adapter is a bug: vLLM #34186)."""

from __future__ import annotations

import math
import re

from loraserve.config import ATTN_MODULES, LORA_MODULES, ModelConfig
from loraserve.types import AdapterFormatError

# fused PEFT module -> the modules it stacks on d_out, in order
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
KNOWN_MODULES = LORA_MODULES + tuple(FUSED_MODULES)
# the vocabulary ends, by PEFT's module name -> our name for them
VOCAB_MODULES = {"model.embed_tokens": "embed_tokens", "lm_head": "lm_head"}


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parent_of(module: str) -> str:
    return "self_attn" if module in ATTN_MODULES or module == "qkv_proj" else "mlp"


def peft_modules(mc: ModelConfig) -> tuple[str, ...]:
    """The LoRA-targetable linears of one layer, as the checkpoint (and PEFT) names them."""
    if mc.fused_modules:
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return LORA_MODULES


def full_name(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{parent_of(module)}.{module}"


def _model_module_names(mc: ModelConfig) -> list[str]:
    """Every module name of a Llama-family *ForCausalLM, as PEFT's matching sees them."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb",
             "lm_head"]
    for i in range(mc.num_hidden_layers):
        pre = f"model.layers.{i}"
        names += [pre, f"{pre}.self_attn", f"{pre}.mlp", f"{pre}.mlp.act_fn"]
        names += [f"{pre}.input_layernorm", f"{pre}.post_attention_layernorm"]
        names += [full_name(i, m) for m in peft_modules(mc)]
    return names


def _suffix_match(targets, key: str) -> bool:
    return key in targets or any(key.endswith(f".{t}") for t in targets)


def is_targeted(cfg: dict, key: str) -> bool:
    """peft.tuners.tuners_utils.check_target_module_exists for a LoRA config."""
    ex = cfg.get("exclude_modules")
    if ex and (re.fullmatch(ex, key) if isinstance(ex, str) else _suffix_match(ex, key)):
        return False
    tm = cfg["target_modules"]
    if isinstance(tm, str):
        return re.fullmatch(tm, key) is not None  # layers_to_transform is ignored for a regex
    if key in tm:
        return True
    if not any(key.endswith(f".{t}") for t in tm):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    lp = cfg.get("layers_pattern")
    if not lp:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        for pat in [lp] if isinstance(lp, str) else lp:
            m = re.match(rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\.", key)
            if m:
                break
    if not m:
        return False
    idx = int(m.group("idx"))
    return idx == layers if _is_int(layers) else idx in layers


def _pattern_value(patterns: dict, key: str, default):
    """peft.utils.other.get_pattern_key: the first pattern matching a dotted suffix of key."""
    for pat in patterns:
        if re.match(rf"(.*\.)?({pat})$", key):
            return patterns[pat]
    return default


def resolve_targets(
    cfg: dict, mc: ModelConfig, path: object, max_lora_rank: int | None
) -> dict[tuple[int, str] | str, tuple[int, float]]:
    """(layer, module), or 'embed_tokens' / 'lm_head', -> (rank, scale) for every module the
    config targets."""
    names = _model_module_names(mc)
    modules = peft_modules(mc)
    lora_names = {full_name(i, m) for i in range(mc.num_hidden_layers) for m in modules}
    lora_names |= set(VOCAB_MODULES)  # LoRA on the embedding and lm_head: lora/extras.py
    tm = cfg["target_modules"]
    if tm == "all-linear":  # PEFT's shorthand: every linear but the output layer
        cfg = {**cfg, "target_modules": list(modules)}
    elif isinstance(tm, str):
        bad = [n for n in names if n not in lora_names and is_targeted(cfg, n)]
        if bad:
            raise _fail(path, f"target_modules regex matches unsupported module {bad[0]!r} "
                              f"(LoRA is supported on {', '.join(modules)})")
    else:
        for t in tm:
            hits = [n for n in names if _suffix_match([t], n)]
            if not hits or any(n not in lora_names for n in hits):
                raise _fail(path, f"target module {t!r} is not a LoRA-targetable module of this "
                                  f"model (supported: {', '.join(modules)}, embed_tokens, "
                                  f"lm_head)")
    ltt = cfg.get("layers_to_transform")
    for i in [ltt] if _is_int(ltt) else ltt or []:
        if not 0 <= i < mc.num_hidden_layers:
            raise _fail(path, f"layers_to_transform has layer {i}, out of range for a "
                              f"{mc.num_hidden_layers}-layer model")
    plan = {}
    for i in range(mc.num_hidden_layers):
        for m in modules:
            key = full_name(i, m)
            if is_targeted(cfg, key):
                plan[(i, m)] = _rank_scale(cfg, key, path, max_lora_rank)
    for key, name in VOCAB_MODULES.items():
        if is_targeted(cfg, key) or _tied_head(cfg, mc, key):
            if cfg.get("use_dora"):
                raise _fail(path, f"DoRA on {name} is not supported yet")
            plan[name] = _rank_scale(cfg, key, path, max_lora_rank)
    if not plan and not cfg.get("modules_to_save") and not cfg.get("trainable_token_indices"):
        raise _fail(path, "adapter_config targets no module of this model")
    return plan


def _tied_head(cfg: dict, mc: ModelConfig, key: str) -> bool:
    """PEFT's ensure_weight_tying on a tied model: lm_head's LoRA is the embedding's,
    transposed (saved as lm_head tensors), though target_modules names only the embedding."""
    return (key == "lm_head" and mc.tie_word_embeddings and bool(cfg.get("ensure_weight_tying"))
            and is_targeted(cfg, "model.embed_tokens"))


def _rank_scale(cfg: dict, key: str, path: object, max_lora_rank: int | None
                ) -> tuple[int, float]:
    r = _pattern_value(cfg.get("rank_pattern") or {}, key, cfg.get("r", 8))
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, key, cfg.get("lora_alpha", 8))
    if max_lora_rank is not None and r > max_lora_rank:
        raise _fail(path, f"rank {r} of {key} exceeds max_lora_rank={max_lora_rank}")
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora", False) else r)

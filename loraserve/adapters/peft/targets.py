"""Which modules of a model an adapter config targets: PEFT 0.21's matching
(`check_target_module_exists`, `get_pattern_key`) over the module names of our decoders, Phi-3's
fused ones (`qkv_proj`, `gate_up_proj`) included for a model whose checkpoint fuses them; and
per targeted module its rank and scale. A target that names no module of the model, or one we
cannot apply, is refused (a silent no-op adapter is a bug: vLLM #34186).

PEFT's regexes (the composed ones, exactly as PEFT builds them) are compiled once per load into
linear-time matchers (linear_regex.py); every loop over patterns or modules checks the load's
budget (budget.py)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from loraserve.adapters.peft.budget import LoadBudget, check_pattern_count
from loraserve.adapters.peft.expert_targets import per_expert_names, resolve_expert_targets
from loraserve.adapters.peft.linear_regex import PatternRefused, compile_linear
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


def parent_of(module: str, mc: ModelConfig | None = None) -> str:
    if module in ATTN_MODULES or module == "qkv_proj":
        return "self_attn"
    # a mixture-of-experts layer's dense MLP is its shared expert (Qwen2-MoE)
    return "mlp.shared_expert" if mc is not None and mc.shared_expert else "mlp"


def peft_modules(mc: ModelConfig) -> tuple[str, ...]:
    """The LoRA-targetable linears of one layer, as the checkpoint (and PEFT) names them;
    the experts' fused weights are PEFT parameters, not modules (peft/expert_targets.py)."""
    if mc.fused_modules:
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return LORA_MODULES if mc.dense_mlp else ATTN_MODULES


def full_name(layer: int, module: str, mc: ModelConfig | None = None) -> str:
    return f"model.layers.{layer}.{parent_of(module, mc)}.{module}"


def _model_module_names(mc: ModelConfig) -> list[str]:
    """Every module name of a Llama-family *ForCausalLM, as PEFT's matching sees them."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb",
             "lm_head"]
    for i in range(mc.num_hidden_layers):
        pre = f"model.layers.{i}"
        names += [pre, f"{pre}.self_attn", f"{pre}.mlp", f"{pre}.mlp.act_fn"]
        names += [f"{pre}.input_layernorm", f"{pre}.post_attention_layernorm"]
        names += [full_name(i, m, mc) for m in peft_modules(mc)]
        if mc.num_experts:  # and transformers v4's (per_expert_names)
            names += [f"{pre}.mlp.gate", f"{pre}.mlp.experts",
                      f"{pre}.block_sparse_moe.gate"]
        if mc.shared_expert:
            names += [f"{pre}.mlp.shared_expert", f"{pre}.mlp.shared_expert_gate"]
    return names + list(per_expert_names(mc).values())


def _suffix_match(targets, key: str) -> bool:
    return key in targets or any(key.endswith(f".{t}") for t in targets)


@dataclass(frozen=True)
class ConfigPatterns:
    """A config's regexes, compiled once: each `.match`/`.fullmatch` is PEFT's re call."""

    target: object | None  # target_modules given as one regex (re.fullmatch)
    exclude: object | None  # exclude_modules given as one regex (re.fullmatch)
    layers: tuple  # layers_pattern, composed as PEFT composes it (re.match)
    rank: tuple  # (regex, rank): get_pattern_key's composed regex for each rank_pattern key
    alpha: tuple  # (regex, alpha), likewise


# PEFT's own layer-index pattern: ours, not the file's, so Python's re runs it safely
_DEFAULT_LAYERS = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


def compile_patterns(cfg: dict, path: object, budget: LoadBudget | None = None) -> ConfigPatterns:
    """Every regex of a validated config as PEFT composes it, in linear-time form; a pattern
    Python's `re` rejects or that cannot be matched in linear time is refused, named."""
    check_pattern_count(cfg, path)
    budget = budget or LoadBudget()

    def compiled(field: str, user: str, composed: str):
        budget.check(path, f"compiling {field}")
        try:
            return compile_linear(composed)
        except PatternRefused as e:
            raise _fail(path, f"{field} regex {user[:80]!r} is refused: {e}") from None

    tm, ex, lp = cfg.get("target_modules"), cfg.get("exclude_modules"), cfg.get("layers_pattern")
    target = compiled("target_modules", tm, tm) if isinstance(tm, str) and \
        tm != "all-linear" else None
    exclude = compiled("exclude_modules", ex, ex) if isinstance(ex, str) else None
    if isinstance(tm, list) and tm and not lp:
        layers = (_DEFAULT_LAYERS,)
    else:
        layers = tuple(compiled("layers_pattern", p, rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")
                       for p in ([lp] if isinstance(lp, str) else lp or []))

    def by_key(field: str) -> tuple:
        return tuple((compiled(field, k, rf"(.*\.)?({k})$"), v)
                     for k, v in (cfg.get(field) or {}).items())

    return ConfigPatterns(target, exclude, layers, by_key("rank_pattern"), by_key("alpha_pattern"))


def is_targeted(cfg: dict, pats: ConfigPatterns, key: str) -> bool:
    """peft.tuners.tuners_utils.check_target_module_exists for a LoRA config."""
    ex = cfg.get("exclude_modules")
    if not cfg.get("target_modules"):  # target_parameters alone (peft/expert_targets.py)
        return False
    if ex and (pats.exclude.fullmatch(key) if isinstance(ex, str) else _suffix_match(ex, key)):
        return False
    tm = cfg["target_modules"]
    if isinstance(tm, str):
        return pats.target.fullmatch(key) is not None  # layers_to_transform is ignored then
    if key in tm:
        return True
    if not any(key.endswith(f".{t}") for t in tm):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    m = None
    for pat in pats.layers:
        m = pat.match(key)
        if m:
            break
    if not m:
        return False
    idx = int(m.group("idx"))
    return idx == layers if _is_int(layers) else idx in layers


def _pattern_value(patterns: tuple, key: str, default):
    """peft.utils.other.get_pattern_key: the first pattern matching a dotted suffix of key."""
    for pat, value in patterns:
        if pat.match(key):
            return value
    return default


def resolve_targets(
    cfg: dict, mc: ModelConfig, path: object, max_lora_rank: int | None,
    budget: LoadBudget | None = None,
) -> dict[tuple[int, str] | str, tuple[int, float]]:
    """(layer, module), or 'embed_tokens' / 'lm_head', -> (rank, scale) for every module the
    config targets."""
    budget = budget or LoadBudget()
    names = _model_module_names(mc)
    modules = peft_modules(mc)
    lora_names = {full_name(i, m, mc) for i in range(mc.num_hidden_layers) for m in modules}
    lora_names |= set(VOCAB_MODULES)  # LoRA on the embedding and lm_head: lora/extras.py
    experts = per_expert_names(mc)
    lora_names |= set(experts.values())
    tm = cfg.get("target_modules") or []
    if tm == "all-linear" and mc.num_experts:
        raise _fail(path, "target_modules 'all-linear' is not supported on a mixture-of-experts "
                          "model (name the modules, and the experts in target_parameters)")
    if tm == "all-linear":  # PEFT's shorthand: every linear but the output layer
        cfg = {**cfg, "target_modules": list(modules)}
    pats = compile_patterns(cfg, path, budget)
    if isinstance(tm, str) and tm != "all-linear":
        for n in names:
            budget.check(path, "matching target_modules")
            if n not in lora_names and is_targeted(cfg, pats, n):
                raise _fail(path, f"target_modules regex matches unsupported module {n!r} "
                                  f"(LoRA is supported on {', '.join(modules)})")
    elif tm != "all-linear":
        for t in tm:
            budget.check(path, "matching target_modules")
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
            key = full_name(i, m, mc)
            budget.check(path, "matching rank_pattern and alpha_pattern")
            if is_targeted(cfg, pats, key):
                plan[(i, m)] = _rank_scale(cfg, pats, key, path, max_lora_rank)
    for key, name in VOCAB_MODULES.items():
        budget.check(path, "matching the embedding and lm_head")
        if is_targeted(cfg, pats, key) or _tied_head(cfg, pats, mc, key):
            if cfg.get("use_dora"):
                raise _fail(path, f"DoRA on {name} is not supported yet")
            plan[name] = _rank_scale(cfg, pats, key, path, max_lora_rank)
    for target, key in experts.items():
        budget.check(path, "matching the experts")
        if is_targeted(cfg, pats, key):
            plan[target] = _rank_scale(cfg, pats, key, path, max_lora_rank)
    plan.update(resolve_expert_targets(
        cfg, mc, path, lambda key: _rank_scale(cfg, pats, key, path, max_lora_rank)))
    if not plan and not cfg.get("modules_to_save") and not cfg.get("trainable_token_indices"):
        raise _fail(path, "adapter_config targets no module of this model")
    return plan


def _tied_head(cfg: dict, pats: ConfigPatterns, mc: ModelConfig, key: str) -> bool:
    """PEFT's ensure_weight_tying on a tied model: lm_head's LoRA is the embedding's,
    transposed (saved as lm_head tensors), though target_modules names only the embedding."""
    return (key == "lm_head" and mc.tie_word_embeddings and bool(cfg.get("ensure_weight_tying"))
            and is_targeted(cfg, pats, "model.embed_tokens"))


def _rank_scale(cfg: dict, pats: ConfigPatterns, key: str, path: object,
                max_lora_rank: int | None) -> tuple[int, float]:
    r = _pattern_value(pats.rank, key, cfg.get("r", 8))
    alpha = _pattern_value(pats.alpha, key, cfg.get("lora_alpha", 8))
    if max_lora_rank is not None and r > max_lora_rank:
        raise _fail(path, f"rank {r} of {key} exceeds max_lora_rank={max_lora_rank}")
    return r, alpha / (math.sqrt(r) if cfg.get("use_rslora", False) else r)

"""adapter_config.json's fields, checked for what we serve exactly: LoRA (with DoRA,
lora_bias and the vocabulary ends' fields; peft/kinds.py refuses the other PEFT kinds by
name), no variant flags we do not compute, well-typed ranks, scales and patterns (their
regexes are compiled by targets.compile_patterns, within the load's bounds)."""

from __future__ import annotations

import math

from loraserve.adapters.peft.budget import check_pattern_count
from loraserve.adapters.peft.kinds import refusal
from loraserve.adapters.peft.vocab_ends import check_vocab_config
from loraserve.types import AdapterFormatError

# Config switches that change the math or add weights beyond what we serve.
_UNSUPPORTED_FLAGS = {
    "use_qalora": "QALoRA", "alora_invocation_tokens": "activated LoRA",
    "layer_replication": "layer_replication",
    "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA",
}


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def validate_config(cfg: dict, path: object) -> None:
    if (why := refusal(cfg.get("peft_type"))) is not None:
        raise _fail(path, why)
    r = cfg.get("r", 8)  # PEFT's defaults when a key is absent
    if not _is_int(r) or r <= 0:
        raise _fail(path, f"r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise _fail(path, f"lora_alpha must be a finite number, got {alpha!r}")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise _fail(path, f"use_rslora must be true or false, got {cfg['use_rslora']!r}")
    for key, what in _UNSUPPORTED_FLAGS.items():
        if cfg.get(key):
            raise _fail(path, f"{what} is not supported yet")
    for key in ("use_dora", "lora_bias", "ensure_weight_tying"):
        if not isinstance(cfg.get(key, False), bool):
            raise _fail(path, f"{key} must be true or false, got {cfg[key]!r}")
    if cfg.get("use_dora") and cfg.get("lora_bias"):
        raise _fail(path, "use_dora with lora_bias is not a valid PEFT config")
    check_vocab_config(cfg, None, path)
    if cfg.get("bias", "none") != "none":
        raise _fail(path, f"bias={cfg['bias']!r} is not supported yet (only 'none')")
    check_pattern_count(cfg, path)
    tm, tp = cfg.get("target_modules"), cfg.get("target_parameters")
    if tp is not None and not (isinstance(tp, list) and all(isinstance(t, str) for t in tp)):
        raise _fail(path, f"target_parameters must be a list of strings, got {str(tp)[:80]!r}")
    if not (tp and tm in (None, [])):  # target_parameters alone is a valid PEFT config
        _check_patterns(tm, "target_modules", path, list_ok=bool(tm))
    _check_patterns(cfg.get("exclude_modules"), "exclude_modules", path, none_ok=True)
    _check_patterns(cfg.get("layers_pattern"), "layers_pattern", path, none_ok=True)
    for name, what in (("rank_pattern", "a positive integer"), ("alpha_pattern", "a number")):
        pat = cfg.get(name) or {}
        if not isinstance(pat, dict):
            raise _fail(path, f"{name} must be an object, got {pat!r}")
        for k, v in pat.items():
            _check_patterns(k, name, path)
            ok = _is_int(v) and v > 0 if name == "rank_pattern" else _is_number(v)
            if not ok:
                raise _fail(path, f"{name}[{k!r}] must be {what}, got {v!r}")
    ltt = cfg.get("layers_to_transform")
    if isinstance(tm, str) and (ltt is not None or cfg.get("layers_pattern") is not None):
        raise _fail(path, "layers_to_transform/layers_pattern cannot be used with a regex "
                          "target_modules (PEFT refuses this too)")
    ltt_list = [ltt] if _is_int(ltt) else ltt
    if ltt is not None and not (isinstance(ltt_list, list) and all(map(_is_int, ltt_list))):
        raise _fail(path, f"layers_to_transform must be an int or a list of ints, got {ltt!r}")


def _check_patterns(value, field: str, path: object, list_ok=True, none_ok=False) -> None:
    """A regex string, or (if list_ok) a list of strings (targets.compile_patterns compiles
    them)."""
    if value is None and none_ok:
        return
    items = value if list_ok and isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in items) or (not items and not none_ok):
        raise _fail(path, f"{field} must be a regex string or a list of strings, got "
                          f"{str(value)[:80]!r}")

"""Reading PEFT LoRA adapters: with adapters/peft/ (files, targets, keys, modules, vocabulary
ends, kinds), the only code that knows PEFT's file names, keys and rules.

Everything is validated before a `LoraAdapterWeights` is returned, so a caller never holds a
half-read adapter. Which modules a config targets is peft/targets.py's (PEFT's own matching,
on our module names and on Phi-3's fused ones); what each tensor is, peft/keys.py's; one
linear's LoRA (with lora_bias and DoRA), peft/modules.py's; the embedding and lm_head parts
(LoRA there, modules_to_save, trainable tokens), peft/vocab_ends.py's.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loraserve.adapters.peft.base_weights import BaseWeights
from loraserve.adapters.peft.files import check_inside, check_safetensors, max_weights_bytes
from loraserve.adapters.peft.keys import parse_key
from loraserve.adapters.peft.kinds import refusal
from loraserve.adapters.peft.modules import LoraModuleWeights, module_weights, unfused
from loraserve.adapters.peft.regex_guard import unsafe_reason
from loraserve.adapters.peft.targets import full_name, resolve_targets
from loraserve.adapters.peft.vocab_ends import check_vocab_config, check_vocab_size, vocab_parts
from loraserve.config import ModelConfig
from loraserve.lora.extras import VocabParts
from loraserve.types import AdapterFormatError

__all__ = ["BaseWeights", "LoraAdapterWeights", "LoraModuleWeights", "read_adapter",
           "read_adapter_config"]

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# Config switches that change the math or add weights beyond what we serve.
_UNSUPPORTED_FLAGS = {
    "use_qalora": "QALoRA", "alora_invocation_tokens": "activated LoRA",
    "layer_replication": "layer_replication", "target_parameters": "target_parameters",
    "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA",
}


@dataclass(frozen=True)
class LoraAdapterWeights:
    path: str
    rank: int  # max rank over modules (0: the adapter has no LoRA module)
    target_modules: frozenset[str]  # subset of LORA_MODULES actually present
    layers: tuple[dict[str, LoraModuleWeights], ...]  # one dict per layer; may lack modules
    nbytes: int  # every tensor it holds, its full copies of embed_tokens / lm_head included
    fingerprint: str  # sha256 over the config and the weights file bytes
    vocab: VocabParts | None = None  # embedding / lm_head parts (lora/extras.py)

    def description(self) -> LoraAdapterWeights:
        """The same adapter without its tensors (they were packed into a slot)."""
        return replace(self, layers=(), vocab=None)


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def read_adapter_config(
    path: str | os.PathLike, model_config: ModelConfig | None = None, *,
    max_lora_rank: int | None = None,
) -> dict:
    """Parse and validate adapter_config.json; with `model_config`, also check that its targets
    exist in the model (and, with `max_lora_rank`, that every targeted rank fits)."""
    cfg, _ = _read_config(path)
    if model_config is not None:
        check_vocab_config(cfg, model_config, path)
        resolve_targets(cfg, model_config, path, max_lora_rank)
    return cfg


def _read_config(path: str | os.PathLike, root: str | None = None) -> tuple[dict, bytes]:
    """The parsed config and its bytes (read once: the fingerprint covers what was parsed)."""
    p = Path(path)
    if not p.exists():
        raise _fail(path, "path does not exist")
    if not p.is_dir():
        raise _fail(path, "path is not a directory (expected a PEFT adapter directory)")
    cfg_file = p / CONFIG_FILE
    if not cfg_file.is_file():
        raise _fail(path, f"missing {CONFIG_FILE}")
    check_inside(cfg_file, root, path)
    raw = cfg_file.read_bytes()
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"invalid JSON in {CONFIG_FILE}: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"{CONFIG_FILE} must hold a JSON object")
    _validate_config(cfg, path)
    return cfg, raw


def _validate_config(cfg: dict, path: object) -> None:
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
    tm = cfg.get("target_modules")
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
    """A regex string, or (if list_ok) a list of strings; every one must compile."""
    if value is None and none_ok:
        return
    items = value if list_ok and isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in items) or (not items and not none_ok):
        raise _fail(path, f"{field} must be a regex string or a list of strings, got {value!r}")
    for v in items:
        if (why := unsafe_reason(v)) is not None:
            raise _fail(path, f"{field} regex {v[:80]!r} is refused: {why}")


def _load_tensors(p: Path, path: object, allow_pickle: bool, root: str | None,
                  max_bytes: int) -> tuple[dict, bytes]:
    """The weights file's tensors and its bytes (read once, so both agree)."""
    st, pkl = p / SAFETENSORS_FILE, p / PICKLE_FILE
    if st.is_file():
        check_inside(st, root, path)
        check_safetensors(st, path, max_bytes)
        data = st.read_bytes()
        try:
            from safetensors.torch import load

            tensors = load(data)
        except Exception as e:  # the parser raises several types on corrupt input
            raise _fail(path, f"corrupt or truncated {SAFETENSORS_FILE}: {e}") from None
    elif pkl.is_file():
        if not allow_pickle:
            raise _fail(path, f"only a pickle {PICKLE_FILE} found; pickle files can run code, "
                              f"convert it to {SAFETENSORS_FILE} or allow pickle adapters")
        check_inside(pkl, root, path)
        if pkl.stat().st_size > max_bytes:
            raise _fail(path, f"{PICKLE_FILE} is larger than an adapter of this model can be")
        data = pkl.read_bytes()
        try:
            tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise _fail(path, f"cannot read {PICKLE_FILE}: {e}") from None
        if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()
        ):
            raise _fail(path, f"{PICKLE_FILE} is not a flat dict of tensors")
    else:
        raise _fail(path, f"missing weights: neither {SAFETENSORS_FILE} nor {PICKLE_FILE}")
    return tensors, data


def read_adapter(
    path: str | os.PathLike, model_config: ModelConfig, *, max_lora_rank: int,
    allow_pickle: bool = False, root: str | None = None, base: BaseWeights | None = None,
) -> LoraAdapterWeights:
    """Read and fully validate a PEFT LoRA adapter directory into float32 host tensors.
    `root`: every file read must resolve inside it. `base`: the model's weights, for DoRA's
    column norms and for the base weights PEFT saves next to a targeted embedding (without
    it, DoRA is refused and such weights are kept as the adapter's own). The fingerprint
    covers the config and the weights: either changing makes another adapter."""
    cfg, raw_cfg = _read_config(path, root)
    mc = model_config
    check_vocab_config(cfg, mc, path)
    plan = resolve_targets(cfg, mc, path, max_lora_rank)
    tensors, data = _load_tensors(Path(path), path, allow_pickle, root,
                                  max_weights_bytes(mc, max_lora_rank))
    fingerprint = hashlib.sha256(hashlib.sha256(raw_cfg).digest() + data).hexdigest()
    check_vocab_size(tensors, mc, path)
    parts: dict[tuple[int, str] | str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        target, part = parse_key(key, path)
        if isinstance(target, tuple) and target[0] >= mc.num_hidden_layers:
            raise _fail(path, f"tensor {key!r} is for layer {target[0]}, out of range for a "
                              f"{mc.num_hidden_layers}-layer model")
        slot = parts.setdefault(target, {})
        if part in slot:
            raise _fail(path, f"duplicate tensors {slot[part][0]!r} and {key!r}")
        slot[part] = (key, t)
    if not parts:
        raise _fail(path, "the weights file holds no LoRA tensors")

    layers: list[dict[str, LoraModuleWeights]] = [{} for _ in range(mc.num_hidden_layers)]
    nbytes = 0
    dora, lora_bias = bool(cfg.get("use_dora")), bool(cfg.get("lora_bias"))
    base_weight = None if base is None else base.module
    for target, slot in sorted((t, p) for t, p in parts.items() if isinstance(t, tuple)):
        layer, module = target
        name = full_name(layer, module)
        if target not in plan:
            raise _fail(path, f"tensors for {name} but adapter_config does not target it")
        w = module_weights(path, name, layer, module, slot, mc, *plan[target], dora,
                           lora_bias, base_weight)
        nbytes += w.nbytes
        layers[layer].update(unfused(module, w, mc))
    vocab = vocab_parts(path, cfg, mc, {k: v for k, v in plan.items() if isinstance(k, str)},
                        {k: v for k, v in parts.items() if isinstance(k, str)}, base)
    ranks = [w.rank for d in layers for w in d.values()]
    if vocab is not None:
        nbytes += vocab.nbytes
        ranks += [lo[0].shape[1] for lo in (vocab.embed_lora,) if lo is not None]
        ranks += [lo[0].shape[0] for lo in (vocab.head_lora,) if lo is not None]
    elif not any(layers):
        raise _fail(path, "the weights file holds no LoRA tensors")
    return LoraAdapterWeights(
        path=str(path), rank=max(ranks, default=0),
        target_modules=frozenset(m for d in layers for m in d), layers=tuple(layers),
        nbytes=nbytes, fingerprint=fingerprint, vocab=vocab,
    )

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
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from loraserve.adapters.peft.base_weights import BaseWeights
from loraserve.adapters.peft.budget import MAX_CONFIG_BYTES, LoadBudget, check_config_shape
from loraserve.adapters.peft.config_checks import validate_config
from loraserve.adapters.peft.expert_targets import EXPERTS
from loraserve.adapters.peft.expert_weights import expert_loras
from loraserve.adapters.peft.file_errors import os_errors_as_load_errors
from loraserve.adapters.peft.files import (
    check_inside,
    max_weights_bytes,
    open_safetensors,
    read_limited,
)
from loraserve.adapters.peft.keys import parse_key
from loraserve.adapters.peft.modules import LoraModuleWeights, module_weights, unfused
from loraserve.adapters.peft.targets import compile_patterns, full_name, resolve_targets
from loraserve.adapters.peft.vocab_ends import check_vocab_config, check_vocab_size, vocab_parts
from loraserve.config import ModelConfig
from loraserve.lora.expert_lora import ExpertLora
from loraserve.lora.extras import VocabParts
from loraserve.types import AdapterFormatError

__all__ = ["BaseWeights", "LoraAdapterWeights", "LoraModuleWeights", "read_adapter",
           "read_adapter_config"]

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"



@dataclass(frozen=True)
class LoraAdapterWeights:
    path: str
    rank: int  # max rank over modules (0: the adapter has no LoRA module)
    target_modules: frozenset[str]  # subset of LORA_MODULES actually present
    layers: tuple[dict[str, LoraModuleWeights], ...]  # one dict per layer; may lack modules
    nbytes: int  # every tensor it holds, its full copies of embed_tokens / lm_head included
    fingerprint: str  # sha256 over the config and the weights file bytes
    vocab: VocabParts | None = None  # embedding / lm_head parts (lora/extras.py)
    experts: tuple[ExpertLora | None, ...] = ()  # per layer: LoRA on its experts; () = none

    def description(self) -> LoraAdapterWeights:
        """The same adapter without its tensors (they were packed into a slot)."""
        return replace(self, layers=(), vocab=None, experts=())


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def read_adapter_config(
    path: str | os.PathLike, model_config: ModelConfig | None = None, *,
    max_lora_rank: int | None = None,
) -> dict:
    """Parse and validate adapter_config.json (its regexes compiled, within the load's
    bounds); with `model_config`, also check that its targets exist in the model (and, with
    `max_lora_rank`, that every targeted rank fits)."""
    with os_errors_as_load_errors(path):
        budget = LoadBudget()
        cfg, _ = _read_config(path, None, budget)
        if model_config is not None:
            check_vocab_config(cfg, model_config, path)
            resolve_targets(cfg, model_config, path, max_lora_rank, budget)
    return cfg


def _read_config(path: str | os.PathLike, root: str | None,
                 budget: LoadBudget) -> tuple[dict, bytes]:
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
    raw = read_limited(cfg_file, MAX_CONFIG_BYTES, path, "an adapter config (size bound)")
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"invalid JSON in {CONFIG_FILE}: {e}") from None
    except RecursionError:
        raise _fail(path, f"{CONFIG_FILE} nests too deeply (the per-load depth bound)") from None
    except ValueError as e:  # e.g. an integer of over 4300 digits
        raise _fail(path, f"invalid JSON in {CONFIG_FILE}: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"{CONFIG_FILE} must hold a JSON object")
    check_config_shape(cfg, path)
    validate_config(cfg, path)
    compile_patterns(cfg, path, budget)
    return cfg, raw


def _load_tensors(p: Path, path: object, allow_pickle: bool, root: str | None,
                  mc: ModelConfig, max_bytes: int) -> tuple[dict, bytes]:
    """The weights file's tensors and its bytes (read once, so both agree)."""
    st, pkl = p / SAFETENSORS_FILE, p / PICKLE_FILE
    if st.is_file():
        check_inside(st, root, path)
        entries, data = open_safetensors(st, path, max_bytes, mc)
        check_vocab_size({e.name: e.shape for e in entries}, mc, path)
        for e in entries:  # names are refused from the header, before any tensor is made
            parse_key(e.name, path, mc)
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
        data = read_limited(pkl, max_bytes, path, "an adapter of this model")
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
    budget: LoadBudget | None = None,
) -> LoraAdapterWeights:
    """Read and fully validate a PEFT LoRA adapter directory into float32 host tensors.
    `root`: every file read must resolve inside it. `base`: the model's weights, for DoRA's
    column norms and for the base weights PEFT saves next to a targeted embedding (without
    it, DoRA is refused and such weights are kept as the adapter's own). The fingerprint
    covers the config and the weights: either changing makes another adapter. `budget`: the
    load's time bound (and the server's cancel switch); a fresh one by default."""
    with os_errors_as_load_errors(path):
        return _read_adapter(path, model_config, max_lora_rank, allow_pickle, root, base,
                             budget or LoadBudget())


def _read_adapter(path, mc: ModelConfig, max_lora_rank: int, allow_pickle: bool,
                  root: str | None, base: BaseWeights | None,
                  budget: LoadBudget) -> LoraAdapterWeights:
    cfg, raw_cfg = _read_config(path, root, budget)
    check_vocab_config(cfg, mc, path)
    plan = resolve_targets(cfg, mc, path, max_lora_rank, budget)
    tensors, data = _load_tensors(Path(path), path, allow_pickle, root, mc,
                                  max_weights_bytes(mc, max_lora_rank))
    budget.check(path, "reading the weights")
    fingerprint = hashlib.sha256(hashlib.sha256(raw_cfg).digest() + data).hexdigest()
    check_vocab_size({k: t.shape for k, t in tensors.items()}, mc, path)  # a pickle's too
    parts: dict[tuple[int, str] | str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        target, part = parse_key(key, path, mc)
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
    experts, n_expert_bytes = expert_loras(path, mc, plan, parts)
    nbytes += n_expert_bytes
    for target, slot in sorted((t, p) for t, p in parts.items() if isinstance(t, tuple)):
        layer, module = target
        if module.startswith(EXPERTS):
            continue
        name = full_name(layer, module, mc)
        if target not in plan:
            raise _fail(path, f"tensors for {name} but adapter_config does not target it")
        budget.check(path, "building the modules")  # DoRA's norms read the base weights
        w = module_weights(path, name, layer, module, slot, mc, *plan[target], dora,
                           lora_bias, base_weight)
        nbytes += w.nbytes
        layers[layer].update(unfused(module, w, mc))
    vocab = vocab_parts(path, cfg, mc, {k: v for k, v in plan.items() if isinstance(k, str)},
                        {k: v for k, v in parts.items() if isinstance(k, str)}, base)
    ranks = [w.rank for d in layers for w in d.values()]
    ranks += [a.shape[1] for e in experts if e is not None for a, _ in e.parts.values()]
    if vocab is not None:
        nbytes += vocab.nbytes
        ranks += [lo[0].shape[1] for lo in (vocab.embed_lora,) if lo is not None]
        ranks += [lo[0].shape[0] for lo in (vocab.head_lora,) if lo is not None]
    elif not any(layers) and not any(experts):
        raise _fail(path, "the weights file holds no LoRA tensors")
    return LoraAdapterWeights(
        path=str(path), rank=max(ranks, default=0),
        target_modules=frozenset(m for d in layers for m in d), layers=tuple(layers),
        nbytes=nbytes, fingerprint=fingerprint, vocab=vocab,
        experts=experts if any(experts) else (),
    )

"""Reading PEFT LoRA adapters: with adapters/peft/ (files, targets), the only code that knows
PEFT's file names, keys and rules.

Everything is validated before a `LoraAdapterWeights` is returned, so a caller never holds a
half-read adapter. Which modules a config targets is peft/targets.py's (PEFT's own matching,
on our module names and on Phi-3's fused ones).

A LoRA on a fused module is one delta on the whole fused output (B: [q + 2kv, r]); it is
handed on as the modules it fuses, each with the same A and its rows of B: exactly the same
delta, in the layout every LoRA backend already takes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.adapters.peft.budget import MAX_CONFIG_BYTES, LoadBudget, check_config_shape
from loraserve.adapters.peft.config_checks import validate_config
from loraserve.adapters.peft.file_errors import os_errors_as_load_errors
from loraserve.adapters.peft.files import (
    check_inside,
    max_weights_bytes,
    open_safetensors,
    read_limited,
)
from loraserve.adapters.peft.targets import (
    FUSED_MODULES,
    KNOWN_MODULES,
    compile_patterns,
    full_name,
    parent_of,
    resolve_targets,
)
from loraserve.config import ModelConfig
from loraserve.types import AdapterFormatError

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"

# '...q_proj.lora_A.weight' or, with an adapter name, '...q_proj.lora_A.default.weight'.
_LORA_KEY_RE = re.compile(r"^(?P<mod>.+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.(?P<param>\w+)$")
_LAYER_MOD_RE = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<name>\w+)$"
)


@dataclass(frozen=True)
class LoraModuleWeights:
    A: torch.Tensor  # [r, d_in] float32, contiguous
    B: torch.Tensor  # [d_out, r] float32, contiguous, already multiplied by `scale`
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with rslora), after rank/alpha patterns


@dataclass(frozen=True)
class LoraAdapterWeights:
    path: str
    rank: int  # max rank over modules
    target_modules: frozenset[str]  # subset of LORA_MODULES actually present
    layers: tuple[dict[str, LoraModuleWeights], ...]  # one dict per layer; may lack modules
    nbytes: int
    fingerprint: str  # sha256 over the config and the weights file bytes


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
        for e in entries:  # names are refused from the header, before any tensor is made
            _parse_key(e.name, path)
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


def _parse_key(key: str, path: object) -> tuple[int, str, str]:
    """(layer, module, 'lora_A'|'lora_B') for a LoRA weight key; refuse what we cannot serve."""
    if "lora_embedding_" in key:
        raise _fail(path, f"embedding LoRA tensor {key!r} is not supported yet")
    if "magnitude_vector" in key:
        raise _fail(path, f"DoRA magnitude tensor {key!r} is not supported yet")
    m = _LORA_KEY_RE.match(key)
    if m is None:
        raise _fail(path, f"unexpected tensor {key!r} (only LoRA A/B weights are supported)")
    if m["param"] != "weight":
        raise _fail(path, f"LoRA {m['param']} tensor {key!r} is not supported yet")
    mod = m["mod"].removeprefix("base_model.model.")
    lm = _LAYER_MOD_RE.match(m["mod"])
    if lm is None or lm["name"] not in KNOWN_MODULES or lm["parent"] != parent_of(lm["name"]):
        raise _fail(path, f"tensor {key!r} targets module {mod!r}, which is not supported "
                          f"(supported: {', '.join(KNOWN_MODULES)})")
    return int(lm["layer"]), lm["name"], m["kind"]


def read_adapter(
    path: str | os.PathLike, model_config: ModelConfig, *, max_lora_rank: int,
    allow_pickle: bool = False, root: str | None = None, budget: LoadBudget | None = None,
) -> LoraAdapterWeights:
    """Read and fully validate a PEFT LoRA adapter directory into float32 host tensors.
    `root`: every file read must resolve inside it. The fingerprint covers the config and the
    weights: either changing makes another adapter. `budget`: the load's time bound (and the
    server's cancel switch); a fresh one by default."""
    with os_errors_as_load_errors(path):
        return _read_adapter(path, model_config, max_lora_rank, allow_pickle, root,
                             budget or LoadBudget())


def _read_adapter(path, model_config: ModelConfig, max_lora_rank: int, allow_pickle: bool,
                  root: str | None, budget: LoadBudget) -> LoraAdapterWeights:
    cfg, raw_cfg = _read_config(path, root, budget)
    plan = resolve_targets(cfg, model_config, path, max_lora_rank, budget)
    tensors, data = _load_tensors(Path(path), path, allow_pickle, root, model_config,
                                  max_weights_bytes(model_config, max_lora_rank))
    budget.check(path, "reading the weights")
    fingerprint = hashlib.sha256(hashlib.sha256(raw_cfg).digest() + data).hexdigest()
    n_layers = model_config.num_hidden_layers
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        layer, module, kind = _parse_key(key, path)
        if layer >= n_layers:
            raise _fail(path, f"tensor {key!r} is for layer {layer}, out of range for a "
                              f"{n_layers}-layer model")
        slot = pairs.setdefault((layer, module), {})
        if kind in slot:
            raise _fail(path, f"duplicate tensors {slot[kind][0]!r} and {key!r}")
        slot[kind] = (key, t)
    if not pairs:
        raise _fail(path, "the weights file holds no LoRA tensors")

    layers: list[dict[str, LoraModuleWeights]] = [{} for _ in range(n_layers)]
    nbytes = 0
    for (layer, module), slot in sorted(pairs.items()):
        name = full_name(layer, module)
        if len(slot) != 2:
            raise _fail(path, f"{name} has only a {next(iter(slot))} tensor")
        if (layer, module) not in plan:
            raise _fail(path, f"tensors for {name} but adapter_config does not target it")
        shape = model_config.module_shape(module)
        w = _module_weights(path, name, slot, shape, *plan[(layer, module)])
        nbytes += w.A.nbytes + w.B.nbytes
        layers[layer].update(_unfused(module, w, model_config))
    mods = [w for d in layers for w in d.values()]
    return LoraAdapterWeights(
        path=str(path), rank=max(w.rank for w in mods),
        target_modules=frozenset(m for d in layers for m in d), layers=tuple(layers),
        nbytes=nbytes, fingerprint=fingerprint,
    )


def _unfused(module: str, w: LoraModuleWeights, mc: ModelConfig) -> dict[str, LoraModuleWeights]:
    """A fused module's LoRA as the modules it fuses: the same A (one tensor), its B's rows."""
    if module not in FUSED_MODULES:
        return {module: w}
    out, row = {}, 0
    for sub in FUSED_MODULES[module]:
        rows = mc.module_shape(sub)[0]
        out[sub] = LoraModuleWeights(A=w.A, B=w.B[row : row + rows].contiguous(), rank=w.rank,
                                     scale=w.scale)
        row += rows
    return out


def _module_weights(path, name, slot, shape, want_rank: int, scale: float) -> LoraModuleWeights:
    """Check one module's A/B pair against the base shape and the config; scale B."""
    (ka, a), (kb, b) = slot["lora_A"], slot["lora_B"]
    d_out, d_in = shape
    for k, t in ((ka, a), (kb, b)):
        if not t.is_floating_point():
            raise _fail(path, f"tensor {k!r} has non-float dtype {t.dtype}")
    if a.dim() != 2 or a.shape[1] != d_in:
        raise _fail(path, f"tensor {ka!r} has shape {list(a.shape)}, expected [r, {d_in}]")
    if b.dim() != 2 or b.shape[0] != d_out:
        raise _fail(path, f"tensor {kb!r} has shape {list(b.shape)}, expected [{d_out}, r]")
    rank = a.shape[0]
    if b.shape[1] != rank:
        raise _fail(path, f"A/B rank mismatch for {name}: lora_A has rank {rank}, "
                          f"lora_B has rank {b.shape[1]}")
    if rank != want_rank:
        raise _fail(path, f"{name} has rank {rank} in its tensors but rank {want_rank} "
                          f"in adapter_config (r / rank_pattern)")
    a32, b32 = a.to(torch.float32).contiguous(), b.to(torch.float32)
    for k, t in ((ka, a32), (kb, b32)):
        if not torch.isfinite(t).all():
            raise _fail(path, f"tensor {k!r} contains NaN or inf")
    return LoraModuleWeights(A=a32, B=(b32 * scale).contiguous(), rank=rank, scale=float(scale))

"""What each tensor key of a PEFT LoRA weights file is: which module, which part.

Parts of a layer's linear: `lora_A`, `lora_B`, `lora_B.bias` (lora_bias), `magnitude` (DoRA's
lora_magnitude_vector). Parts of the vocabulary ends (`embed_tokens`, `lm_head`): `lora_A` /
`lora_B` (lm_head, a linear), `embedding_A` / `embedding_B` (lora_embedding_A/B), `base` (the
base weight PEFT saves next to a targeted embedding: `base_layer.weight`), `copy`
(modules_to_save: the module's own full weight) and `tokens` (trainable tokens' new rows).
Anything else is refused by name.
"""

from __future__ import annotations

import re

from loraserve.adapters.peft.expert_targets import EXPERTS, per_expert_modules
from loraserve.adapters.peft.targets import KNOWN_MODULES, VOCAB_MODULES, parent_of
from loraserve.config import ModelConfig
from loraserve.types import AdapterFormatError

# 'mod.kind[.adapter name][.param]'; the adapter name is absent from saved files but allowed
_PART_RE = re.compile(
    r"^(?P<mod>.+?)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector|base_layer|token_adapter)(?:\.(?P<rest>.+))?$"
)
_LAYER_MOD_RE = re.compile(
    r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>\w+(?:\.shared_expert)?)\.(?P<name>\w+)$"
)
# PEFT's ParamWrappers on a layer's fused experts (peft/expert_targets.py): each base_layer
# one wrapper deeper
_EXPERT_RE = re.compile(
    r"^(?:model\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<wrap>(?:base_layer\.)*)"
    r"(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$"
)
# transformers v4's one nn.Linear per expert (peft/expert_targets.per_expert_names)
_PER_EXPERT_RE = re.compile(
    r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\."
    r"(?P<expert>\d+)\.(?P<name>\w+)\.(?P<kind>lora_A|lora_B)(?:\.[^.]+)?\.weight$"
)
_PARTS = {
    ("lora_A", "weight"): "lora_A", ("lora_B", "weight"): "lora_B",
    ("lora_B", "bias"): "lora_B.bias", ("lora_magnitude_vector", None): "magnitude",
    ("lora_magnitude_vector", "weight"): "magnitude",
    ("lora_embedding_A", None): "embedding_A", ("lora_embedding_B", None): "embedding_B",
    ("base_layer", "weight"): "base", ("token_adapter", "trainable_tokens_delta"): "tokens",
}
_LAYER_PARTS = ("lora_A", "lora_B", "lora_B.bias", "magnitude")

Target = tuple[int, str] | str  # (layer, module) of a decoder layer, or a vocabulary end


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def parse_key(key: str, path: object, mc: ModelConfig | None = None) -> tuple[Target, str]:
    """(target, part) of one tensor key; refuse what we cannot serve, naming it. Fused expert
    weights are (layer, "experts#<depth>"), v4's per-expert modules (layer,
    "experts:<e>:<module>") (peft/expert_targets.py); `mc` tells a shared expert's MLP from a
    plain one, and which expert modules the model has."""
    name = key.removeprefix("base_model.model.")
    if (me := _EXPERT_RE.match(name)) is not None:
        depth = me["wrap"].count("base_layer.")
        return (int(me["layer"]), f"{EXPERTS}#{depth}"), me["kind"]
    if (me := _PER_EXPERT_RE.match(name)) is not None:
        block, mods = per_expert_modules(mc) if mc is not None else (me["block"], None)
        if me["block"] != block or (mods is not None and me["name"] not in mods):
            raise _fail(path, f"tensor {key!r} targets an expert module this model does not "
                              f"have")
        return (int(me["layer"]), f"{EXPERTS}:{int(me['expert'])}:{me['name']}"), me["kind"]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # modules_to_save
        return VOCAB_MODULES[name.removesuffix(".weight")], "copy"
    m = _PART_RE.match(name)
    if m is None:
        raise _fail(path, f"unexpected tensor {key!r} (not a LoRA weight, a DoRA magnitude, "
                          f"a lora_bias, an embedding or lm_head part)")
    rest = m["rest"]
    param = None if rest is None else rest.rsplit(".", 1)[-1]
    if param not in ("weight", "bias", "trainable_tokens_delta") and rest is not None:
        param = None  # 'lora_embedding_A.<adapter name>'
    part = _PARTS.get((m["kind"], param))
    if part is None:
        raise _fail(path, f"tensor {key!r}: {m['kind']} {param or ''} is not supported")
    mod = m["mod"]
    if mod in VOCAB_MODULES:
        return VOCAB_MODULES[mod], part
    lm = _LAYER_MOD_RE.match(mod)
    if lm is None or lm["name"] not in KNOWN_MODULES or lm["parent"] != parent_of(lm["name"],
                                                                                   mc):
        raise _fail(path, f"tensor {key!r} targets module {mod!r}, which is not supported "
                          f"(supported: {', '.join(KNOWN_MODULES)}, embed_tokens, lm_head)")
    if part not in _LAYER_PARTS:
        raise _fail(path, f"tensor {key!r}: a {part} part on {mod!r} is not supported")
    return (int(lm["layer"]), lm["name"]), part

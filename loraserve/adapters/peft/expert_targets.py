"""LoRA on the experts of a mixture-of-experts model, as PEFT saves it: `target_parameters`
on the fused expert weights transformers keeps per layer (`mlp.experts.gate_up_proj`
[E, 2 * inter, d] and `mlp.experts.down_proj` [E, d, inter]), one `lora.ParamWrapper` each.

PEFT's ParamWrapper (peft/tuners/lora/layer.py) holds one A of [E * r, d_in] and one B of
[d_out, E * r]; expert e's delta is `scale * B_e @ A_e` with A_e = A.reshape(E, r, d_in)[e]
and B_e = B.reshape(d_out, r, E)[:, :, e] (its rank columns interleaved across experts).
Two targeted parameters of one module nest: the first wrapped, in the module's parameter
order (gate_up_proj, then down_proj), is innermost, so its keys carry one more
`base_layer.` than the next; the file's keys name no parameter, only that depth. PEFT matches
a target parameter by its full name or a dotted suffix (BaseTuner._inject_parameters);
exclude_modules and layers_to_transform do not apply to them there, nor here.

Adapters trained on transformers v4, whose experts were one nn.Linear each, target them with
target_modules (`mlp.experts.3.gate_proj`, Mixtral's `block_sparse_moe.experts.3.w1`): each
expert's module its own LoRA, matched like any module. PEFT converts these on load into the
fused form (peft/utils/transformers_weight_conversion.py: gate's and up's A stacked on the
rank, their B block-diagonal), and so do we (peft/expert_weights.py).
"""

from __future__ import annotations

from collections.abc import Callable

from loraserve.config import ModelConfig
from loraserve.types import AdapterFormatError

# in the order transformers registers them on its *Experts modules (PEFT's nesting order)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
PART_OF = {"gate_up_proj": "gate_up", "down_proj": "down"}  # model/moe.py's part names
EXPERTS = "experts"  # the module of keys.py's expert targets: (layer, "experts#<depth>")


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def per_expert_modules(mc: ModelConfig) -> tuple[str, dict[str, str]]:
    """The v4 block name and its expert linears -> our part and half ("gate_up.0" is gate)."""
    if mc.architecture == "MixtralForCausalLM":
        return "block_sparse_moe", {"w1": "gate_up.0", "w3": "gate_up.1", "w2": "down.0"}
    return "mlp", {"gate_proj": "gate_up.0", "up_proj": "gate_up.1", "down_proj": "down.0"}


def per_expert_names(mc: ModelConfig) -> dict[tuple[int, str], str]:
    """(layer, "experts:<e>:<module>") -> the v4 module's full name, every expert linear."""
    if not mc.num_experts:
        return {}
    block, mods = per_expert_modules(mc)
    return {(i, f"{EXPERTS}:{e}:{m}"): f"model.layers.{i}.{block}.experts.{e}.{m}"
            for i in range(mc.num_hidden_layers) for e in range(mc.num_experts) for m in mods}


def param_name(layer: int, param: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{param}"


def resolve_expert_targets(cfg: dict, mc: ModelConfig, path: object,
                           rank_scale: Callable[[str], tuple[int, float]]
                           ) -> dict[tuple[int, str], tuple[int, float]]:
    """(layer, "experts.<param>") -> (rank, scale) for every expert weight targeted."""
    targets = cfg.get("target_parameters") or []
    if not targets:
        return {}
    if not mc.num_experts:
        raise _fail(path, "target_parameters is served only on the experts of a "
                          "mixture-of-experts model")
    for key in ("use_dora", "lora_bias"):
        if cfg.get(key):  # PEFT's ParamWrapper refuses these too
            raise _fail(path, f"{key} with target_parameters is not supported (nor by PEFT)")
    names = {(i, p): param_name(i, p) for i in range(mc.num_hidden_layers)
             for p in EXPERT_PARAMS}

    def hit(name: str, t: str) -> bool:
        return name == t or name.endswith(f".{t}")

    for t in targets:
        if not any(hit(n, t) for n in names.values()):
            raise _fail(path, f"target_parameters entry {t!r} is not an expert weight of this "
                              f"model (served: experts.gate_up_proj, experts.down_proj; not "
                              f"the router)")
    return {(i, f"{EXPERTS}.{p}"): rank_scale(n) for (i, p), n in names.items()
            if any(hit(n, t) for t in targets)}


def param_at_depth(plan: dict, layer: int, depth: int) -> str | None:
    """The parameter whose wrapper sits `depth` base_layers deep in `layer`'s keys."""
    nested = [p for p in EXPERT_PARAMS if (layer, f"{EXPERTS}.{p}") in plan][::-1]
    return nested[depth] if depth < len(nested) else None

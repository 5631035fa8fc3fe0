"""An adapter's LoRA on the experts of each layer (lora/expert_lora.ExpertLora: per part, A
[E, R, d_in] and B [E, d_out, R] with the scale in), from either form PEFT saves
(peft/expert_targets.py):

- target_parameters on the fused weights: ParamWrapper's A [E * r, d_in] and B [d_out, E * r]
  (expert e's rank columns at e, e + E, ...), unstacked;
- transformers v4's per-expert modules: gate's and up's A stacked on the rank and their B
  block-diagonal, as PEFT converts them, so the fused gate_up gets exactly the two deltas.
  Experts or halves an adapter leaves out are zero blocks, and ranks that differ between
  experts (rank_pattern) are padded with zeros: zeros add nothing, and the memory they take
  is counted like the rest.

A layer with both forms is refused: PEFT would wrap the same weight twice.
"""

from __future__ import annotations

import torch

from loraserve.adapters.peft.expert_targets import (
    EXPERTS,
    PART_OF,
    param_at_depth,
    per_expert_modules,
)
from loraserve.adapters.peft.modules import float_tensor
from loraserve.config import ModelConfig
from loraserve.lora.expert_lora import ExpertLora
from loraserve.types import AdapterFormatError


def _fail(path: object, problem: str) -> AdapterFormatError:
    return AdapterFormatError(f"adapter {path}: {problem}")


def _part_shape(mc: ModelConfig, part: str) -> tuple[int, int]:
    """(d_out, d_in) of one expert's fused part."""
    i, d = mc.moe_intermediate_size, mc.hidden_size
    return (2 * i, d) if part == "gate_up" else (d, i)


def _ab(path, name: str, parts: dict, shape_a: tuple, shape_b: tuple):
    for need in ("lora_A", "lora_B"):
        if need not in parts:
            raise _fail(path, f"{name} has no {need} tensor")
    return (float_tensor(path, *parts["lora_A"], shape_a),
            float_tensor(path, *parts["lora_B"], shape_b))


def fused_expert_weights(path: object, name: str, parts: dict, mc: ModelConfig, part: str,
                         rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [E, r, d_in], B [E, d_out, r] times scale) of one ParamWrapper."""
    e = mc.num_experts
    d_out, d_in = _part_shape(mc, part)
    a, b = _ab(path, name, parts, (e * rank, d_in), (d_out, e * rank))
    return (a.reshape(e, rank, d_in).contiguous(),
            (b.reshape(d_out, rank, e).permute(2, 0, 1) * scale).contiguous())


def _per_expert(path, mc: ModelConfig, plan: dict, layer: int, found: dict
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A layer's v4 per-expert LoRA: {(expert, part, half): (A [r, d_in], B [d_out_half, r])
    scaled} -> per part the stacked, block-diagonal (A, B)."""
    block, mods = per_expert_modules(mc)
    halves: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for module, slot in found.items():
        _, e, m = module.split(":")
        e = int(e)
        name = f"model.layers.{layer}.{block}.experts.{e}.{m}"
        if e >= mc.num_experts or (layer, module) not in plan:
            raise _fail(path, f"tensors for {name} but adapter_config does not target it "
                              f"(or the model has no such expert)")
        rank, scale = plan[(layer, module)]
        part, half = mods[m].split(".")
        d_out, d_in = _part_shape(mc, part)
        d_half = d_out // 2 if part == "gate_up" else d_out
        a, b = _ab(path, name, slot, (rank, d_in), (d_half, rank))
        halves[(e, part, int(half))] = (a, b * scale)
    out = {}
    for part in ("gate_up", "down"):
        here = {k: v for k, v in halves.items() if k[1] == part}
        if not here:
            continue
        d_out, d_in = _part_shape(mc, part)
        n_halves = 2 if part == "gate_up" else 1
        width = [max((here[k][0].shape[0] for k in here if k[2] == h), default=0)
                 for h in range(n_halves)]
        a_all = torch.zeros(mc.num_experts, sum(width), d_in)
        b_all = torch.zeros(mc.num_experts, d_out, sum(width))
        for (e, _, h), (a, b) in here.items():
            r0, c0, r = sum(width[:h]), h * (d_out // n_halves), a.shape[0]
            a_all[e, r0 : r0 + r] = a
            b_all[e, c0 : c0 + b.shape[0], r0 : r0 + r] = b
        out[part] = (a_all, b_all)
    return out


def expert_loras(path, mc: ModelConfig, plan: dict, parts: dict
                 ) -> tuple[tuple[ExpertLora | None, ...], int]:
    """Per layer, the LoRA on its experts, and its bytes."""
    fused: list[dict] = [{} for _ in range(mc.num_hidden_layers)]
    per_expert: list[dict] = [{} for _ in range(mc.num_hidden_layers)]
    for (layer, module), slot in sorted((t, p) for t, p in parts.items()
                                        if isinstance(t, tuple) and t[1].startswith(EXPERTS)):
        if module.startswith(f"{EXPERTS}:"):
            per_expert[layer][module] = slot
            continue
        depth = int(module.split("#")[1])
        param = param_at_depth(plan, layer, depth)
        name = f"model.layers.{layer}.mlp.experts{'.base_layer' * depth}"
        if param is None:
            raise _fail(path, f"tensors for {name} but adapter_config's target_parameters do "
                              f"not target that many expert weights there")
        fused[layer][PART_OF[param]] = fused_expert_weights(
            path, f"{name} ({param})", slot, mc, PART_OF[param],
            *plan[(layer, f"{EXPERTS}.{param}")])
    for target in plan:
        if isinstance(target, tuple) and target[1].startswith(f"{EXPERTS}.") and \
                PART_OF[target[1].split(".")[1]] not in fused[target[0]]:
            raise _fail(path, f"adapter_config targets {target[1]} in layer {target[0]} but "
                              f"the weights file has no tensors for it")
    out = []
    for layer in range(mc.num_hidden_layers):
        if fused[layer] and per_expert[layer]:
            raise _fail(path, f"layer {layer} has LoRA on its experts both per expert module "
                              f"and through target_parameters")
        d = fused[layer] or _per_expert(path, mc, plan, layer, per_expert[layer])
        out.append(ExpertLora(d) if d else None)
    return tuple(out), sum(e.nbytes for e in out if e is not None)

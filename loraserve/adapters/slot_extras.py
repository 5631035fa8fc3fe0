"""An adapter's parts beyond B @ A, as its slot holds them (lora/extras.AdapterExtras): per
layer and module group, DoRA's column scale and lora_bias's bias laid over the group's fused
output columns (1 and 0 on the columns of modules without them), its vocabulary parts and
its expert LoRA, on the slot pool's device. Kept in float32: they scale and shift outputs,
where bf16 would round what PEFT computes in float32."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loraserve.lora.extras import AdapterExtras, ColumnEpilogue
from loraserve.lora.layout import GroupLayout

if TYPE_CHECKING:
    from loraserve.adapters.format import LoraAdapterWeights


def pack_extras(weights: LoraAdapterWeights, layouts: dict[str, GroupLayout],
                device: torch.device) -> AdapterExtras | None:
    """None when the adapter is plain LoRA (its slot then costs a step nothing more)."""
    epilogues = []
    for mods in weights.layers:
        per_group = {}
        for g, lay in layouts.items():
            here = [(c0, d, mods[m]) for m, c0, d in zip(lay.modules, lay.col_offsets,
                                                         lay.d_outs, strict=True) if m in mods]
            scale = bias = None
            if any(mw.col_scale is not None for _, _, mw in here):
                scale = torch.ones(lay.d_out, dtype=torch.float32)
            if any(mw.bias is not None for _, _, mw in here):
                bias = torch.zeros(lay.d_out, dtype=torch.float32)
            for c0, d, mw in here:
                if scale is not None and mw.col_scale is not None:
                    scale[c0 : c0 + d] = mw.col_scale
                if bias is not None and mw.bias is not None:
                    bias[c0 : c0 + d] = mw.bias
            if scale is not None or bias is not None:
                per_group[g] = ColumnEpilogue(
                    scale=None if scale is None else scale.to(device),
                    bias=None if bias is None else bias.to(device))
        epilogues.append(per_group)
    vocab = None if weights.vocab is None else weights.vocab.to(device)
    experts = tuple(None if e is None else e.to(device) for e in weights.experts)
    if vocab is None and not any(epilogues) and not any(experts):
        return None
    return AdapterExtras(tuple(epilogues) if any(epilogues) else (), vocab,
                         experts if any(experts) else ())
